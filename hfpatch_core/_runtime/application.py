"""Putting a plan into transformers for one load, and taking it out again.

Two pieces:

* ``registered`` adds a plan's winners to transformers' patch registry
  (``transformers.monkey_patching``) and afterwards undoes exactly what it did:
  its own keys are removed, keys it overwrote get their old value back, and keys
  that transformers or user code registered meanwhile stay.
* ``apply_registered_patches`` is what transformers' model construction runs
  (it stands in for ``transformers.modeling_utils.apply_patches`` while hfpatch is
  enabled).  It replaces the same module attributes as transformers' own
  ``apply_patches``, by the same rule, but restores them in a ``finally`` (the
  upstream one leaves them patched when construction raises), holds a re-entrant
  lock (two overlapping upstream calls leak a replacement for good), and does not
  rescan every name of every loaded transformers module on each load.
"""

from __future__ import annotations

import sys
import types
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from transformers import monkey_patching
from transformers.utils.import_utils import _LazyModule

from .. import _compat
from .._pipeline.resolution import find_replacement
from .._scope import LOAD_LOCK
from ..conversion import source_patterns_of, target_patterns_of
from ..plan import Conversions, Plan

_MISSING: Any = object()


@contextmanager
def registered(plan: Plan) -> Iterator[dict[str, type]]:
    """Register ``plan``'s winners in transformers' patch registry for the block.

    Yields the keys this call registered, with their values.  On exit, whatever
    the block did, each key still holding the value registered here is put back
    as it was before.
    """
    mapping = plan.mapping
    with LOAD_LOCK:
        before = monkey_patching.get_patch_mapping()
        changed = {key: before.get(key, _MISSING) for key in mapping}
        try:
            if mapping:
                monkey_patching.register_patch_mapping(mapping, overwrite=True)
            yield mapping
        finally:
            now = monkey_patching.get_patch_mapping()
            for key, previous in changed.items():
                if now.get(key, _MISSING) is not mapping[key]:
                    continue  # someone re-registered it during the load: theirs now
                if previous is _MISSING:
                    monkey_patching.unregister_patch_mapping([key])
                else:
                    monkey_patching.register_patch_mapping({key: previous}, overwrite=True)


# --- applying the registry ------------------------------------------------------------

_plain_dir = types.ModuleType.__dir__
_lazy_dir = _LazyModule.__dir__


def attribute_names(module: types.ModuleType) -> list[str]:
    """The names ``dir(module)`` lists, without ``_LazyModule.__dir__``'s quadratic scan, and
    without importing anything.

    A module with a ``__dir__`` of its own (transformers 5.6 to 5.17 register alias
    modules, such as ``transformers.models.aria.image_processing_aria_fast``, whose
    ``__dir__`` imports their target, which may need torchvision) lists what its namespace
    holds: the target, once imported, is a module of its own and is patched there.  A
    module of another type whose ``dir()`` raises lists its namespace too: listing a
    module never makes a load fail.
    """
    namespace = module.__dict__
    if "__dir__" in namespace:
        return list(namespace)
    kind = type(module).__dir__
    if kind is _plain_dir:
        return list(namespace)
    if kind is _lazy_dir:
        return list(dict.fromkeys([*namespace, *getattr(module, "__all__", ())]))
    try:
        return dir(module)
    except Exception:
        return list(namespace)


def _newest(namespace: Mapping[str, object]) -> str | None:
    return next(reversed(namespace.keys()), None)  # type: ignore[call-overload]


class _Entry:
    """What one module's namespace held when its matching names were last computed."""

    __slots__ = ("exported", "exported_size", "module", "names", "namespace", "newest", "size")

    def __init__(self, module: types.ModuleType, mapping: Mapping[str, object]) -> None:
        self.module = module
        self.namespace = module.__dict__
        self.refresh(mapping)

    def refresh(self, mapping: Mapping[str, object]) -> None:
        module = self.module
        self.size = len(self.namespace)
        self.newest = _newest(self.namespace)
        # a lazy module also lists the names it has not resolved yet
        exported: Sequence[str] | None = getattr(module, "__all__", ()) if isinstance(module, _LazyModule) else None
        self.exported = exported
        self.exported_size = len(exported) if exported is not None else 0
        self.names = tuple(name for name in attribute_names(module) if find_replacement(name, mapping) is not None)

    def exports_changed(self) -> bool:
        exported: Sequence[str] = getattr(self.module, "__all__", ()) if self.exported is not None else ()
        return exported is not self.exported or len(exported) != self.exported_size  # same list, grown


