"""Every ``python`` block of the documentation runs.

One test case per page (``docs/*.md`` and ``README.md``): the page's ```` ```python ````
blocks run in order in one namespace, as a reader would paste them.  The preamble the
pages document (docs/index.md, "About the examples"):

* the working directory is a fresh temporary directory holding ``./my-checkpoint``, a
  tiny random llama checkpoint from ``hfpatch_core.testing.tiny_checkpoint``;
* the example packs of ``docs/examples/`` are installed as real distributions on a
  temporary ``sys.path`` entry: ``fused-mlp`` and ``rival-mlp`` (README.md gets
  ``my-pack`` instead, the name its pytest example uses);
* a block that defines ``test_*`` functions is a test module: after the page's blocks,
  each such function is called with the pytest fixtures its parameters name
  (``tiny_checkpoint``, ``hfpatch_disabled``, ...), with hfpatch disabled and the
  environment as it was before the page, like a separate pytest run.

A line ``--8<-- "path"`` inside a block is replaced by ``docs/path``, as the
``pymdownx.snippets`` extension does when the site is built.  Blocks in other languages
(console, text, toml, ...) are not run.  After each page, hfpatch is disabled and the
environment, working directory, logging and imported example modules are restored
(``conftest._isolation`` restores transformers' registries).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, LlamaForCausalLM

import hfpatch_core
from hfpatch_core.testing import tiny_checkpoint
from packs import PackSpec, install_packs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
PAGES = sorted(DOCS.glob("*.md"))
README = ROOT / "README.md"

#: Fence languages whose blocks run, and the others a page may use ("" is a bare fence).
RUNNABLE = frozenset({"python", "py"})
NOT_RUN = frozenset({"", "console", "text", "toml", "yaml", "ini", "json", "diff", "mermaid"})

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_INCLUDE = re.compile(r'^[ \t]*--8<--[ \t]+"(?P<path>[^"]+)"[ \t]*$')


def _source(name: str) -> str:
    return (EXAMPLES / name).read_text(encoding="utf-8")


#: The example packs the pages use, installed from their sources in docs/examples/.
DOC_PACKS = (
    PackSpec(
        "fused-mlp",
        _source("hfpatch_pack_fused_mlp.py"),
        module="hfpatch_pack_fused_mlp",
        summary="Llama MLP with fused gate/up projections",
    ),
    PackSpec(
        "rival-mlp",
        _source("hfpatch_pack_rival_mlp.py"),
        module="hfpatch_pack_rival_mlp",
        summary="Another LlamaMLP replacement (priority -1)",
    ),
)

#: README.md's examples name their pack ``my-pack``; it is the ``fused-mlp`` example.
README_PACKS = (dataclasses.replace(DOC_PACKS[0], name="my-pack", distribution="hfpatch-pack-my-pack"),)

EXAMPLE_MODULES = ("hfpatch_pack_fused_mlp", "hfpatch_pack_rival_mlp")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the first line of code
    language: str
    code: str


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with its language and first code line."""
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = opening["info"].strip().split(" ")[0].lower() if opening["info"].strip() else ""
        body: list[str] = []
        index += 1
        start = index + 1
        while index < len(lines):
            line = lines[index]
            stripped = line.strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            index += 1
        else:
            raise AssertionError(f"{path}:{start - 1}: unclosed code fence")
        index += 1
        found.append(Block(path, start, language, "\n".join(body) + "\n"))
    return found


def expand_includes(code: str) -> str:
    """Replace ``--8<-- "path"`` lines with the file they name (relative to docs/)."""

    def include(match: re.Match[str]) -> str:
        return (DOCS / match["path"]).read_text(encoding="utf-8").rstrip("\n")

    return "\n".join(_INCLUDE.sub(include, line) for line in code.splitlines()) + "\n"


def python_blocks(path: Path) -> list[Block]:
    return [block for block in blocks(path) if block.language in RUNNABLE]


@pytest.fixture(scope="module")
def docs_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("docs") / "my-checkpoint")


