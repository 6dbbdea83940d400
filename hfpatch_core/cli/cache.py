"""The ``hfpatch`` command's on-disk cache: what it computes slowly and only the installed code decides.

``hfpatch list``'s conflicts, the plans ``hfpatch lock`` / ``lock --check`` make and the
installed transformers' model type names take the import of torch, transformers and every
pack, and tens of seconds to compute: they are kept in ``HF_PATCH_CACHE``
(``settings.cache_dir_from_env``), keyed by what decides them (``environment_key``): the
versions of transformers, hfpatch-core and every installed pack distribution, a hash of each
pack's installed files, and hfpatch-core's own files.  An entry written under another key,
or a file that cannot be read or parsed, is ignored and written again.  A pack whose hooks
read something else (an environment variable) is not seen changing by a cached result:
``--no-cache`` computes again.

Importing this module imports neither torch, transformers nor any pack.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..settings import cache_dir_from_env

#: The layout of a cache file; a file of another format is ignored (and rewritten).
FORMAT = 1

_T = TypeVar("_T")

#: ``--no-cache``: nothing is read, nothing written, for this process.
disabled = False


def _version(distribution: str) -> str:
    import importlib_metadata

    try:
        return str(importlib_metadata.version(distribution))
    except importlib_metadata.PackageNotFoundError:  # a source tree on the path
        return "unknown"


def _core_stamp() -> str:
    """hfpatch-core's own ``.py`` files by path, size and modification time: an editable install
    keeps its version while its code changes, and a result computed by other code is stale."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        with contextlib.suppress(OSError):
            stat = path.stat()
            digest.update(f"{path.relative_to(root)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def environment_key() -> dict[str, Any]:
    """What decides a cached result: the installed transformers and hfpatch-core (version, and
    hfpatch-core's files), and every installed pack distribution (name, version, a hash of its
    installed files, as the lock hashes them).  Reads metadata and the packs' files; imports no pack."""
    from .._pipeline.discovery import discover
    from .._pipeline.pack_files import pack_digest
    from .._pipeline.selection import installed_transformers_version

    discovery = discover()
    infos = [*discovery.packs.values(), *(info for infos in discovery.duplicates.values() for info in infos)]
    packs = sorted(
        [info.name, info.distribution, info.version, info.entry_point.value, pack_digest(info)] for info in infos
    )
    return {
        "transformers": installed_transformers_version(),
        "hfpatch-core": _version("hfpatch-core"),
        "hfpatch-core files": _core_stamp(),
        "packs": packs,
    }


def _normal(value: Any) -> Any:
    # what the value reads back as from JSON (tuples become lists): a key compares equal to its file's
    return json.loads(json.dumps(value, sort_keys=True))


class Cache:
    """One kind of cached result (``kind`` names its file), valid while ``key`` holds.

    The file is one per kind and Python environment (two virtual environments sharing the
    directory do not overwrite each other's), written whole and atomically.
    """

    def __init__(self, kind: str, key: Mapping[str, Any], directory: str | None = None) -> None:
        directory = None if disabled else cache_dir_from_env() if directory is None else directory
        environment = hashlib.sha256(sys.prefix.encode()).hexdigest()[:16]
        self.path = Path(directory) / f"{kind}-{environment}.json" if directory else None
        self.key = _normal(dict(key))
        self._entries: dict[str, Any] | None = None
        #: what ``get`` found (``hit``) and missed, for the command to say where its result came from
        self.hits = 0
        self.misses = 0

    def _load(self) -> dict[str, Any]:
        if self._entries is None:
            self._entries = {}
            if self.path is not None:
                try:
                    data = json.loads(self.path.read_text(encoding="utf-8"))
                except (OSError, ValueError):  # none yet, unreadable or corrupt: computed and written again
                    data = None
                if (
                    isinstance(data, dict)
                    and data.get("format") == FORMAT
                    and data.get("key") == self.key
                    and isinstance(data.get("entries"), dict)
                ):
                    self._entries = data["entries"]
        return self._entries

    def get(self, name: str) -> Any | None:
        """The entry ``name`` written under this key, or ``None``."""
        value = self._load().get(name)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, name: str, value: Any) -> None:
        """Keep ``value`` (JSON) as entry ``name``; a cache that cannot be written is left alone."""
        entries = self._load()
        entries[name] = _normal(value)
        if self.path is None:
            return
        data = {"format": FORMAT, "key": self.key, "entries": entries}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                json.dump(data, stream, sort_keys=True)
            os.replace(temporary, self.path)  # a reader sees the old file or the new one, never half
        except OSError:
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(temporary)

    def discard(self, stale: Callable[[str], bool]) -> None:
        """Forget the entries whose name ``stale`` accepts (written by the next ``put``): what an
        edited pack answered before its edit is never asked for again."""
        entries = self._load()
        for name in [name for name in entries if stale(name)]:
            del entries[name]

    def value(self, name: str, compute: Callable[[], _T], *, to_json: Callable[[_T], Any] = lambda v: v) -> Any:
        """The entry ``name``, computed by ``compute`` (and kept, as ``to_json`` makes it) when missing."""
        found = self.get(name)
        if found is not None:
            return found
        value = to_json(compute())
        self.put(name, value)
        return _normal(value)


def model_types() -> list[str]:
    """The installed transformers' model types (``CONFIG_MAPPING_NAMES``), cached by its version:
    input is checked against them before transformers is imported."""
    from .._pipeline.selection import installed_transformers_version

    cache = Cache("model-types", {"transformers": installed_transformers_version()})

    def names() -> list[str]:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        return list(CONFIG_MAPPING_NAMES)

    return list(cache.value("names", names))


def core_key() -> dict[str, Any]:
    """What decides a result that one pack's hooks give (``hfpatch check``'s answers): the installed
    transformers and hfpatch-core (version and files); the pack itself goes in the entry's name."""
    from .._pipeline.selection import installed_transformers_version

    return {
        "transformers": installed_transformers_version(),
        "hfpatch-core": _version("hfpatch-core"),
        "hfpatch-core files": _core_stamp(),
    }
