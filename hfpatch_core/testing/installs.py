"""Installing packs for a test: from module source (``install_pack``) or as a built wheel.

``install_pack`` writes a real distribution (module and ``*.dist-info``) for a rival or
helper pack a test defines inline; ``install_wheel`` builds and installs a project's
wheel; ``discover_from_wheel`` lists the pack from that wheel in a fresh process, as
``pip install`` gives it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def install_pack(
    site: str | Path,
    name: str,
    source: str | None = None,
    *,
    module: str | None = None,
    entry_point: str | None = None,
    distribution: str | None = None,
    version: str = "1.0.0",
    summary: str = "A test pack",
    requires: Sequence[str] = (),
) -> Path:
    """Install a pack written as module source into directory ``site`` as a real distribution.

    Writes ``<module>.py`` and a ``*.dist-info`` whose ``hfpatch.packs`` entry point is
    ``name`` and whose ``RECORD`` lists the files with their hashes, as pip's does, then
    puts ``site`` first on ``sys.path``: discovery finds the pack through
    ``importlib.metadata`` exactly as it finds a pip-installed one.  Quicker
    than ``install_wheel`` (no build), for rival or helper packs a test defines
    inline, e.g. one that wins a class of the pack under test.

    Args:
        site: the directory (created if needed), a path entry of its own.
        name: the entry-point name (what ``HF_PATCH_PACKS`` selects).
        source: the module's code (dedented); ``None`` to point the entry point at an
            importable module given by ``entry_point``.
        module: the module name; by default ``hfpatch_test_pack_<name>``.
        entry_point: the entry point's value; by default the module.
        distribution: the distribution name; by default ``hfpatch-pack-<name>``.
        version: the distribution version.
        summary: the distribution summary (``hfpatch list`` shows it).
        requires: ``Requires-Dist`` lines besides ``hfpatch-core``
            (``"transformers>=5.3,<6"``).

    Returns:
        The ``*.dist-info`` directory written.

    Raises:
        FileExistsError: ``site`` already holds that distribution.
    """
    import importlib
    import sys
    import textwrap

    site = Path(site)
    site.mkdir(parents=True, exist_ok=True)
    ident = name.replace("-", "_").replace(".", "_")
    module = module or f"hfpatch_test_pack_{ident}"
    distribution = distribution or f"hfpatch-pack-{name}"
    if source is not None:
        module_file = site / f"{module}.py"
        if not module_file.exists():
            module_file.write_text(textwrap.dedent(source))
        # a module of that name imported from an earlier install would shadow this source
        sys.modules.pop(module, None)
    dist_info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {distribution}",
        f"Version: {version}",
        f"Summary: {summary}",
        "Requires-Dist: hfpatch-core",
        *(f"Requires-Dist: {requirement}" for requirement in requires),
    ]
    (dist_info / "METADATA").write_text("\n".join(metadata) + "\n")
    (dist_info / "entry_points.txt").write_text(f"[hfpatch.packs]\n{name} = {entry_point or module}\n")
    installed = [module_file] if source is not None else []
    _write_record(site, dist_info, [*installed, dist_info / "METADATA", dist_info / "entry_points.txt"])
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return dist_info


def _write_record(site: Path, dist_info: Path, files: Sequence[Path]) -> None:
    """The ``RECORD`` pip writes: each file with its sha256 and size, and ``RECORD`` itself
    unhashed (what a lock hashes a pack by)."""
    import base64
    import hashlib

    lines = []
    for path in files:
        content = path.read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        lines.append(f"{path.relative_to(site).as_posix()},sha256={digest},{len(content)}")
    lines.append(f"{dist_info.name}/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(lines) + "\n")


def install_wheel(project: str | Path, site: str | Path, *, timeout: float = 120) -> Path:
    """Build ``project``'s wheel and install it, without dependencies, into directory ``site``.

    What a pack's "discovered from an installed wheel" test needs: put ``site`` first on
    ``PYTHONPATH`` of a subprocess started outside the project's directory, and the pack
    is discovered from the wheel's own metadata.  The wheel is built without build
    isolation where hatchling is importable (offline, and faster).

    Returns:
        The wheel file (kept next to ``site``, in ``<site>-wheels``).

    Raises:
        subprocess.CalledProcessError: pip could not build or install the wheel.
    """
    import importlib.util
    import sys

    site = Path(site)
    wheels = site.with_name(f"{site.name}-wheels")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = [*pip, "wheel", "--no-deps", "--quiet", "-w", str(wheels), str(project)]
    if importlib.util.find_spec("hatchling") is not None:
        build.append("--no-build-isolation")
    subprocess.run(build, check=True, timeout=timeout)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)], check=True, timeout=timeout
    )
    return wheel


def _run_python(
    args: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str], cwd: Path, timeout: float, what: str
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a subprocess; an ``AssertionError`` with its output when it fails."""
    import sys

    command = [sys.executable, *(os.fspath(arg) for arg in args)]
    try:
        return subprocess.run(
            command, env=dict(env), cwd=cwd, capture_output=True, text=True, check=True, timeout=timeout
        )
    except subprocess.CalledProcessError as exc:
        raise AssertionError(
            f"{what} exited with status {exc.returncode}\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{what} did not finish within {timeout:g} s") from exc


