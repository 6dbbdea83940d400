"""The layer drawing in docs/concepts.md says what the import-linter contract enforces."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def contract_layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [contract["layers"] for contract in config["contracts"] if contract["type"] == "layers"]
    return [[name.strip() for name in re.split(r"[:|]", layer)] for layer in layers]


def drawn_layers() -> list[list[str]]:
    page = (ROOT / "docs" / "concepts.md").read_text()
    (diagram,) = re.findall(r"```mermaid\n(.*?)```", page, flags=re.S)
    layers = []
    for body in re.findall(r"subgraph \w+\n(.*?)\n\s*end", diagram, flags=re.S):
        layers.append(re.findall(r'\["([^"]+)"\]', body))
    return layers


def test_the_drawing_shows_the_contracts_layers_in_order() -> None:
    assert drawn_layers() == contract_layers()


def test_every_module_of_hfpatch_core_is_in_a_layer() -> None:
    modules = {path.stem for path in (ROOT / "hfpatch_core").glob("*.py")} - {"__init__"}
    modules |= {path.parent.name for path in (ROOT / "hfpatch_core").glob("*/__init__.py")}
    placed = {name for layer in contract_layers() for name in layer}
    assert modules == placed


def test_the_contract_holds() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_the_top_level_holds_at_most_twelve_modules() -> None:
    modules = sorted(path.name for path in (ROOT / "hfpatch_core").glob("*.py"))
    assert len(modules) <= 12, modules


def test_all_the_lazy_exports_and_the_type_checking_imports_name_the_same_objects() -> None:
    import ast
    import importlib

    import hfpatch_core

    init = (ROOT / "hfpatch_core" / "__init__.py").read_text()
    (block,) = [
        node for node in ast.parse(init).body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ][1:]
    stubs = {
        alias.name: node.module.lstrip(".")
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    exports = hfpatch_core._EXPORTS
    assert stubs == exports
    assert sorted(hfpatch_core.__all__) == sorted([*exports, "__version__"])
    for name, module in exports.items():
        assert getattr(hfpatch_core, name) is getattr(importlib.import_module(f"hfpatch_core.{module}"), name), name


PUBLIC_IMPORT = re.compile(r"^\s*(?:from|import)\s+(hfpatch_core[\w.]*)(?:\s+import\s+\(?([^)\n]*))?", re.M)


def _imports_of_hfpatch_core(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for module, names in PUBLIC_IMPORT.findall(path.read_text()):
        found.append((module, [name.strip().split(" as ")[0] for name in names.split(",") if name.strip()]))
    return found


def test_packs_and_the_template_import_only_the_public_surface() -> None:
    sources = [
        *(ROOT / "plugins").glob("*/hfpatch_pack_*/**/*.py"),
        *(ROOT / "docs" / "examples").glob("*/*.py"),
        *(ROOT / "cookiecutter-template").glob("{{cookiecutter.project_slug}}/**/*.py"),
    ]
    assert len(sources) >= 10
    private = [
        f"{path.relative_to(ROOT)}: {module} {names}"
        for path in sources
        for module, names in _imports_of_hfpatch_core(path)
        if any(part.startswith("_") for part in module.split(".")) or any(name.startswith("_") for name in names)
    ]
    assert private == []