class _MatchCache:
    """Which attribute names of each loaded transformers module match a registry's keys.

    Keyed by the registry's keys (in order).  A module's entry is reused while its
    namespace has the same size and the same newest name (and, for a lazy module, the
    same ``__all__``).  Python dicts append every new key, so a name added since the
    last look shows as a new size or a new newest name; the one change that keeps both
    (as many names deleted as added, the newest itself deleted and re-added last) is
    not something a module namespace goes through between two loads: module code runs
    once, lazy modules only add the names they resolve.  Comparing the whole key set
    instead costs as much as the rest of a tiny model's load overhead together; the
    sizes and newest names of all modules are compared in C (``map``), and only a module
    that changed is looked at in Python.
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.modules: list[types.ModuleType] | None = None
        self.entries: list[_Entry] = []
        self.namespaces: list[dict[str, Any]] = []
        self.sizes: list[int] = []
        self.newest: list[str | None] = []
        self.lazy: list[_Entry] = []
        self.found: list[tuple[types.ModuleType, str]] = []

    def targets(
        self, modules: list[types.ModuleType], mapping: Mapping[str, object]
    ) -> list[tuple[types.ModuleType, str]]:
        """``(module, name)`` for every attribute of ``modules`` whose name ``mapping`` matches."""
        if modules is not self.modules:
            known = {id(entry.module): entry for entry in self.entries}
            self.entries = [
                entry
                if (entry := known.get(id(module))) is not None and entry.module is module
                else _Entry(module, mapping)
                for module in modules
            ]
            self.modules = modules
            self.namespaces = [entry.namespace for entry in self.entries]
            self.lazy = [entry for entry in self.entries if entry.exported is not None]
        elif (
            list(map(len, self.namespaces)) == self.sizes
            # a namespace is never empty (``__name__``); an empty one would end the map short: a miss
            and list(map(next, map(reversed, self.namespaces))) == self.newest
            and not any(entry.exports_changed() for entry in self.lazy)
        ):
            return self.found  # the hot path of every load: nothing changed
        for entry in self.entries:
            namespace = entry.namespace
            if (
                len(namespace) != entry.size
                or _newest(namespace) != entry.newest
                or (entry.exported is not None and entry.exports_changed())
            ):
                entry.refresh(mapping)
        self.sizes = [entry.size for entry in self.entries]
        self.newest = [entry.newest for entry in self.entries]
        self.found = [(entry.module, name) for entry in self.entries for name in entry.names]
        return self.found


_caches: OrderedDict[tuple[str, ...], _MatchCache] = OrderedDict()
_CACHE_SIZE = 32


def _cache_for(keys: tuple[str, ...]) -> _MatchCache:
    cache = _caches.get(keys)
    if cache is None:
        cache = _caches[keys] = _MatchCache(keys)
        while len(_caches) > _CACHE_SIZE:
            _caches.popitem(last=False)
    else:
        _caches.move_to_end(keys)
    return cache


class _ModuleIndex:
    """The loaded ``transformers*`` modules, recomputed only when ``sys.modules`` changes.

    ``sys.modules`` is taken as unchanged while it has the same size and the same newest
    entry, holding the same module (the reasoning of ``_MatchCache``: an import appends,
    and a module evicted and imported again comes back as the newest entry, with a new
    module object).  Checking that costs nothing next to a scan of the thousands of
    modules torch loads.
    """

    def __init__(self) -> None:
        self.size = -1
        self.newest: str | None = None
        self.newest_module: object = None
        self.loaded: list[types.ModuleType] = []

    def current(self) -> list[types.ModuleType]:
        loaded = sys.modules
        if (
            len(loaded) != self.size
            or (newest := _newest(loaded)) != self.newest
            or (
                loaded.get(newest) is not self.newest_module  # type: ignore[arg-type]
            )
        ):
            self.size, self.newest = len(loaded), _newest(loaded)
            self.newest_module = loaded.get(self.newest) if self.newest is not None else None
            self.loaded = []
            for key, module in list(loaded.items()):
                if not key.startswith("transformers") or module is None:
                    continue
                name = getattr(module, "__name__", None)  # transformers' own test
                if isinstance(name, str) and name.startswith("transformers"):
                    self.loaded.append(module)
        return self.loaded  # the same list while nothing changed: match caches compare it by identity


_index = _ModuleIndex()


def _transformers_modules() -> list[types.ModuleType]:
    return _index.current()


@contextmanager
def apply_mapping(mapping: Mapping[str, type]) -> Iterator[list[tuple[types.ModuleType, str, object]]]:
    """Replace, for the block, every class attribute of a loaded ``transformers*`` module
    whose name ``mapping`` matches (transformers' ``apply_patches`` rule), and restore
    them afterwards, also when the block raises.

    Yields the ``(module, name, original)`` triples it replaced.
    """
    replaced: list[tuple[types.ModuleType, str, object]] = []
    if not mapping:
        yield replaced
        return
    with LOAD_LOCK:
        cache = _cache_for(tuple(mapping))
        # what this pass installed, by (name, replacement): a lazy module that resolves a
        # name from an already patched module would otherwise hand back the replacement
        installed: dict[tuple[str, int], object] = {}
        try:
            for module, name in cache.targets(_transformers_modules(), mapping):
                replacement = find_replacement(name, mapping)
                try:
                    original = getattr(module, name)
                    if not isinstance(original, type):
                        continue
                    original = installed.get((name, id(original)), original)
                    installed[(name, id(replacement))] = original
                    replaced.append((module, name, original))
                    setattr(module, name, replacement)
                except Exception:  # a name that fails to resolve (an import error, a missing backend) is skipped
                    continue
            yield replaced
        finally:
            for module, name, original in reversed(replaced):
                setattr(module, name, original)


@contextmanager
def apply_registered_patches() -> Iterator[None]:
    """Drop-in for ``transformers.monkey_patching.apply_patches``: apply the whole registry."""
    mapping = monkey_patching.get_patch_mapping()
    with apply_mapping(mapping):
        yield


# --- conversion lists -----------------------------------------------------------------


@contextmanager
def registered_conversions(conversions: Conversions) -> Iterator[None]:
    """Register composed conversion lists for the block, then put transformers' registry
    (its lists and its record of user-registered keys) back as it was."""
    if not conversions:
        yield
        return
    conversion_mapping = _compat.module("conversion_mapping")
    with LOAD_LOCK:
        cache = _compat.conversion_cache()
        user_keys = _compat.user_registered_conversions()
        ours: dict[str, list[Any]] = {
            key: _distinct_patterns(key, conversions.transforms(key), cache) for key in conversions.lists
        }
        before = {key: cache.get(key, _MISSING) for key in ours}
        user_before = {key: key in user_keys for key in ours} if user_keys is not None else {}
        # the lists this registration displaces, for loads nested in this one (``_compat.conversions_before_hfpatch``)
        displacing = [key for key in ours if key not in _compat.displaced_conversions]
        for key in displacing:
            _compat.displaced_conversions[key] = None if before[key] is _MISSING else before[key]
        try:
            for key, transforms in ours.items():
                conversion_mapping.register_checkpoint_conversion_mapping(key, transforms, overwrite=True)
            yield
        finally:
            for key in displacing:
                del _compat.displaced_conversions[key]
            for key, transforms in ours.items():
                if cache.get(key, _MISSING) is not transforms:
                    continue  # re-registered during the load: keep theirs
                if before[key] is _MISSING:
                    del cache[key]
                else:
                    cache[key] = before[key]
                if user_keys is not None and not user_before[key]:
                    user_keys.discard(key)


def _marked(pattern: str, key: str) -> str:
    """``pattern`` with the look-ahead naming list ``key``, before a trailing ``$``: transformers
    (5.3) drops a trailing ``$`` before the look-arounds when it reverses a pattern into a name,
    so ``down_proj$(?!@gpt_oss)`` would be saved as ``down_proj$``."""
    if pattern.endswith("$"):
        return f"{pattern[:-1]}(?!@{key})$"
    return f"{pattern}(?!@{key})"


def _distinct_patterns(key: str, transforms: list[Any], cache: Mapping[str, Any]) -> list[Any]:
    """``transforms``, each converter whose source patterns another registered list has too given
    patterns of its own that match the same keys.

    transformers' loader collects a load's converters in one dict keyed by source pattern
    (``pattern_to_converter``), whatever list and sub-model scope they come from: two
    sub-models' converters with the same patterns (a llava's llama and CLIP attention, both
    ``self_attn.q_proj.weight``) meet there, and the later one converts both sub-models'
    tensors with its own sizes.  A zero-width look-ahead naming the list (``(?!@clip_vision_model)``)
    makes the strings differ and matches what the plain pattern matches; transformers strips
    look-arounds from a target (which it writes as a name), and a save reverses the
    converters: the targets become the patterns, so they get one too.
    """
    taken = {
        patterns
        for other, items in cache.items()
        if other != key and isinstance(items, list)
        for item in items
        if hasattr(item, "operations")
        for patterns in (tuple(source_patterns_of(item)), tuple(target_patterns_of(item)))
    }
    distinct = []
    for transform in transforms:
        sources, targets = tuple(source_patterns_of(transform)), tuple(target_patterns_of(transform))
        if hasattr(transform, "operations") and (sources in taken or targets in taken):
            # on the targets too: a save reverses the converters, and their targets become the patterns
            transform = type(transform)(
                source_patterns=[_marked(pattern, key) for pattern in sources],
                target_patterns=[_marked(pattern, key) for pattern in targets],
                operations=list(transform.operations),
            )
        distinct.append(transform)
    return distinct