@dataclasses.dataclass(frozen=True)
class DiscoveredWheel:
    """What ``discover_from_wheel`` installed and listed, and how to run more probes there.

    Attributes:
        wheel: the wheel file built from the project.
        site: the directory the wheel is installed into (the subprocesses' ``PYTHONPATH``).
        row: the pack's row of ``hfpatch list --json`` (``name``, ``distribution``,
            ``version``, ``enabled``, ``status``, ``transformers``, ``description``).
        env: the environment the listing ran in: this process's, with ``PYTHONPATH`` set
            to ``site`` alone, ``HF_PATCH_PACKS`` to the pack and ``HF_PATCH_STRICT`` unset.
        cwd: the working directory the listing ran in (outside the project).
    """

    wheel: Path
    site: Path
    row: dict[str, Any]
    env: dict[str, str]
    cwd: Path

    def run_python(self, *args: str | os.PathLike[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``python *args`` (``"-c", PROBE, ...``) as the listing ran: same environment and directory.

        Returns:
            The finished process, its output captured as text.

        Raises:
            AssertionError: the process exited with a non-zero status (the message holds its
                stdout and stderr) or ran past ``timeout`` seconds.
        """
        shown = [str(arg) for arg in args]
        if len(shown) > 1 and shown[0] == "-c":
            shown[1] = "<code>"
        return _run_python(args, env=self.env, cwd=self.cwd, timeout=timeout, what=f"python {' '.join(shown)}")


def discover_from_wheel(
    project: str | Path, pack: str, directory: str | Path, *, timeout: float = 120
) -> DiscoveredWheel:
    """Install ``project``'s wheel into ``directory/site`` and list the pack from it in a fresh process.

    The body of a pack's "discovered from an installed wheel" test: ``install_wheel``,
    then ``python -m hfpatch_core list --json`` in a subprocess whose ``PYTHONPATH`` is the
    site alone, started in ``directory`` (not the project's source directory, which would
    shadow the wheel), with ``HF_PATCH_PACKS=pack``.  The test then asserts on the row
    and runs its own probe with ``DiscoveredWheel.run_python``.

    Args:
        project: the pack's project directory (holding its ``pyproject.toml``).
        pack: the pack's entry-point name.
        directory: an empty working directory outside the project (pytest's ``tmp_path``).
        timeout: seconds each build, install and listing may take.

    Returns:
        The wheel, the site, the pack's listed row and the environment of the listing.

    Raises:
        ValueError: ``directory`` is inside ``project``.
        FileExistsError: ``directory/site`` already exists.
        subprocess.CalledProcessError: pip could not build or install the wheel.
        AssertionError: the listing failed, or does not list ``pack`` exactly once.
    """
    import json

    project, directory = Path(project).resolve(), Path(directory).resolve()
    if directory.is_relative_to(project):
        raise ValueError(
            f"{directory} is inside the project {project}: the source there would shadow the installed wheel; "
            "pass a directory outside it (tmp_path)"
        )
    site = directory / "site"
    if site.exists():
        raise FileExistsError(f"{site} already exists: pass a fresh directory for each installed wheel")
    wheel = install_wheel(project, site, timeout=timeout)
    env = {**os.environ, "PYTHONPATH": str(site), "HF_PATCH_PACKS": pack}
    env.pop("HF_PATCH_STRICT", None)
    listing = _run_python(
        ["-m", "hfpatch_core", "list", "--json"], env=env, cwd=directory, timeout=timeout, what="hfpatch list --json"
    )
    packs = json.loads(listing.stdout)["packs"]
    rows = [row for row in packs if row["name"] == pack]
    if len(rows) != 1:
        listed = sorted(row["name"] for row in packs)
        raise AssertionError(
            f"hfpatch list (PYTHONPATH={site}) lists pack {pack!r} {len(rows)} times, expected once; "
            f"it lists {listed} (is {pack!r} the entry-point name in {project / 'pyproject.toml'}?)"
        )
    return DiscoveredWheel(wheel=wheel, site=site, row=rows[0], env=env, cwd=directory)
