"""Importing the selected packs and calling their hooks for one load.

A pack that fails (its import raises, a hook raises, a hook returns the wrong type, a
hook changes transformers' registries itself) becomes a ``PackError``; the caller decides
whether that is a warning (the pack is skipped, the others still apply) or, in strict
mode, an error.

Hooks are called holding ``LOAD_LOCK`` (created here, the lowest layer that takes it;
``scope.LOAD_LOCK`` is the same lock), so that what transformers' registries hold
around a hook call changes only by what the hook itself did: that is undone and
reported, never left in force for every later load.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import pluggy

from .. import _compat, hookspecs
from ..context import LoadContext
from ..errors import InvalidPatchError, PackError
from ..patches import Patch, Refusal
from ..plan import Claim, ConverterClaim, Refused
from .discovery import PackInfo

#: Serialises every hfpatch-managed load, every application of the registry and every hook
#: call (``scope.LOAD_LOCK``).  Re-entrant, so that a sub-model built inside a load (a
#: composite model's text model) can load on the same thread.
LOAD_LOCK = threading.RLock()

_MISSING: Any = object()


def _name(value: object) -> str:
    return f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else type(value).__name__


def _same_items(saved: list[Any], now: list[Any]) -> bool:
    return len(saved) == len(now) and all(a is b for a, b in zip(saved, now, strict=True))


_last_capture: _Registries | None = None


@dataclasses.dataclass
class _Registries:
    """transformers' patch and conversion registries as they were before the packs' hooks ran.

    Captured before each pack's hooks and compared after each hook call (``unchanged``:
    the registry's keys, its list objects and their items), so that a pack writing the
    registries itself is caught, named and undone.  The conversion registry holds
    hundreds of lists and this runs on every load: every loop runs in C (``map``, list
    comparison, which tries identity before ``==``), and a capture still equal to the
    registries is reused rather than copied again (``capture``).
    """

    patches: dict[str, Any]
    cache: dict[str, Any]
    keys: list[str]
    values: list[Any]
    #: each list of ``values`` copied (anything else as it is), as captured
    contents: list[Any]
    user_keys: set[str] | None

    def unchanged(self) -> bool:
        """Whether both registries still hold what was captured (cheap; see the class docstring)."""
        conversion_mapping, monkey_patching = _compat.module("conversion_mapping"), _compat.module("monkey_patching")
        cache = self.cache
        if conversion_mapping._checkpoint_conversion_mapping_cache is not cache or len(cache) != len(self.values):
            return False
        values = list(cache.values())
        if not all(map(operator.is_, values, self.values)) or self.contents != values or list(cache) != self.keys:
            return False
        user_keys = _compat.user_registered_conversions()
        if user_keys is not None and self.user_keys is not None and user_keys != self.user_keys:
            return False
        return monkey_patching.get_patch_mapping() == self.patches

    @classmethod
    def capture(cls) -> _Registries:
        """The registries now: the previous capture where they still hold what it holds (``LOAD_LOCK`` held)."""
        global _last_capture
        if _last_capture is not None and _last_capture.unchanged():
            return _last_capture
        cache = _compat.conversion_cache()
        user_keys = _compat.user_registered_conversions()
        values = list(cache.values())
        if all(map(list.__instancecheck__, values)):  # transformers' registry holds nothing else
            contents = list(map(list, values))
        else:
            contents = [list(value) if isinstance(value, list) else value for value in values]
        _last_capture = cls(
            patches=_compat.module("monkey_patching").get_patch_mapping(),
            cache=cache,
            keys=list(cache),
            values=values,
            contents=contents,
            user_keys=set(user_keys) if user_keys is not None else None,
        )
        return _last_capture

    def restore(self) -> list[str]:
        """Put both registries back as captured; what had changed, one phrase each."""
        if self.unchanged():
            return []
        conversion_mapping, monkey_patching = _compat.module("conversion_mapping"), _compat.module("monkey_patching")
        now = monkey_patching.get_patch_mapping()
        changes = [
            f"register_patch_mapping({{{key!r}: {_name(value)}}})"
            for key, value in now.items()
            if self.patches.get(key, _MISSING) is not value
        ]
        changes += [f"unregister_patch_mapping([{key!r}])" for key in self.patches if key not in now]
        if changes or list(now) != list(self.patches):
            changes = changes or ["reordered the patch registry"]
            monkey_patching.clear_patch_mapping()
            if self.patches:
                monkey_patching.register_patch_mapping(self.patches)
        cache = self.cache
        conversions = dict(zip(self.keys, self.values, strict=True))
        lists = {
            key: items
            for key, value, items in zip(self.keys, self.values, self.contents, strict=True)
            if isinstance(value, list)
        }
        if conversion_mapping._checkpoint_conversion_mapping_cache is not cache:
            changes.append("replaced the conversion registry")
            conversion_mapping._checkpoint_conversion_mapping_cache = cache  # type: ignore[attr-defined]
        edited = [
            key
            for key in dict.fromkeys([*conversions, *cache])
            if cache.get(key, _MISSING) is not conversions.get(key, _MISSING)
            or (key in lists and not _same_items(lists[key], cache[key]))
        ]
        if edited:
            changes += [f"register_checkpoint_conversion_mapping({key!r}, ...)" for key in edited]
            for key, items in lists.items():
                conversions[key][:] = items
            cache.clear()
            cache.update(conversions)
        user_keys = _compat.user_registered_conversions()
        if user_keys is not None and self.user_keys is not None and user_keys != self.user_keys:
            if not edited:
                changes.append("edited the record of user-registered conversions")
            user_keys.clear()
            user_keys.update(self.user_keys)
        return changes


@dataclasses.dataclass(frozen=True)
class Gathered:
    """What the enabled packs offered for one load.

    Attributes:
        claims: one per patch, in pack-name order.
        converters: one per converter, in pack-name order (``index`` is the position here).
        packs: ``(name, version)`` of each pack whose hooks were called successfully.
        failures: one error per pack that failed; its claims are left out.
        refused: the classes packs found and refused (``Refusal``), with their reasons.
    """

    claims: tuple[Claim, ...] = ()
    converters: tuple[ConverterClaim, ...] = ()
    packs: tuple[tuple[str, str], ...] = ()
    failures: tuple[PackError, ...] = ()
    refused: tuple[Refused, ...] = ()


def _check_result(pack: str, hook: str, result: object, expected: type | tuple[type, ...], example: str) -> list[Any]:
    kinds = " or ".join(kind.__name__ for kind in (expected if isinstance(expected, tuple) else (expected,)))
    if result is None:
        raise PackError(
            pack, f"pack {pack!r}: {hook}() returned None; return an empty list when it has nothing for this model."
        )
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Iterable):
        raise PackError(
            pack,
            f"pack {pack!r}: {hook}() returned {type(result).__name__} {result!r:.80}; "
            f"return a list of {kinds} objects, e.g. [{example}].",
        )
    items = list(result)
    for item in items:
        if not isinstance(item, expected):
            raise PackError(
                pack,
                f"pack {pack!r}: {hook}() returned {type(item).__name__} {item!r:.80} among its results; "
                f"every item must be a {kinds}, e.g. {example}.",
            )
    return items


def _check_patch_targets(pack: str, patches: list[Any], converters: list[Any]) -> None:
    """A converter whose ``patch_targets`` name a patch the pack did not return would never apply."""
    targets = {patch.target for patch in patches}
    for converter in converters:
        for target in converter.patch_targets:
            if target not in targets:
                raise PackError(
                    pack,
                    f"pack {pack!r}: converter for {converter.key!r} names patch target {target!r}, but the pack "
                    f"returned no patch for it for this model (its patches: {sorted(targets)}); list the targets "
                    "of its own patches in patch_targets.",
                )


@dataclasses.dataclass(frozen=True)
class _Registration:
    """One pack module registered with pluggy: its own plugin manager, or why it cannot be used."""

    plugin: object
    manager: pluggy.PluginManager
    error: PackError | None


#: The last registration of each pack name, reused while the name loads the same plugin object:
#: registering inspects every attribute of the pack's module (pluggy's ``getattr_static``),
#: which would otherwise be paid again by the first load of every session.
_registrations: dict[str, _Registration] = {}
_registrations_lock = threading.Lock()


def _register(info: PackInfo, plugin: object) -> _Registration:
    with _registrations_lock:
        known = _registrations.get(info.name)
        if known is not None and known.plugin is plugin:
            return known
        manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        manager.add_hookspecs(hookspecs)
        manager.register(plugin, name=info.name)
        known = _registrations[info.name] = _Registration(plugin, manager, _unknown_hooks(info, manager))
        return known


def _unknown_hooks(info: PackInfo, manager: pluggy.PluginManager) -> PackError | None:
    """A pack whose hookimpl matches no hfpatch hook (a typo would otherwise be ignored)."""
    known = [name for name in dir(hookspecs) if name.startswith("provide_")]
    for name, caller in vars(manager.hook).items():
        if getattr(caller, "spec", None) is not None or not hasattr(caller, "get_hookimpls"):
            continue
        if caller.get_hookimpls():
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; hooks are {', '.join(known)}"
            return PackError(info.name, f"pack {info.name!r} implements unknown hook {name!r}{hint}", stage="import")
    return None


class PackSet:
    """The selected packs of one session: imported on first use, once each."""

    def __init__(self, packs: Mapping[str, PackInfo]) -> None:
        self.infos = dict(packs)
        self._managers: dict[str, pluggy.PluginManager] = {}
        self._loaded: dict[str, PackError | None] = {}
        self._lock = threading.Lock()

    def _load(self, info: PackInfo) -> PackError | None:
        with self._lock:
            if info.name in self._loaded:
                return self._loaded[info.name]
            error: PackError | None = None
            try:
                registration = _register(info, info.load())
                error = registration.error
                if error is None:
                    self._managers[info.name] = registration.manager
            except Exception as exc:  # a pack's import may raise anything
                error = PackError(
                    info.name,
                    f"pack {info.name!r} ({info.distribution} {info.version}) failed to import "
                    f"{info.value!r}: {type(exc).__name__}: {exc}",
                    stage="import",
                )
                error.__cause__ = exc
            self._loaded[info.name] = error
            return error

    def _call(self, info: PackInfo, hook: str, context: LoadContext, registries: _Registries) -> list[Any]:
        caller = getattr(self._managers[info.name].hook, hook)
        results: list[Any] = []
        expected: type | tuple[type, ...]
        if hook == "provide_patches":
            expected, example = (Patch, Refusal), "Patch('LlamaMLP', MyMLP)"
        else:
            from ..conversion import Converter

            expected, example = Converter, "Converter('llama', [WeightConverter(...)])"
        for impl in caller.get_hookimpls():
            arguments = {"context": context}
            try:
                try:
                    result = impl.function(*[arguments[name] for name in impl.argnames])
                finally:
                    changes = registries.restore()
                if changes:
                    raise PackError(
                        info.name,
                        f"pack {info.name!r}: {hook}() changed transformers' registries itself ({'; '.join(changes)}); "
                        "undone. Return Patch / Converter objects instead: hfpatch registers them for each load "
                        "only, and restores the registries after it.",
                    )
                results.extend(_check_result(info.name, hook, result, expected, example))
            except PackError:
                raise
            except InvalidPatchError as exc:
                raise PackError(info.name, f"pack {info.name!r}: {hook}() built an invalid value: {exc}") from exc
            except Exception as exc:
                raise PackError(info.name, f"pack {info.name!r}: {hook}() raised {type(exc).__name__}: {exc}") from exc
        return results

    def gather(self, context: LoadContext, priority_offsets: Mapping[str, int] | None = None) -> Gathered:
        """Call every selected pack's hooks for ``context``."""
        offsets = priority_offsets or {}
        claims: list[Claim] = []
        converters: list[ConverterClaim] = []
        packs: list[tuple[str, str]] = []
        failures: list[PackError] = []
        refused: list[Refused] = []
        # the lock held from each capture to its last comparison: a registry change another
        # thread makes meanwhile is not a pack's
        with LOAD_LOCK:
            for name in sorted(self.infos):
                info = self.infos[name]
                error = self._load(info)
                if error is not None:
                    failures.append(error)
                    continue
                registries = _Registries.capture()
                try:
                    offered = self._call(info, "provide_patches", context, registries)
                    patches = [item for item in offered if isinstance(item, Patch)]
                    pack_converters = self._call(info, "provide_converters", context, registries)
                    _check_patch_targets(name, patches, pack_converters)
                except PackError as exc:
                    failures.append(exc)
                    continue
                offset = offsets.get(name, 0)
                refused.extend(
                    Refused(name, info.version, item.target, item.reason)
                    for item in offered
                    if isinstance(item, Refusal)
                )
                claims.extend(
                    Claim(pack=name, version=info.version, patch=patch, priority=patch.priority + offset, index=index)
                    for index, patch in enumerate(patches)
                )
                # numbered from before the extend: len(converters) grows while a generator feeds it,
                # and two converters sharing an index would share unused_converters' verdict
                first = len(converters)
                converters.extend(
                    ConverterClaim(name, info.version, converter, converter.priority + offset, first + index)
                    for index, converter in enumerate(pack_converters)
                )
                packs.append((name, info.version))
        return Gathered(tuple(claims), tuple(converters), tuple(packs), tuple(failures), tuple(refused))
