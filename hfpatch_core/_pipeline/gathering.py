"""Importing the selected packs and calling their hooks for one load.

A pack that fails (its import raises, a hook raises, a hook returns the wrong type, a
hook changes transformers' registries itself) becomes a ``PackError``; the caller decides
whether that is a warning (the pack is skipped, the others still apply) or, in strict
mode, an error.

Hooks are called under the ``HookGuard`` the caller gives the ``PackSet`` (the runtime's
``snapshot.HOOK_GUARD``: the load lock held, the registries captured before and compared
after each hook), so that what transformers' registries hold around a hook call changes
only by what the hook itself did: that is undone and reported, never left in force for
every later load.
"""

from __future__ import annotations

import dataclasses
import difflib
import threading
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import pluggy

from .. import hookspecs
from ..context import LoadContext
from ..errors import InvalidPatchError, PackError
from ..patches import ModelStep, Patch, Refusal
from ..plan import Claim, ConverterClaim, Refused, StepClaim
from .discovery import PackInfo


class Captured(Protocol):
    """The registries as a guard captured them before a hook ran."""

    def restore(self) -> list[str]:
        """Put them back as captured; what the hook had changed, one phrase each (empty: nothing)."""
        ...


class HookGuard(Protocol):
    """What gathering calls the packs' hooks under (``hfpatch_core._runtime.snapshot.HOOK_GUARD``).

    Gathering is a pure step: it neither locks nor touches transformers' registries itself.
    The guard it is given holds the load lock for a whole gather (``hold``) and captures the
    registries before each pack's hooks (``capture``), so that a hook that writes them is
    caught, named and undone, never left in force for every later load.
    """

    def hold(self) -> AbstractContextManager[Any]:
        """The lock held from the first capture to the last comparison."""
        ...

    def capture(self) -> Captured:
        """The registries now."""
        ...


@dataclasses.dataclass(frozen=True)
class Gathered:
    """What the enabled packs offered for one load.

    Attributes:
        claims: one per patch, in pack-name order.
        converters: one per converter, in pack-name order (``index`` is the position here).
        packs: ``(name, version)`` of each pack whose hooks were called successfully.
        failures: one error per pack that failed; its claims are left out.
        refused: the classes packs found and refused (``Refusal``), with their reasons.
        steps: one per model step, in pack-name order (root loads only).
    """

    claims: tuple[Claim, ...] = ()
    converters: tuple[ConverterClaim, ...] = ()
    packs: tuple[tuple[str, str], ...] = ()
    failures: tuple[PackError, ...] = ()
    refused: tuple[Refused, ...] = ()
    steps: tuple[StepClaim, ...] = ()


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

    def __init__(self, packs: Mapping[str, PackInfo], *, guard: HookGuard) -> None:
        self.infos = dict(packs)
        self.guard = guard
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

    def _call(self, info: PackInfo, hook: str, context: LoadContext, registries: Captured) -> list[Any]:
        caller = getattr(self._managers[info.name].hook, hook)
        results: list[Any] = []
        expected: type | tuple[type, ...]
        if hook == "provide_patches":
            expected, example = (Patch, Refusal), "Patch('LlamaMLP', MyMLP)"
        elif hook == "provide_model_steps":
            expected, example = (ModelStep, Refusal), "ModelStep('causal-lm-loss', install, uninstall)"
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
        steps: list[StepClaim] = []
        # the lock held from each capture to its last comparison: a registry change another
        # thread makes meanwhile is not a pack's
        with self.guard.hold():
            for name in sorted(self.infos):
                info = self.infos[name]
                error = self._load(info)
                if error is not None:
                    failures.append(error)
                    continue
                registries = self.guard.capture()
                try:
                    offered = self._call(info, "provide_patches", context, registries)
                    patches = [item for item in offered if isinstance(item, Patch)]
                    pack_converters = self._call(info, "provide_converters", context, registries)
                    _check_patch_targets(name, patches, pack_converters)
                    # a step changes the model a load returns: a sub-model is part of its root's
                    offered_steps = (
                        self._call(info, "provide_model_steps", context, registries) if context.parent is None else []
                    )
                except PackError as exc:
                    failures.append(exc)
                    continue
                offset = offsets.get(name, 0)
                refused.extend(
                    Refused(name, info.version, item.target, item.reason)
                    for item in (*offered, *offered_steps)
                    if isinstance(item, Refusal)
                )
                pack_steps = [item for item in offered_steps if isinstance(item, ModelStep)]
                steps.extend(
                    StepClaim(name, info.version, step, step.priority + offset, index)
                    for index, step in enumerate(pack_steps)
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
        return Gathered(tuple(claims), tuple(converters), tuple(packs), tuple(failures), tuple(refused), tuple(steps))
