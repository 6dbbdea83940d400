"""Recording the global state a patched load changes, and putting it back: its one owner.

A patched load changes process-wide state of transformers and must leave it as it was:
``GlobalState.capture()`` records that state; later, ``changes()`` lists what differs
from the record and ``restore()`` puts the record back and returns the same list (one
readable line per change; empty where nothing changed).  What is recorded:

* transformers' patch registry (``transformers.monkey_patching``);
* its checkpoint conversion registry (``transformers.conversion_mapping``: the cache
  dict, its entries and their lists, the keys marked user-registered);
* the classes bound in every loaded ``transformers*`` module (``loaded_classes()``);
* the class-level ``_can_record_outputs`` tables of those classes, with the
  ``target_class`` of each ``OutputRecorder`` in them.  A table of a class first
  imported after ``capture()`` cannot be restored, but one that points at a class
  defined outside transformers is reported.

Two views of the same state live here.  ``GlobalState`` records all of it and names every
change in a readable line: the ``hfpatch_isolation`` fixture (``hfpatch_core.pytest_plugin``)
and the core suite are built on it.  ``Registries`` records the two registries only, before
each pack's hooks on every load (``HOOK_GUARD``, which gathering is given), so it compares
and copies in C and is reused while unchanged.  The
module imports neither torch nor transformers until ``capture()`` is called; it does
not touch hfpatch's own session (enabling or disabling hfpatch is the caller's part).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from .. import _compat

_MISSING: Any = object()


def loaded_classes() -> dict[tuple[str, str], tuple[types.ModuleType, type]]:
    """Every class bound in a loaded ``transformers*`` module: ``(module name, attribute) -> (module, class)``."""
    found: dict[tuple[str, str], tuple[types.ModuleType, type]] = {}
    for key, module in list(sys.modules.items()):
        if not key.startswith("transformers") or not isinstance(module, types.ModuleType):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, type):
                found[(key, attribute)] = (module, value)
    return found


def _name(value: Any) -> str:
    """A short, readable form of a registry value or a recorder."""
    from transformers.utils.output_capturing import OutputRecorder

    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, OutputRecorder):
        target = value.target_class if value.target_class is not None else value.class_name
        return f"OutputRecorder({_name(target)})"
    if isinstance(value, list):
        return "[" + ", ".join(_name(item) for item in value) + "]"
    if value is None or isinstance(value, (str, int)):
        return repr(value)
    qualname = getattr(value, "__qualname__", None)
    if isinstance(qualname, str):
        return f"{getattr(value, '__module__', '?')}.{qualname}"
    return repr(value)[:60]


def _same_items(now: Any, saved: Any) -> bool:
    """Whether two values hold the very same objects (lists compared item by item)."""
    if isinstance(now, list) and isinstance(saved, list):
        return len(now) == len(saved) and all(a is b for a, b in zip(now, saved, strict=True))
    return now is saved


def _mapping_changes(what: str, now: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """What differs between two registries, one line per key (values compared by identity)."""
    changes = [f"{what}: added {key!r} -> {_name(now[key])}" for key in now if key not in saved]
    changes += [f"{what}: removed {key!r} (was {_name(saved[key])})" for key in saved if key not in now]
    changes += [
        f"{what}: {key!r} is {_name(now[key])} (was {_name(saved[key])})"
        for key in saved
        if key in now and not _same_items(now[key], saved[key])
    ]
    if not changes and list(now) != list(saved):
        changes.append(f"{what}: the order of the keys changed (it decides which pattern matches first)")
    return changes


def _recorder_tables(classes: Iterable[type]) -> dict[type, dict[str, Any]]:
    """The classes among ``classes`` that define a ``_can_record_outputs`` table of their own."""
    tables: dict[type, dict[str, Any]] = {}
    for cls in classes:
        table = cls.__dict__.get("_can_record_outputs")
        if isinstance(table, dict) and cls not in tables:
            tables[cls] = table
    return tables


def _recorders(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


@dataclasses.dataclass
class _Table:
    """One class's ``_can_record_outputs`` as it was: the dict, its entries, list contents, recorder targets."""

    owner: type
    table: dict[str, Any]
    entries: dict[str, Any]
    lists: dict[str, list[Any]]
    targets: list[tuple[Any, Any]]

    @classmethod
    def capture(cls, owner: type, table: dict[str, Any]) -> _Table:
        from transformers.utils.output_capturing import OutputRecorder

        targets = {
            id(recorder): (recorder, recorder.target_class)
            for value in table.values()
            for recorder in _recorders(value)
            if isinstance(recorder, OutputRecorder)
        }
        lists = {key: list(value) for key, value in table.items() if isinstance(value, list)}
        return cls(owner, table, dict(table), lists, list(targets.values()))

    def compare(self, fix: bool) -> list[str]:
        """What differs from the record; with ``fix``, the record is put back."""
        where = f"{_name(self.owner)}._can_record_outputs"
        changes: list[str] = []
        if self.owner.__dict__.get("_can_record_outputs") is not self.table:
            changes.append(f"{where} was replaced by another object")
            if fix:
                self.owner._can_record_outputs = self.table  # type: ignore[attr-defined]
        changed_lists = [key for key, items in self.lists.items() if not _same_items(self.entries[key], items)]
        changes += [f"{where}[{key!r}]: its list was edited in place" for key in changed_lists]
        if fix:
            for key in changed_lists:
                self.entries[key][:] = self.lists[key]
        entry_changes = _mapping_changes(where, self.table, self.entries)
        if entry_changes:
            changes += entry_changes
            if fix:
                self.table.clear()
                self.table.update(self.entries)
        for recorder, target in self.targets:
            if recorder.target_class is not target:
                changes.append(f"{where}: a recorder targets {_name(recorder.target_class)} (was {_name(target)})")
                if fix:
                    recorder.target_class = target
        return changes


