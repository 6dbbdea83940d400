"""`make compat`: the first-party packs and a fast core smoke run on every transformers release in range.

One virtual environment (``--venv``, already holding hfpatch-core and the test tools) is
reused: for each release, newest first, transformers is installed ``--no-deps`` with its
own requirements except ``kernels``, as ``make test`` installs 5.25 (constraints.txt says
why; ``USE_HUB_KERNELS=0`` is set), then ``hfpatch verify --json`` runs
on the first-party packs and ``pytest`` on a few core files.  Prints a release x pack table
and, with ``--write PAGE``, writes it as a Markdown page with the date.

Then, for the oldest and the newest Python hfpatch-core declares (``--pythons``), a fresh
virtual environment of its own gets ``pip install`` of hfpatch-core and the first-party
packs, as a user would type it: pip picks the newest transformers (and torch) that installs
on that Python.  ``hfpatch verify`` of the packs and ``hfpatch demo`` run there; the table
says which releases pip picked.  A pyenv shim of a Python that is not selected fails: pass
the interpreter's path (``--pythons ~/.pyenv/versions/3.10.13/bin/python3.10 ...``).
Not part of ``.ci/run``: it installs eight releases and two environments (a few GB of
torch wheels) and takes a while.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RELEASES = ("5.25.0", "5.24.0", "5.21.0", "5.17.0", "5.13.0", "5.9.0", "5.6.0", "5.3.0")
SMOKE = ("tests/test_transformers_releases.py", "tests/test_loading.py", "tests/test_transformers_registrations.py")
#: packs that decide from the config, so verify needs their model types (README's table)
FROM_CONFIG = {"fused-dense": ("llama", "mistral", "qwen2", "qwen3")}
#: the oldest Python of hfpatch-core's ``requires-python >=3.10``, and the newest released one
PYTHONS = ("python3.10", "python3.13")
ROOT = Path(__file__).resolve().parent.parent
#: requirements transformers declares that are not installed (see the module docstring)
LEFT_OUT = {"kernels"}

REQUIREMENTS = """
import importlib.metadata, re
from packaging.requirements import Requirement
for line in importlib.metadata.requires("transformers") or ():
    requirement = Requirement(line)
    if requirement.marker is None and requirement.name not in {left_out!r}:
        print(requirement)
