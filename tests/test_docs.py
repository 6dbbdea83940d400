"""Every ``python`` block of the documentation runs.

One test case per page (``docs/*.md`` and ``README.md``): the page's ```` ```python ````
blocks run in order in one namespace, as a reader would paste them.  The preamble the
pages document (docs/index.md, "About the examples"):

* the working directory is a fresh temporary directory holding ``./my-checkpoint``, a
  tiny random llama checkpoint from ``hfpatch_core.testing.tiny_checkpoint``;
* the example packs, the projects ``docs/examples/fused-mlp`` and ``docs/examples/rival-mlp``,
  are built into wheels (hatchling, no build isolation) and installed on temporary
  ``sys.path`` entries, so discovery reads their own metadata; README.md gets ``my-pack``
  instead, built the same way from the files of its "Writing a pack" section;
* a block that defines ``test_*`` functions is a test module: after the page's blocks,
  each such function is called with the pytest fixtures its parameters name
  (``tiny_checkpoint``, ``hfpatch_disabled``, ...), with hfpatch disabled and the
  environment as it was before the page, like a separate pytest run.

Shown output is checked (the preamble in docs/index.md says how):

* a ```` ```text ```` block right after a python block (nothing but blank lines between) is
  that block's whole standard output;
* in a python block, a comment at the end of a top-level ``print(...)`` line, or else the
  comment lines right below it, is what that call prints.

Both compare line by line, trailing spaces ignored; a 12-digit hexadecimal word (a plan
fingerprint) matches any such word, and ``0x...`` (a memory address) any address.

A line ``--8<-- "path"`` inside a block is replaced by ``docs/path``, as the
``pymdownx.snippets`` extension does when the site is built.  Blocks in other languages
(console, text, toml, ...) are not run.  After each page, hfpatch is disabled and the
environment, working directory, logging and imported example modules are restored
(``conftest._isolation`` restores transformers' registries).
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import io
import json
import logging
import operator
import os
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import transformers
from transformers import AutoConfig, LlamaForCausalLM

import hfpatch_core
from hfpatch_core.testing import install_wheel, tiny_checkpoint

pytestmark = pytest.mark.release_independent

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


#: The example packs the pages use: installable projects in docs/examples/.
EXAMPLE_PROJECTS = (EXAMPLES / "fused-mlp", EXAMPLES / "rival-mlp")
EXAMPLE_MODULES = (
    "hfpatch_pack_fused_mlp",
    "hfpatch_pack_rival_mlp",
    "hfpatch_pack_my_pack",
    "hfpatch_pack_moe_replay",
)

#: The transformers release whose outputs the pages show (docs/index.md, "About the examples").
SHOWN_WITH = "5.25.0"

_FINGERPRINT = re.compile(r"\b[0-9a-f]{12}\b")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the first line of code
    language: str
    code: str
    end: int = 0  # 1-based line of the closing fence
    follows: bool = False  # only blank lines between the previous block's closing fence and this one
    title: str = ""  # ```python title="train.py"```: a program the page runs from a console block


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
        follows = bool(found) and all(not text.strip() for text in lines[found[-1].end : start - 2])
        title = re.search(r'\btitle="([^"]+)"', opening["info"])
        code = "\n".join(body) + "\n"
        found.append(Block(path, start, language, code, end=index, follows=follows, title=title[1] if title else ""))
    return found


def expand_includes(code: str) -> str:
    """Replace ``--8<-- "path"`` lines with the file they name (relative to docs/)."""

    def include(match: re.Match[str]) -> str:
        return (DOCS / match["path"]).read_text(encoding="utf-8").rstrip("\n")

    return "\n".join(_INCLUDE.sub(include, line) for line in code.splitlines()) + "\n"


def python_blocks(path: Path) -> list[Block]:
    """The blocks a page runs in its namespace: python, except the programs (``title="train.py"``)."""
    return [block for block in blocks(path) if block.language in RUNNABLE and not block.title]


@pytest.fixture(scope="module")
def docs_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("docs") / "my-checkpoint")


def build_packs(projects: list[Path], into: Path) -> list[Path]:
    """Build each project into a wheel and install it on a site of its own; the sites."""
    sites = []
    for project in projects:
        site = into / f"site-{project.name}"
        install_wheel(project, site)
        sites.append(site)
    return sites


def use_sites(sites: list[Path]) -> None:
    """Put installed sites first on ``sys.path`` (``conftest._isolation`` restores it)."""
    for site in reversed(sites):
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def example_sites(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The example packs of docs/examples/, built and installed as wheels once per module."""
    return build_packs(list(EXAMPLE_PROJECTS), tmp_path_factory.mktemp("example-packs"))