def _foreign_recorders(owner: type, table: Mapping[str, Any]) -> list[str]:
    """Recorders of a transformers class that point at a class defined outside transformers."""
    from transformers.utils.output_capturing import OutputRecorder

    found = []
    for key, value in table.items():
        for recorder in _recorders(value):
            target = recorder.target_class if isinstance(recorder, OutputRecorder) else recorder
            if isinstance(target, type) and not target.__module__.startswith(("transformers", "torch.")):
                found.append(
                    f"{_name(owner)}._can_record_outputs[{key!r}] points at {_name(target)} "
                    "(the class was first imported during the test: not restored)"
                )
    return found


#: torch.nn.init functions transformers' ``no_init_weights`` swaps while a model is built.
_INIT_FUNCTIONS = ("normal_", "uniform_", "trunc_normal_", "constant_", "zeros_", "ones_", "kaiming_uniform_")


def _loader_globals() -> dict[str, Any]:
    """What the init contexts of transformers' loader swap and restore on exit (``no_tie_weights``,
    ``local_torch_dtype``, ``no_init_weights``): left changed, every later model is built wrong."""
    import torch
    from transformers import PreTrainedModel

    found: dict[str, Any] = {
        "PreTrainedModel.tie_weights": PreTrainedModel.__dict__.get("tie_weights"),
        "torch default dtype": torch.get_default_dtype(),
    }
    found.update({f"torch.nn.init.{name}": getattr(torch.nn.init, name, None) for name in _INIT_FUNCTIONS})
    return found


def _set_loader_global(name: str, value: Any) -> None:
    import torch
    from transformers import PreTrainedModel

    if name == "PreTrainedModel.tie_weights":
        PreTrainedModel.tie_weights = value  # type: ignore[method-assign]
    elif name == "torch default dtype":
        torch.set_default_dtype(value)
    else:
        setattr(torch.nn.init, name.removeprefix("torch.nn.init."), value)


