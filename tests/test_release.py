"""The distributions a release uploads (issue 46.8): a versioned sdist and wheel of hfpatch-core and of
every first-party pack, built as ``make release-dist`` builds them, that pass ``twine check --strict``."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
import tomllib

pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parents[1]


def _projects() -> dict[str, Path]:
    """Distribution name -> its ``__init__.py`` (where its version is written)."""
    found = {}
    for pyproject in [ROOT / "pyproject.toml", *sorted(ROOT.glob("plugins/*/pyproject.toml"))]:
        data = tomllib.loads(pyproject.read_text())
        assert data["project"]["dynamic"] == ["version"], f"{pyproject}: the version is the package's __version__"
        found[data["project"]["name"]] = pyproject.parent / data["tool"]["hatch"]["version"]["path"]
    return found


def _version(init: Path) -> str:
    match = re.search(r'^__version__ = "([^"]+)"', init.read_text(), flags=re.M)
    assert match, f"{init}: no __version__"
    return match.group(1)


def _metadata(wheel: Path) -> Any:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(name).decode())


def test_every_distribution_builds_versioned_and_passes_twine_check(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, str(ROOT / ".ci" / "release.py"), "build", "--dist", str(dist)], check=True)
    expected = set()
    for name, init in _projects().items():
        stem = f"{name.replace('-', '_')}-{_version(init)}"
        expected |= {f"{stem}.tar.gz", f"{stem}-py3-none-any.whl"}
    assert {path.name for path in dist.iterdir()} == expected
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *sorted(map(str, dist.iterdir()))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == len(expected)

    # a pack requires hfpatch-core (which the index now serves) and declares its entry point
    for wheel in dist.glob("hfpatch_pack_*.whl"):
        metadata = _metadata(wheel)
        assert any(r.startswith("hfpatch-core") for r in metadata.get_all("Requires-Dist")), wheel.name
        with zipfile.ZipFile(wheel) as archive:
            points = next(n for n in archive.namelist() if n.endswith("entry_points.txt"))
            assert "[hfpatch.packs]" in archive.read(points).decode(), wheel.name

    # hfpatch-core's sdist holds what its wheel is built from: the same files come out of it
    core = _version(ROOT / "hfpatch_core" / "__init__.py")
    with tarfile.open(dist / f"hfpatch_core-{core}.tar.gz") as archive:
        archive.extractall(tmp_path / "sdist", filter="data")
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path / "again")],
        cwd=tmp_path / "sdist" / f"hfpatch_core-{core}",
        check=True,
        capture_output=True,
    )
    wheel = f"hfpatch_core-{core}-py3-none-any.whl"
    with zipfile.ZipFile(dist / wheel) as built, zipfile.ZipFile(tmp_path / "again" / wheel) as rebuilt:
        assert sorted(rebuilt.namelist()) == sorted(built.namelist())
        assert any(name.startswith("hfpatch_core/_template/") for name in built.namelist())
