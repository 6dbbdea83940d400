"""Check this pack on several transformers releases, one after the other, in this environment.

    python compat.py 5.3.0 5.13.0 5.25.0

For each release (newest first): ``pip install transformers==RELEASE`` (skipped when it is
the installed one), then ``hfpatch check``, ``hfpatch verify`` and ``pytest`` on this pack,
each in a fresh process; then a table release x step, and exit 1 if any step failed.  The
release installed at the start is installed again at the end.  It switches the installed
transformers: run it in a virtual environment made for it (``pip install -e ".[test]"``).
Options for pip go after ``--pip``, e.g. ``--pip --no-deps`` for a release whose
requirements your index does not serve.  This is what ``make compat`` does for hfpatch's
own packs.

``hfpatch check`` also compares the pack's drift record (``hfpatch-record.json``) with
each release: a class whose ``forward``/``__init__`` signature the record does not list
fails it.  Once ``verify`` and ``pytest`` pass on that release, record it with
``hfpatch check --record {{ cookiecutter.pack_name }}`` (in the release's environment) and commit the record.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

PACK = "{{ cookiecutter.pack_name }}"
HERE = Path(__file__).resolve().parent
STEPS = {
    "check": ["-m", "hfpatch_core", "check", PACK],
    "verify": ["-m", "hfpatch_core", "verify", PACK],
    "pytest": ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "tests")],
}


def _run(arguments: list[str]) -> tuple[int, str]:
    done = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, check=False, cwd=HERE)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, lines[-1] if lines else ""


def _install(release: str, pip: list[str]) -> str | None:
    """Install transformers ``release``: ``None``, or pip's last line when it failed."""
    if importlib.metadata.version("transformers") == release:
        return None
    code, last = _run(["-m", "pip", "install", "--quiet", *pip, f"transformers=={release}"])
    return None if code == 0 else last or f"pip exited {code}"


def _version_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else -1 for part in release.split("."))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="+", metavar="RELEASE", help="transformers versions, e.g. 5.3.0")
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS), help="default: all")
    parser.add_argument("--pip", nargs=argparse.REMAINDER, default=[], help="options for pip install, last")
    args = parser.parse_args(argv)
    start = importlib.metadata.version("transformers")
    os.environ.setdefault("USE_HUB_KERNELS", "0")  # no hub kernel downloads while comparing
    rows = []
    try:
        for release in sorted(set(args.releases), key=_version_key, reverse=True):
            print(f"== transformers {release}", flush=True)
            failed = _install(release, args.pip)
            cells = {}
            for step in args.steps:
                if failed is not None:
                    cells[step] = f"not run (install failed: {failed})"
                    continue
                code, last = _run(STEPS[step])
                cells[step] = "ok" if code == 0 else f"FAIL: {last}"
            rows.append((release, cells))
    finally:
        if _install(start, args.pip) is not None:
            print(f"warning: could not reinstall transformers {start}", file=sys.stderr)
    print("\n| transformers | " + " | ".join(args.steps) + " |")
    print("|---" * (len(args.steps) + 1) + "|")
    for release, cells in rows:
        print(f"| {release} | " + " | ".join(cells[step] for step in args.steps) + " |")
    return 0 if all(cell == "ok" for _, cells in rows for cell in cells.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
