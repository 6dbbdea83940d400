"""``make release-dist`` / ``make release-check``: the distributions a release uploads, and their check.

``build``: the sdist and wheel of hfpatch-core and of every first-party pack (``plugins/*``), each
versioned by its package's ``__version__``, built by this venv's hatchling into one directory.
``check``: ``twine check --strict`` on every file, then a fresh virtual environment where the
wheels are installed (their other requirements from the package index, pinned by
constraints.txt; torch is this venv's, so a CPU machine fetches no CUDA build), and ``hfpatch
list`` and ``hfpatch verify`` run there.  The release workflow
(``.github/workflows/release.yml``) does the same before it publishes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def projects() -> list[Path]:
    """hfpatch-core's directory, then each first-party pack's, sorted."""
    return [ROOT, *sorted(path.parent for path in ROOT.glob("plugins/*/pyproject.toml"))]


def build(dist: Path) -> list[Path]:
    """Build every project's sdist and wheel into ``dist`` (emptied first); the files built."""
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    for project in projects():
        # hatchling from this venv, as `make dist` builds: nothing is fetched
        built = subprocess.run(
            [sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-t", "wheel", "-d", str(dist.resolve())],
            cwd=project,
            capture_output=True,
            text=True,
            check=False,
        )
        if built.returncode:
            raise SystemExit(f"release: building {project.name} failed:\n{built.stdout}{built.stderr}")
    return sorted(dist.iterdir())


def twine_check(dist: Path) -> None:
    files = [str(path) for path in sorted(dist.iterdir())]
    subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files], check=True)


def _torch_site(directory: Path) -> Path:
    """A directory holding links to this venv's torch (its packages and metadata), for a fresh venv's
    ``.pth``: pip sees torch installed there and resolves the rest from the package index."""
    distribution = importlib.metadata.distribution("torch")
    site = Path(str(distribution.locate_file("")))
    names = {Path(str(entry)).parts[0] for entry in distribution.files or ()}
    directory.mkdir(parents=True, exist_ok=True)
    for name in sorted(names):
        source = site / name
        if source.exists() and not name.startswith("..") and not name.endswith(".data"):
            (directory / name).symlink_to(source)
    return directory


def check_installed(dist: Path, venv: Path, constraints: Path) -> None:
    """A fresh venv with the built wheels; ``hfpatch list`` and ``hfpatch verify`` must pass there."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    torch_site = _torch_site(venv / "local-torch")
    Path(purelib, "local-torch.pth").write_text(f"{torch_site}\n")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "-c", str(constraints), *map(str, sorted(dist.glob("*.whl")))], check=True)
    env = {**os.environ, "USE_HUB_KERNELS": "0"}
    for variable in [name for name in env if name.startswith(("HF_PATCH", "HFPATCH")) or name == "PYTHONPATH"]:
        del env[variable]
    with tempfile.TemporaryDirectory(prefix="hfpatch-release-") as cwd:  # no source tree on the path
        for command in (["list"], ["verify"]):
            print(f"release-check: hfpatch {' '.join(command)}", file=sys.stderr, flush=True)
            subprocess.run([str(venv / "bin" / "hfpatch"), *command], check=True, env=env, cwd=cwd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("build", "check"))
    parser.add_argument("--dist", type=Path, default=ROOT / "dist")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-release")
    parser.add_argument("--constraints", type=Path, default=ROOT / "constraints.txt")
    args = parser.parse_args()
    if args.step == "build":
        for path in build(args.dist):
            print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
        return 0
    twine_check(args.dist)
    check_installed(args.dist.resolve(), args.venv.resolve(), args.constraints.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