@pytest.fixture
def page_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, docs_checkpoint: Path) -> Iterator[Path]:
    """A working directory with ./my-checkpoint; everything a page may change is put back."""
    environment = dict(os.environ)
    root = logging.getLogger()
    loggers = {name: logging.getLogger(name) for name in ("", "hfpatch")}
    levels = {name: logger.level for name, logger in loggers.items()}
    handlers = list(root.handlers)
    work = tmp_path / "work"
    work.mkdir()
    (work / "my-checkpoint").symlink_to(docs_checkpoint, target_is_directory=True)
    monkeypatch.chdir(work)
    for name in ("HF_PATCH_PACKS", "HF_PATCH_STRICT", "HFPATCH_AUTORUN"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield work
    finally:
        hfpatch_core.disable()
        os.environ.clear()
        os.environ.update(environment)
        root.handlers[:] = handlers
        for name, logger in loggers.items():
            logger.setLevel(levels[name])
        for name in list(sys.modules):
            if name in EXAMPLE_MODULES or name.startswith(tuple(f"{module}." for module in EXAMPLE_MODULES)):
                del sys.modules[name]


def run_page(path: Path, namespace: dict[str, Any], request: pytest.FixtureRequest) -> None:
    tests: dict[str, Any] = {}
    environment = dict(os.environ)
    for block in python_blocks(path):
        before = {name: value for name, value in namespace.items() if name.startswith("test")}
        code = "\n" * (block.line - 1) + expand_includes(block.code)
        exec(compile(code, str(path), "exec"), namespace)
        for name, value in namespace.items():
            if name.startswith("test") and inspect.isfunction(value) and before.get(name) is not value:
                tests[name] = value
    if not tests:
        return
    # the test functions a page defines run as their own test module would
    hfpatch_core.disable()
    os.environ.clear()
    os.environ.update(environment)
    for name, function in tests.items():
        arguments = {
            parameter: request.getfixturevalue(parameter) for parameter in inspect.signature(function).parameters
        }
        try:
            function(**arguments)
        except Exception as exc:
            raise AssertionError(f"{path.name}: {name}() failed: {type(exc).__name__}: {exc}") from exc


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_page_examples_run(page: Path, page_state: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    install_packs(tmp_path / "site", DOC_PACKS)
    run_page(page, {"__name__": f"docs_{page.stem.replace('-', '_')}"}, request)


def test_readme_examples_run(page_state: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """README.md's blocks with the preamble they need: ``./my-checkpoint``, the pack
    ``my-pack``, and for the ``patched()`` example a ``config`` and ``LlamaForCausalLM``."""
    install_packs(tmp_path / "site", README_PACKS)
    namespace = {
        "__name__": "docs_readme",
        "config": AutoConfig.from_pretrained(page_state / "my-checkpoint"),
        "LlamaForCausalLM": LlamaForCausalLM,
    }
    run_page(README, namespace, request)


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_fence_names_a_known_language(page: Path) -> None:
    """A block meant to run is ``python``; every other block says what it is instead."""
    for block in blocks(page):
        assert block.language in RUNNABLE | NOT_RUN, (
            f"{page.name}:{block.line - 1}: fence language {block.language!r}; use python for code that runs, "
            f"or one of {sorted(NOT_RUN)}"
        )
        if block.language not in RUNNABLE:
            assert "--8<--" not in block.code, f"{page.name}:{block.line}: includes are only expanded in python blocks"


def test_the_pages_have_examples() -> None:
    """The harness finds the blocks (a broken fence parser would pass every page)."""
    counts = {page.name: len(python_blocks(page)) for page in PAGES}
    for name in ("quickstart.md", "concepts.md", "users-guide.md", "authors-guide.md"):
        assert counts.get(name, 0) >= 3, counts
    assert len(python_blocks(README)) >= 4


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (links, anchors, nav, API pages); skipped without docs/requirements.txt."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed (pip install -r docs/requirements.txt)")
    # no --quiet: mkdocs 1.6 does not count the warnings it does not print, and passes
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_the_readme_names_every_dependency() -> None:
    """README.md's Install section lists what ``pip install hfpatch-core`` brings in."""
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    install = README.read_text(encoding="utf-8").split("## Install", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([A-Za-z0-9_.-]+)(?:[<>=!~][^`]*)?`", install))
    missing = [Requirement(text).name for text in project["dependencies"] if Requirement(text).name not in named]
    assert not missing, f"README.md's Install section does not name {missing}"