@dataclasses.dataclass
class GlobalState:
    """The global state a patched load changes and must put back, as ``capture()`` found it.

    Build it with ``GlobalState.capture()``; the fields are the record and are not meant
    to be edited.
    """

    registry: dict[str, type]
    conversion_cache: dict[str, Any]
    conversions: dict[str, Any]
    conversion_lists: dict[str, list[Any]]
    user_conversions: set[str] | None
    classes: dict[tuple[str, str], tuple[types.ModuleType, type]]
    tables: list[_Table]
    loader_globals: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def capture(cls) -> GlobalState:
        """Record the state now (this imports transformers, and builds its conversion registry if no load has)."""
        from transformers import monkey_patching

        from .._compat import conversion_cache, user_registered_conversions

        conversions = conversion_cache()  # built now, so that a later registration shows
        user_keys = user_registered_conversions()  # 5.24, not 5.3
        classes = loaded_classes()
        tables = _recorder_tables(cls for _, cls in classes.values())
        return cls(
            registry=monkey_patching.get_patch_mapping(),
            conversion_cache=conversions,
            conversions=dict(conversions),
            conversion_lists={key: list(value) for key, value in conversions.items() if isinstance(value, list)},
            user_conversions=set(user_keys) if user_keys is not None else None,
            classes=classes,
            tables=[_Table.capture(owner, table) for owner, table in tables.items()],
            loader_globals=_loader_globals(),
        )

    def changes(self) -> list[str]:
        """What differs now from the record, one line per change; nothing is put back."""
        return self._compare(fix=False)

    def restore(self) -> list[str]:
        """Put everything recorded back; return what had changed (the lines ``changes()`` gives)."""
        return self._compare(fix=True)

    def _compare(self, fix: bool) -> list[str]:
        return [
            *self._compare_registry(fix),
            *self._compare_conversions(fix),
            *self._compare_classes(fix),
            *self._compare_recorders(fix),
            *self._compare_loader_globals(fix),
        ]

    def _compare_loader_globals(self, fix: bool) -> list[str]:
        changes = []
        now = _loader_globals()
        for name, saved in self.loader_globals.items():
            if now.get(name) is not saved:
                changes.append(
                    f"{name} is {_name(now.get(name))} (was {_name(saved)}): a loader context was left entered"
                )
                if fix:
                    _set_loader_global(name, saved)
        return changes

    def _compare_registry(self, fix: bool) -> list[str]:
        from transformers import monkey_patching

        changes = _mapping_changes("transformers' patch registry", monkey_patching.get_patch_mapping(), self.registry)
        if changes and fix:
            monkey_patching.clear_patch_mapping()
            if self.registry:
                monkey_patching.register_patch_mapping(self.registry)
        return changes

    def _compare_conversions(self, fix: bool) -> list[str]:
        from transformers import conversion_mapping

        what = "transformers' conversion registry"
        changes: list[str] = []
        cache = self.conversion_cache
        if conversion_mapping._checkpoint_conversion_mapping_cache is not cache:
            changes.append(f"{what}: its dict was replaced by another object")
            if fix:
                conversion_mapping._checkpoint_conversion_mapping_cache = cache  # type: ignore[assignment]
        changes += _mapping_changes(what, cache, self.conversions)
        changes += [
            f"{what}: the list of {key!r} was edited in place"
            for key, items in self.conversion_lists.items()
            if not _same_items(self.conversions[key], items)
        ]
        if changes and fix:
            for key, items in self.conversion_lists.items():
                self.conversions[key][:] = items
            cache.clear()
            cache.update(self.conversions)
        user_keys: set[str] | None = getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", None)
        if user_keys is not None and self.user_conversions is not None and user_keys != self.user_conversions:
            changes += [f"{what}: {key!r} marked user-registered" for key in sorted(user_keys - self.user_conversions)]
            changes += [
                f"{what}: {key!r} no longer marked user-registered" for key in sorted(self.user_conversions - user_keys)
            ]
            if fix:
                user_keys.clear()
                user_keys.update(self.user_conversions)
        return changes

    def _compare_classes(self, fix: bool) -> list[str]:
        changes = []
        for (key, attribute), (module, original) in self.classes.items():
            current = vars(module).get(attribute, _MISSING)
            if current is not original:
                now = "deleted" if current is _MISSING else f"is {_name(current)}"
                changes.append(f"{key}.{attribute} {now} (was {_name(original)})")
                if fix:
                    setattr(module, attribute, original)
        return changes

    def _compare_recorders(self, fix: bool) -> list[str]:
        changes = [change for table in self.tables for change in table.compare(fix)]
        known = {table.owner for table in self.tables}
        new = _recorder_tables(cls for _, cls in loaded_classes().values() if cls not in known)
        changes += [change for owner, table in new.items() for change in _foreign_recorders(owner, table)]
        return changes


# --- the registries around one hook call ---------------------------------------------------
# The same state as GlobalState's registry and conversion parts, captured far more often (before
# every pack's hooks, on every load), so compared and copied in C and reused while unchanged.

_last_capture: Registries | None = None


@dataclasses.dataclass
class Registries:
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
    def capture(cls) -> Registries:
        """The registries now: the previous capture where they still hold what it holds (the load lock held)."""
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


class _HookGuard:
    """The ``HookGuard`` gathering calls packs' hooks under: the load lock, a plain torch state
    (random generators of its own included), and ``Registries``."""

    def hold(self) -> AbstractContextManager[Any]:
        return _plain_torch_state()

    def capture(self) -> Registries:
        return Registries.capture()


@contextlib.contextmanager
def _plain_torch_state() -> Iterator[None]:
    """The load lock, with torch as a plain program has it (CPU tensors, float32, autograd on), and
    models built inside vanilla (a ``vanilla()`` block).

    A hook may build and run modules to find what it patches (probes), and its answer must
    not depend on where the load it serves was started: a nested sub-model load runs under
    transformers' meta device and the load's dtype, ``apply()`` under ``no_grad``, a user's
    ``from_pretrained`` often under ``torch.inference_mode()``.  A probe that saw those
    would refuse, or fail, and its cached verdict would hold for every later load.  A probe
    that builds a composite model (its ``__init__`` calls ``from_config`` for the text model)
    must not start a load of hfpatch's inside the one being planned.  A probe draws from the
    global random generators (a module built on the CPU draws its initial weights): the hooks
    run under ``isolated_rng``, so a seeded program draws after the load what it draws without
    packs, and a probe's draws do not depend on the caller's seed.
    """
    import torch

    from .._scope import vanilla
    from ..authoring.randomness import isolated_rng

    # under the lock (vanilla() holds it): the default dtype is process-wide, and only hfpatch's loads change it here
    with vanilla():
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            with torch.device("cpu"), torch.inference_mode(False), torch.enable_grad(), isolated_rng():
                yield
        finally:
            torch.set_default_dtype(dtype)


#: What every ``PackSet`` calls hooks under (``gathering.HookGuard``).
HOOK_GUARD = _HookGuard()
