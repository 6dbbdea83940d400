"""What a pack is, by the content of its files: the digest a lock holds for it.

A pack is hashed over the files its distribution's ``RECORD`` lists (an editable install's
sources too, which ``RECORD`` does not list), once per process: after that only the files'
``stat`` is read, so an edit made while the process runs is still seen.  Imports neither
torch nor transformers.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

from .discovery import PackInfo

#: Files of a ``*.dist-info`` that say how, not what, was installed: the same wheel installed
#: by pip or uv, from an index or a path, is the same pack.
_INSTALL_RECORDS = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})

_Stat = tuple[int, int, int] | None


def _stat(path: Path) -> _Stat:
    try:
        result = os.stat(path)
    except OSError:
        return None
    return (result.st_mtime_ns, result.st_size, result.st_ino)


@dataclasses.dataclass(frozen=True)
class _Installed:
    """A distribution's files as its ``RECORD`` lists them: ``(relative path, absolute path, recorded hash)``."""

    files: tuple[tuple[str, Path, str], ...]


def _dist_info(info: PackInfo) -> Path | None:
    dist = getattr(info.entry_point, "dist", None)
    path = getattr(dist, "_path", None)  # importlib_metadata's PathDistribution: its *.dist-info
    return Path(path) if path is not None else None


def _read_record(dist_info: Path) -> _Installed:
    site = dist_info.parent
    files = []
    try:
        with open(dist_info / "RECORD", newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
    except OSError:
        rows = []
    for row in rows:
        if not row or not row[0]:
            continue
        relative = row[0].replace("\\", "/")
        parts = relative.split("/")
        # __pycache__ is written by whoever imports first; scripts outside the site carry their
        # interpreter's path in the shebang: neither is the pack's content
        if "__pycache__" in parts or relative.endswith(".pyc") or parts[0] == ".." or os.path.isabs(relative):
            continue
        if len(parts) == 2 and parts[0] == dist_info.name and parts[1] in _INSTALL_RECORDS:
            continue
        files.append((relative, site / relative, row[1] if len(row) > 1 else ""))
    return _Installed(tuple(sorted(files)))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return "missing"
    return digest.hexdigest()


#: dist-info path -> (RECORD's stat, its files); dist-info path -> (the files' stats, digest)
_records: dict[str, tuple[_Stat, _Installed]] = {}
_digests: dict[str, tuple[tuple[_Stat, ...], str]] = {}
_cache_lock = threading.Lock()


def _installed(dist_info: Path) -> _Installed:
    key = str(dist_info)
    record_stat = _stat(dist_info / "RECORD")
    cached = _records.get(key)
    if cached is not None and cached[0] == record_stat:
        return cached[1]
    installed = _read_record(dist_info)
    _records[key] = (record_stat, installed)
    return installed


def _editable(dist_info: Path) -> bool:
    """Whether the distribution was installed in editable mode (``pip install -e``, PEP 660): its
    ``direct_url.json`` says so (PEP 610)."""
    try:
        data = json.loads((dist_info / "direct_url.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict) and isinstance(data.get("dir_info"), dict) and data["dir_info"].get("editable") is True
    )


def _path_entries(installed: _Installed) -> list[str]:
    """The directories the ``.pth`` files of a distribution put on ``sys.path`` (an editable install's
    source directory; ``import`` lines, such as setuptools' finder, are not paths)."""
    entries = []
    for relative, path, _ in installed.files:
        if not relative.endswith(".pth"):
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            line = line.strip()
            if line and not line.startswith(("#", "import ", "import\t")):
                entries.append(os.path.join(path.parent, line))
    return entries


def _module_root(module: str, entries: list[str]) -> Path | None:
    """The package directory, or the module file, of top-level ``module``: looked up on ``entries``
    (an editable install's ``.pth`` paths) first, then as ``import`` would find it (setuptools'
    editable finder).  Nothing is imported: ``find_spec`` of a top-level name runs no module code."""
    import importlib.machinery
    import importlib.util

    spec = None
    with contextlib.suppress(Exception):  # a broken finder or path: no sources to hash
        spec = importlib.machinery.PathFinder.find_spec(module, entries) if entries else None
    if spec is None:
        with contextlib.suppress(Exception):
            spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    return Path(spec.origin) if spec.origin and os.path.isfile(spec.origin) else None


def _walk(root: Path) -> tuple[list[Path], list[tuple[str, Path]]]:
    """The directories under package directory ``root`` (itself included) and its files, without
    ``__pycache__`` and compiled files, each named ``<package>/<path>``."""
    directories, files = [root], []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(name for name in subdirectories if name != "__pycache__")
        directories += [Path(directory, name) for name in subdirectories]
        for name in sorted(names):
            if not name.endswith((".pyc", ".pyo")):
                path = Path(directory, name)
                files.append((f"{root.name}/{path.relative_to(root).as_posix()}", path))
    return directories, files


#: dist-info path -> (an editable pack's source directories, their stats, its source files): listed
#: again only when a directory changed (a file added, removed or renamed)
_sources: dict[str, tuple[tuple[Path, ...], tuple[_Stat, ...], tuple[tuple[str, Path], ...]]] = {}


def _editable_sources(info: PackInfo, dist_info: Path, installed: _Installed) -> tuple[tuple[str, Path], ...]:
    """The source files of editable pack ``info``: every file of the package (or the module) its
    entry point names, wherever the editable install points.  Its ``RECORD`` lists only the ``.pth``
    (or finder) that points there, so without these an edited ``forward`` would not change the hash."""
    module = info.value.split(":", 1)[0].split(".", 1)[0].strip()
    root = _module_root(module, _path_entries(installed)) if module else None
    if root is None:
        return ()
    if root.is_file():
        return ((root.name, root),)
    key = str(dist_info)
    cached = _sources.get(key)
    if cached is not None and cached[0][0] == root and tuple(_stat(path) for path in cached[0]) == cached[1]:
        return cached[2]
    directories, files = _walk(root)
    _sources[key] = (tuple(directories), tuple(_stat(path) for path in directories), tuple(files))
    return tuple(files)


def editable_sources(info: PackInfo) -> str | None:
    """Where the sources of pack ``info`` are, when it is installed in editable mode (its package
    directory or module file, which the lock hashes); ``None`` otherwise."""
    dist_info = _dist_info(info)
    if dist_info is None or not _editable(dist_info):
        return None
    module = info.value.split(":", 1)[0].split(".", 1)[0].strip()
    root = _module_root(module, _path_entries(_installed(dist_info))) if module else None
    return str(root) if root is not None else None


def pack_digest(info: PackInfo) -> str:
    """The sha256 over the content of every file pack ``info``'s distribution installed (its
    ``RECORD``, without ``__pycache__``, scripts and the installer's own records), and, for a pack
    installed in editable mode, over every file of its package's sources (``_editable_sources``: an
    edit there is a changed pack, as an edit of an installed file is); ``""`` when the distribution
    is not a directory on the path (nothing to hash).

    Computed once per process; later calls only ``stat`` the files (and an editable pack's source
    directories), and hash again the distribution whose files changed.
    """
    dist_info = _dist_info(info)
    if dist_info is None:
        return ""
    with _cache_lock:
        installed = _installed(dist_info)
        if _editable(dist_info):
            installed = _Installed(
                installed.files
                + tuple((f"<sources>/{name}", path, "") for name, path in _editable_sources(info, dist_info, installed))
            )
        stats = tuple(_stat(path) for _, path, _ in installed.files)
        key = str(dist_info)
        cached = _digests.get(key)
        if cached is not None and cached[0] == stats:
            return cached[1]
        digest = hashlib.sha256()
        for relative, path, _ in installed.files:
            digest.update(f"{relative}\0{_file_sha256(path)}\n".encode())
        value = digest.hexdigest()
        _digests[key] = (stats, value)
        return value


def edited_files(info: PackInfo) -> list[str]:
    """The files of pack ``info`` whose content no longer matches the hash its ``RECORD`` holds."""
    import base64

    dist_info = _dist_info(info)
    if dist_info is None:
        return []
    edited = []
    for relative, path, recorded in _installed(dist_info).files:
        algorithm, _, expected = recorded.partition("=")
        if algorithm != "sha256" or not expected:
            continue
        actual = _file_sha256(path)
        if actual == "missing":
            edited.append(f"{relative} (missing)")
            continue
        encoded = base64.urlsafe_b64encode(bytes.fromhex(actual)).rstrip(b"=").decode()
        if encoded != expected:
            edited.append(relative)
    return edited


# --- the lock's values ----------------------------------------------------------------------