def readme_pack_files() -> dict[str, str]:
    """The files of README.md's "Writing a pack": blocks whose first line is ``# <file name>``."""
    section = README.read_text(encoding="utf-8").split("\n## Writing a pack\n", 1)[1].split("\n## ", 1)[0]
    start = next(
        number
        for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1)
        if line == "## Writing a pack"
    )
    files = {}
    for block in blocks(README):
        first = block.code.splitlines()[0] if block.code.strip() else ""
        if block.line > start and block.code in section and re.fullmatch(r"# [\w.-]+\.(py|toml)", first):
            files[first[2:]] = block.code
    return files


@pytest.fixture(scope="module")
def readme_site(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """README.md's "Writing a pack" example, written out, built into a wheel and installed."""
    project = tmp_path_factory.mktemp("readme") / "my-pack"
    project.mkdir()
    for name, text in readme_pack_files().items():
        (project / name).write_text(text, encoding="utf-8")
    return build_packs([project], project.parent)


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


def normalized(text: str) -> list[str]:
    """Output lines as compared: trailing spaces and blank edges dropped, fingerprints and addresses masked."""
    text = _ADDRESS.sub("0x...", _FINGERPRINT.sub("<fingerprint>", text))
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def matches(printed: str, shown: str) -> bool:
    """Whether ``printed`` is what a page shows: ``normalized`` lines equal, where a shown
    line that is only ``...`` stands for any number of lines (an elision)."""
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line.strip() == "..." else re.escape(line) + r"\n" for line in normalized(shown)
    )
    return re.fullmatch(pattern, "".join(line + "\n" for line in normalized(printed))) is not None


def shown_output(code_lines: list[str], statement: ast.stmt) -> str | None:
    """What the page shows a top-level ``print(...)`` printing, or ``None`` when it shows nothing."""
    call = statement.value if isinstance(statement, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print"):
        return None
    last = code_lines[statement.end_lineno - 1]  # type: ignore[operator]
    tokens = list(tokenize.generate_tokens(io.StringIO(last + "\n").readline))
    trailing = [token.string for token in tokens if token.type == tokenize.COMMENT]
    if trailing:
        return trailing[-1][1:].strip()
    below = []
    for line in code_lines[statement.end_lineno :]:  # type: ignore[misc]
        if not line.lstrip().startswith("#"):
            break
        below.append(line.lstrip()[1:].strip())
    return "\n".join(below) if below else None


def run_block(block: Block, namespace: dict[str, Any]) -> str:
    """Run one block statement by statement; check each shown ``print``; its whole output."""
    code = "\n" * (block.line - 1) + expand_includes(block.code)
    code_lines = code.splitlines()
    tree = ast.parse(code, str(block.path))
    flags = 0
    everything = io.StringIO()
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
            flags |= functools.reduce(
                operator.or_, (getattr(__future__, alias.name).compiler_flag for alias in statement.names), 0
            )
        compiled = compile(
            ast.Module([statement], type_ignores=[]), str(block.path), "exec", flags=flags, dont_inherit=True
        )
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compiled, namespace)
        everything.write(printed.getvalue())
        expected = shown_output(code_lines, statement)
        if expected is not None:
            assert matches(printed.getvalue(), expected), (
                f"{block.path.name}:{statement.lineno}: printed {printed.getvalue()!r}, the page shows {expected!r}"
            )
    return everything.getvalue()


def run_page(path: Path, namespace: dict[str, Any], request: pytest.FixtureRequest) -> None:
    tests: dict[str, Any] = {}
    environment = dict(os.environ)
    page = blocks(path)
    for number, block in enumerate(page):
        if block.language not in RUNNABLE or block.title:
            continue
        before = {name: value for name, value in namespace.items() if name.startswith("test")}
        printed = run_block(block, namespace)
        after = page[number + 1] if number + 1 < len(page) else None
        if after is not None and after.follows and after.language == "text":
            assert matches(printed, after.code), (
                f"{path.name}:{after.line}: the block above printed\n{printed}\nthe page shows\n{after.code}"
            )
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
def test_page_examples_run(
    page: Path, page_state: Path, example_sites: list[Path], request: pytest.FixtureRequest
) -> None:
    use_sites(example_sites)
    if page.name == "training.md":  # its RL loop uses the first-party moe-replay
        use_sites(request.getfixturevalue("moe_replay_site"))
    if page.name == "quantization.md":  # its example quantizes with the first-party linear-experts
        use_sites(request.getfixturevalue("linear_experts_site"))
    run_page(page, {"__name__": "__main__"}, request)