"""


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, text=True, capture_output=True, **kwargs)  # type: ignore[call-overload]


def install(python: str, release: str, pip_flags: list[str]) -> str | None:
    """Install ``release`` and its requirements; the error, or ``None``."""
    step = run([python, "-m", "pip", "install", *pip_flags, "--no-deps", f"transformers=={release}"])
    if step.returncode:
        return step.stderr.strip().splitlines()[-1] if step.stderr.strip() else "pip failed"
    listed = run([python, "-c", REQUIREMENTS.format(left_out=LEFT_OUT)])
    requirements = listed.stdout.split()
    step = run([python, "-m", "pip", "install", *pip_flags, *requirements])
    if step.returncode:
        return step.stderr.strip().splitlines()[-1] if step.stderr.strip() else "pip failed"
    return None


def verify(venv: Path, packs_site: str, env: dict[str, str]) -> dict[str, str]:
    """``hfpatch verify --json`` of every pack (and of each ``FROM_CONFIG`` pack on its model
    types): for each pack, ``ok`` or the first failure."""
    found: dict[str, str] = {}
    for pack, model_types in (("", ()), *FROM_CONFIG.items()):
        arguments = [pack, *(f"--model-type={model_type}" for model_type in model_types)] if pack else []
        found.update(_verify(venv, packs_site, env, arguments))
    return found


def _verify(venv: Path, packs_site: str, env: dict[str, str], arguments: list[str]) -> dict[str, str]:
    command = [str(venv / "bin" / "hfpatch"), "verify", "--json", *arguments]
    step = run(command, env={**env, "PYTHONPATH": packs_site}, cwd="/")
    try:
        reports = json.loads(step.stdout)["reports"]
    except (ValueError, KeyError):
        tail = (step.stderr or step.stdout).strip().splitlines()
        return {"(verify)": f"error: {tail[-1] if tail else step.returncode}"}
    found: dict[str, str] = {}
    for report in reports:
        pack, failures = report["pack"], report.get("failures") or []
        if failures and found.get(pack, "ok") == "ok":
            found[pack] = f"fails on {report['model_type']}: {failures[0]}"
        else:
            found.setdefault(pack, "ok")
    return found


def check(venv: Path, packs_site: str, env: dict[str, str]) -> str:
    """``hfpatch check`` of every pack (drift against the packs' records included): ``ok``,
    or how many drift lines and the first, or its first problem line."""
    step = run([str(venv / "bin" / "hfpatch"), "check"], env={**env, "PYTHONPATH": packs_site}, cwd="/")
    if step.returncode == 0:
        return "ok"
    problems = [line.strip() for line in step.stdout.splitlines() if line.startswith(("FAIL", "      - "))]
    drifts = [line[len("- drift: ") :] for line in problems if line.startswith("- drift:")]
    if drifts:
        return f"{len(drifts)} drift: {drifts[0]}"
    tail = problems or (step.stderr or step.stdout).strip().splitlines()
    return f"fails: {tail[-1] if tail else step.returncode}"


def smoke(python: str, env: dict[str, str]) -> str:
    step = run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SMOKE], env=env)
    last = step.stdout.strip().splitlines()[-1] if step.stdout.strip() else ""
    return "ok" if step.returncode == 0 else f"fails: {last}"


VERSIONS = "import sys, torch, transformers; print(sys.version.split()[0], transformers.__version__, torch.__version__)"


def python_row(python: str, pip_flags: list[str], env: dict[str, str]) -> PythonRow:
    """Install hfpatch-core and the first-party packs in a fresh venv of interpreter ``python``
    (kept in ``.venv-compat-py3.X`` and reused while its ``.installed`` marker exists), then
    run ``hfpatch verify`` and ``hfpatch demo`` there."""
    probe = run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
    if probe.returncode:  # e.g. a pyenv shim of a version that is not selected
        tail = (probe.stderr or probe.stdout).strip().splitlines()
        error = f"error: {python}: {tail[0] if tail else 'not found'}"
        return (python, "-", "-", {"(install)": error}, "not run", "not run")
    venv = ROOT / f".venv-compat-py{probe.stdout.strip()}"
    projects = [str(ROOT), *sorted(str(path.parent) for path in (ROOT / "plugins").glob("*/pyproject.toml"))]
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", *pip_flags]
    steps = [[python, "-m", "venv", str(venv)], [*pip, *projects]]
    if (venv / ".installed").exists():  # reused: this checkout's hfpatch-core and packs, not the first run's
        steps = [[*pip, "--no-deps", "--force-reinstall", *projects]]
    else:
        shutil.rmtree(venv, ignore_errors=True)
    for step in steps:
        done = run(step)
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()
            return (python, "-", "-", {"(install)": f"error: {tail[-1] if tail else 'failed'}"}, "not run", "not run")
    (venv / ".installed").touch()
    versions = run([str(venv / "bin" / "python"), "-c", VERSIONS], env=env, cwd="/").stdout.split()
    version, transformers, torch = (*versions, "?", "?", "?")[:3]
    packs = verify(venv, "", env)
    checked = check(venv, "", env)
    demo = run([str(venv / "bin" / "hfpatch"), "demo"], env=env, cwd="/")
    lines = (demo.stdout + demo.stderr).strip().splitlines()
    shown = "ok" if demo.returncode == 0 else f"fails: {lines[-1] if lines else demo.returncode}"
    return (version, transformers, torch, packs, checked, shown)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:160]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, required=True)
    parser.add_argument("--packs-site", required=True)
    parser.add_argument("--releases", nargs="*", default=list(RELEASES))
    parser.add_argument(
        "--pythons", nargs="*", default=list(PYTHONS), help="interpreters for the install-as-a-user runs (none: skip)"
    )
    parser.add_argument("--pip-flags", default="--disable-pip-version-check --quiet --quiet")
    parser.add_argument("--write", type=Path, help="write the table to this Markdown page")
    args = parser.parse_args()
    args.venv = args.venv.absolute()
    python = str(args.venv / "bin" / "python")
    env = {**os.environ, "USE_HUB_KERNELS": "0"}
    env.pop("HF_PATCH_PACKS", None)
    rows: list[Row] = []
    for release in args.releases:
        print(f"== transformers {release}", flush=True)
        error = install(python, release, args.pip_flags.split())
        if error is not None:
            rows.append((release, {"(install)": f"error: {error}"}, "not run", "not run"))
            continue
        packs = verify(args.venv, os.path.abspath(args.packs_site), env)
        checked = check(args.venv, os.path.abspath(args.packs_site), env)
        core = smoke(python, env)
        rows.append((release, packs, checked, core))
        print(f"   packs: {packs}\n   check: {checked}\n   core smoke: {core}", flush=True)
        if args.write is not None:  # after each release: a long run interrupted keeps what it found
            write(args.write, rows, [])
    python_rows: list[PythonRow] = []
    for python in args.pythons:
        print(f"== {python}", flush=True)
        python_rows.append(python_row(python, args.pip_flags.split(), env))
        print(f"   {python_rows[-1]}", flush=True)
        if args.write is not None:
            write(args.write, rows, python_rows)
    print(table_of(rows))
    print(python_table_of(python_rows))
    failed = any(value != "ok" for _, packs, *rest in rows for value in (*packs.values(), *rest)) or any(
        value != "ok" for *_, packs, checked, demo in python_rows for value in (*packs.values(), checked, demo)
    )
    return 1 if failed else 0


#: (release, verify of each pack, hfpatch check of the packs, core smoke)
Row = tuple[str, dict[str, str], str, str]
#: (Python, transformers pip picked, torch pip picked, verify of each pack, check, demo)
PythonRow = tuple[str, str, str, dict[str, str], str, str]


def table_of(rows: list[Row]) -> str:
    names = sorted({name for _, packs, _, _ in rows for name in packs})
    lines = [
        "| transformers | " + " | ".join(f"`{name}`" for name in names) + " | `hfpatch check` | core smoke |",
        "|---" * (len(names) + 3) + "|",
    ]
    for release, packs, checked, core in rows:
        cells = " | ".join(cell(packs.get(name, "-")) for name in names)
        lines.append(f"| {release} | {cells} | {cell(checked)} | {cell(core)} |")
    return "\n".join(lines)


def python_table_of(rows: list[PythonRow]) -> str:
    names = sorted({name for *_, packs, _, _ in rows for name in packs})
    heading = " | ".join(f"`{name}`" for name in names)
    lines = [
        f"| Python | transformers | torch | {heading} | `hfpatch check` | `hfpatch demo` |",
        "|---" * (len(names) + 5) + "|",
    ]
    for python, transformers, torch, packs, checked, demo in rows:
        cells = " | ".join(cell(packs.get(name, "-")) for name in names)
        lines.append(f"| {python} | {transformers} | {torch} | {cells} | {cell(checked)} | {cell(demo)} |")
    return "\n".join(lines)


def write(page: Path, rows: list[Row], python_rows: list[PythonRow]) -> None:
    """Write ``page``; a part of the run that was left out (``--releases`` or ``--pythons``
    with no value) keeps its section of the existing page."""
    today = datetime.date.today().isoformat()
    old = page.read_text() if page.exists() else ""
    releases_part, _, pythons_part = old.partition(PYTHONS_HEADING)
    text = (
        PAGE.format(date=today, table=table_of(rows), smoke=", ".join(f"`{f}`" for f in SMOKE))
        if rows
        else releases_part
    )
    if python_rows:
        text = text.rstrip("\n") + "\n" + PYTHONS_SECTION.format(date=today, table=python_table_of(python_rows))
    elif pythons_part:
        text = text.rstrip("\n") + "\n\n" + PYTHONS_HEADING + pythons_part
    page.write_text(text)


PAGE = """# Compatibility

`make compat` (`.ci/compat.py`) installs each transformers release below in one reused
virtual environment, newest first, runs `hfpatch verify` on the first-party packs (each
pack on tiny checkpoints of every model type it targets; `fused-dense`, which decides from
the config, on llama, mistral, qwen2 and qwen3), `hfpatch check` on them (which
compares each pack's [drift record](authors-guide.md#the-drift-record) with the release)
and a fast core smoke run ({smoke}). transformers is installed `--no-deps` next to its other requirements, without
`kernels`, as `make test` installs 5.25.0 (constraints.txt says why), and every run has
`USE_HUB_KERNELS=0`. `make test` runs the full suites on the
oldest (5.3.0) and the newest (5.25.0) release only. To check a pack of your own the same
way, see [Checking every release of the range](authors-guide.md#checking-every-release-of-the-range).
Which model types each first-party pack applies to on the newest release, measured on
every causal-LM model type, is the [zoo table](zoo.md) (`make zoo`).

Results of {date} (CPU, Python 3.11, torch 2.13.0):

{table}
"""

PYTHONS_HEADING = "## Oldest and newest Python"
PYTHONS_SECTION = """
## Oldest and newest Python

hfpatch-core declares `requires-python >=3.10` and is tested on 3.11 (`make test`).
`make compat` also makes a fresh virtual environment on Python 3.10 and on 3.13 and runs
`pip install` of hfpatch-core and the three first-party packs there, as a user would:
pip picks the newest transformers, torch and the rest that install on that Python, with
their own requirements (transformers 5.21 and later require Python 3.11; 5.25 brings
`kernels`). Then `hfpatch verify` runs on the packs (`fused-dense` on llama, mistral,
qwen2 and qwen3), `hfpatch check` (with the packs' [drift records](authors-guide.md#the-drift-record))
and `hfpatch demo` with its defaults, all with `USE_HUB_KERNELS=0` (hub kernels are
downloaded from the Hub, which these runs cannot reach).

Results of {date} (CPU):

{table}
"""


if __name__ == "__main__":
    sys.exit(main())
