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