def test_readme_examples_run(page_state: Path, readme_site: list[Path], request: pytest.FixtureRequest) -> None:
    """README.md's blocks with the preamble they need: ``./my-checkpoint``, the pack
    ``my-pack`` of its "Writing a pack" section, and for the ``patched()`` example a
    ``config`` and ``LlamaForCausalLM``."""
    use_sites(readme_site)
    namespace = {
        "__name__": "__main__",
        "config": AutoConfig.from_pretrained(page_state / "my-checkpoint"),
        "LlamaForCausalLM": LlamaForCausalLM,
    }
    run_page(README, namespace, request)


def test_the_readme_pack_is_complete(readme_site: list[Path]) -> None:
    """ "Writing a pack" gives both files, and the wheel they build is a pack ``hfpatch list`` shows."""
    assert set(readme_pack_files()) == {"pyproject.toml", "hfpatch_pack_my_pack.py"}
    use_sites(readme_site)
    info = hfpatch_core.discover().packs["my-pack"]
    assert (info.distribution, info.version) == ("hfpatch-pack-my-pack", "0.1.0")


@pytest.mark.parametrize("project", EXAMPLE_PROJECTS, ids=[project.name for project in EXAMPLE_PROJECTS])
def test_the_example_packs_are_listed(project: Path, example_sites: list[Path], tmp_path: Path) -> None:
    """``pip install ./docs/examples/<name>`` gives a pack ``hfpatch list`` shows, named after the directory."""
    site = next(site for site in example_sites if site.name == f"site-{project.name}")
    result = subprocess.run(
        [sys.executable, "-m", "hfpatch_core", "list", "--json"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", ""), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = {row["name"]: row for row in json.loads(result.stdout)["packs"]}
    assert rows[project.name]["distribution"] == f"hfpatch-pack-{project.name}"
    assert rows[project.name]["enabled"], rows[project.name]


_COMMAND = re.compile(r"^\$ (?P<env>(?:[A-Z_]+=\S* )*)hfpatch (?P<args>[^&|;#]+?)\s*(?:#.*)?$")


def console_lines(path: Path, pattern: re.Pattern[str]) -> list[tuple[int, re.Match[str], dict[str, str], str]]:
    """The ``$ ...`` lines of a page's console blocks that ``pattern`` matches: (line, match,
    environment from the ``env`` group, the output shown below it up to the next ``$`` line)."""
    found = []
    for block in blocks(path):
        if block.language != "console":
            continue
        lines = block.code.splitlines()
        for number, line in enumerate(lines):
            match = pattern.match(line)
            if match is None:
                continue
            output = []
            for later in lines[number + 1 :]:
                if later.startswith("$ "):
                    break
                output.append(later)
            env = dict(item.split("=", 1) for item in match["env"].split())
            found.append((block.line + number, match, env, "\n".join(output)))
    return found


def shown_commands(path: Path) -> list[tuple[int, dict[str, str], list[str], str]]:
    """The ``$ hfpatch ...`` lines of a page's console blocks that are followed by output:
    (line, environment, arguments, output).  ``hfpatch run`` and ``hfpatch new`` are left out."""
    return [
        (line, env, match["args"].split(), output)
        for line, match, env, output in console_lines(path, _COMMAND)
        if output.strip() and match["args"].split()[0] not in ("run", "new")
    ]


@pytest.fixture(scope="module")
def qwen_moe_site(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The first-party ``qwen-moe``, which quickstart.md installs next to the example packs."""
    return build_packs([ROOT / "plugins" / "hfpatch-pack-qwen-moe"], tmp_path_factory.mktemp("qwen-moe"))


@pytest.fixture(scope="module")
def moe_replay_site(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The first-party ``moe-replay``, which training.md's RL loop uses."""
    return build_packs([ROOT / "plugins" / "hfpatch-pack-moe-replay"], tmp_path_factory.mktemp("moe-replay"))


@pytest.fixture(scope="module")
def linear_experts_site(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The first-party ``linear-experts``, which quantization.md's example uses."""
    return build_packs([ROOT / "plugins" / "hfpatch-pack-linear-experts"], tmp_path_factory.mktemp("linear-experts"))


PAGES_WITH_COMMANDS = [page for page in PAGES if shown_commands(page)]


@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS, ids=[page.name for page in PAGES_WITH_COMMANDS])
def test_page_commands_print_what_is_shown(
    page: Path, page_state: Path, example_sites: list[Path], qwen_moe_site: list[Path]
) -> None:
    """A console block's ``$ hfpatch ...`` line followed by output prints that output, run in the
    page's working directory with the example packs and ``qwen-moe`` installed.  The pages show
    what transformers 5.24.0 gives (model structure and conversion lists differ between releases)."""
    if transformers.__version__ != SHOWN_WITH:
        pytest.skip(f"the pages show the output of transformers {SHOWN_WITH}, not {transformers.__version__}")
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = os.pathsep.join([*map(str, [*example_sites, *qwen_moe_site]), *inherited, str(ROOT)])
    for line, env, args, shown in shown_commands(page):
        result = subprocess.run(
            [sys.executable, "-m", "hfpatch_core", *args],
            cwd=page_state,
            env={**os.environ, "PYTHONPATH": path, **env},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        # standard output; standard error (progress bars, log lines) only for a command that prints nothing else
        printed = result.stdout if result.stdout.strip() else result.stderr
        assert matches(printed, shown), (
            f"{page.name}:{line}: hfpatch {' '.join(args)} printed\n{printed}\nthe page shows\n{shown}"
        )


_PROGRAM = re.compile(r"^\$ (?P<env>(?:[A-Z_]+=\S* )*)python (?P<file>[\w.-]+\.py)(?P<args>[^&|;#]*?)\s*(?:#.*)?$")


def shown_programs(path: Path) -> tuple[dict[str, Block], list[tuple[int, dict[str, str], list[str], str]]]:
    """A page's programs (``python title="train.py"`` blocks) and the console lines that run them,
    ``$ HF_PATCH_PACKS=x python train.py``: (line, environment, arguments, output shown below it)."""
    programs = {block.title: block for block in blocks(path) if block.language in RUNNABLE and block.title}
    runs = [
        (line, env, [match["file"], *match["args"].split()], output)
        for line, match, env, output in console_lines(path, _PROGRAM)
    ]
    return programs, runs


PAGES_WITH_PROGRAMS = [page for page in [*PAGES, README] if shown_programs(page)[0]]


@pytest.fixture(scope="module")
def chunked_loss_site(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The first-party ``chunked-loss``, whose page trains with ``HF_PATCH_PACKS=chunked-loss python train.py``."""
    return build_packs([ROOT / "plugins" / "hfpatch-pack-chunked-loss"], tmp_path_factory.mktemp("chunked-loss"))


@pytest.mark.parametrize("page", PAGES_WITH_PROGRAMS, ids=[page.name for page in PAGES_WITH_PROGRAMS])
def test_page_programs_run_as_shown(
    page: Path, page_state: Path, example_sites: list[Path], chunked_loss_site: list[Path]
) -> None:
    """Issue 44.1: a page's program runs as the page runs it, ``HF_PATCH_PACKS=x python train.py``, a
    subprocess of this environment's Python (whose site-packages holds hfpatch_autorun.pth) with the
    packs installed and nothing else: no ``hfpatch run``, no ``enable()`` unless the program has one."""
    programs, runs = shown_programs(page)
    for name, block in programs.items():
        (page_state / name).write_text(expand_includes(block.code), encoding="utf-8")
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = os.pathsep.join([*map(str, [*example_sites, *chunked_loss_site]), *inherited, str(ROOT)])
    bare = {key: value for key, value in os.environ.items() if not key.startswith(("HF_PATCH", "HFPATCH"))}
    assert {arguments[0] for _, _, arguments, _ in runs} >= set(programs), f"{page.name}: a program no line runs"
    for line, env, arguments, shown in runs:
        assert arguments[0] in programs, f"{page.name}:{line}: no python block titled {arguments[0]!r}"
        result = subprocess.run(
            [sys.executable, *arguments],
            cwd=page_state,
            env={**bare, "PYTHONPATH": path, **env},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, f"{page.name}:{line}: {' '.join(arguments)} failed\n{result.stderr}"
        if shown.strip():
            assert matches(result.stdout, shown), (
                f"{page.name}:{line}: python {' '.join(arguments)} printed\n{result.stdout}\nthe page shows\n{shown}"
            )


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
