"""pytest fixtures for pack authors (registered through the ``pytest11`` entry point).

Kept free of heavy imports: torch and transformers load only when a fixture is used.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from . import settings

_MISSING: Any = object()


@pytest.fixture
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint("llama", num_hidden_layers=1)``: a small random checkpoint directory."""
    from .testing import tiny_checkpoint as build

    def factory(model_type_or_config: Any, *, seed: int = 0, **overrides: Any) -> Path:
        name = model_type_or_config if isinstance(model_type_or_config, str) else "config"
        return build(model_type_or_config, tmp_path_factory.mktemp(f"tiny-{name}"), seed=seed, **overrides)

    return factory


@pytest.fixture
def hfpatch_disabled() -> Iterator[None]:
    """Make sure hfpatch is disabled around the test."""
    from .hooks import disable

    disable()
    yield
    disable()


class HfPatchIsolation:
    """The handle ``hfpatch_isolation`` gives the test.

    Attributes:
        changes_allowed: whether ``allow_changes()`` was called; the state is then
            restored after the test without a report.
    """

    def __init__(self) -> None:
        self.changes_allowed = False

    def allow_changes(self) -> None:
        """Let this test leave global state changed on purpose: it is still restored, but not reported."""
        self.changes_allowed = True


@dataclasses.dataclass
class _Isolation:
    """What ``hfpatch_isolation`` recorded before the test's fixtures were set up."""

    state: _GlobalState
    handle: HfPatchIsolation
    session: Any


_ISOLATION = pytest.StashKey[_Isolation]()


def _isolate(item: pytest.Item) -> _Isolation:
    from .session import active_session

    isolation = _Isolation(_GlobalState.capture(), HfPatchIsolation(), active_session())
    item.stash[_ISOLATION] = isolation
    return isolation


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # Recorded before any fixture is set up, and compared after every fixture is torn
    # down (below): what a fixture changes with monkeypatch, in whatever order the test
    # requests them, is undone by then and neither reported nor "restored" into place.
    if "hfpatch_isolation" in getattr(item, "fixturenames", ()):
        _isolate(item)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        result = yield
    finally:
        isolation = item.stash.get(_ISOLATION, None)
        leaks = _finish(isolation) if isolation is not None else []
    if leaks:
        pytest.fail(
            "hfpatch_isolation: the test left global state changed (restored now; left as it was, it "
            "would change every later load in this process):\n"
            + "\n".join(f"- {leak}" for leak in leaks)
            + "\nIf the test changes it on purpose, call hfpatch_isolation.allow_changes().",
            pytrace=False,
        )
    return result


def _finish(isolation: _Isolation) -> list[str]:
    """Restore what was recorded; the changes to report."""
    from . import hooks

    hooks.disable()
    leaks = isolation.state.restore()
    if isolation.session is not None:
        hooks.install(isolation.session)  # enabled before the test (hfpatch run -- pytest)
    return [] if isolation.handle.changes_allowed else leaks


@pytest.fixture
def hfpatch_isolation(request: pytest.FixtureRequest) -> Iterator[HfPatchIsolation]:
    """Run the test from a clean global state, and fail it if it leaves that state changed.

    Before the test: hfpatch is disabled and every hfpatch environment variable
    (``HF_PATCH_PACKS``, ``HF_PATCH_STRICT``, ``HFPATCH_AUTORUN``) is unset.  The global
    state a patched load changes and must put back is recorded before any of the
    test's fixtures is set up: transformers' patch registry
    (``transformers.monkey_patching``), its checkpoint conversion registry
    (``transformers.conversion_mapping``), the classes bound in every loaded
    ``transformers*`` module, and the class-level ``_can_record_outputs`` tables of
    those classes (with the ``target_class`` of each ``OutputRecorder`` in them).

    After every fixture of the test is torn down (so what a test or fixture patched with
    ``monkeypatch`` is undone and not counted): the environment is as before, everything
    recorded is restored, and hfpatch is disabled, or enabled again with the session it
    had before the test.  Choosing packs and enabling hfpatch is what tests do, so
    neither is reported; if anything recorded had changed, the test errors at teardown
    with a message naming each change.  A recorder table of a class first imported
    during the test cannot be restored, but one that points at a class defined outside
    transformers is reported.  A test that changes this state on purpose calls
    ``hfpatch_isolation.allow_changes()``: the state is then restored without a report.

    Yields:
        The handle with ``allow_changes()``.
    """
    from .hooks import disable

    isolation = request.node.stash.get(_ISOLATION, None)
    if isolation is None:  # requested with getfixturevalue: record from here
        isolation = _isolate(request.node)
    environment = {name: os.environ.get(name) for name in _environment_names()}
    for name in environment:
        os.environ.pop(name, None)
    disable()
    try:
        yield isolation.handle
    finally:
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _environment_names() -> list[str]:
    """Every environment variable ``hfpatch_core.settings`` names (its ``*_ENV`` constants)."""
    return [value for name, value in vars(settings).items() if name.endswith("_ENV") and isinstance(value, str)]


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
    return type(value).__name__


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


def _loaded_classes() -> dict[tuple[str, str], tuple[types.ModuleType, type]]:
    """Every class bound in a loaded ``transformers*`` module: ``(module, attribute) -> (module, class)``."""
    found: dict[tuple[str, str], tuple[types.ModuleType, type]] = {}
    for key, module in list(sys.modules.items()):
        if not key.startswith("transformers") or not isinstance(module, types.ModuleType):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, type):
                found[(key, attribute)] = (module, value)
    return found


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

    def restore(self) -> list[str]:
        where = f"{_name(self.owner)}._can_record_outputs"
        changes: list[str] = []
        if self.owner.__dict__.get("_can_record_outputs") is not self.table:
            changes.append(f"{where} was replaced by another object")
            self.owner._can_record_outputs = self.table  # type: ignore[attr-defined]
        changed_lists = [key for key, items in self.lists.items() if not _same_items(self.entries[key], items)]
        changes += [f"{where}[{key!r}]: its list was edited in place" for key in changed_lists]
        for key in changed_lists:
            self.entries[key][:] = self.lists[key]
        entry_changes = _mapping_changes(where, self.table, self.entries)
        if entry_changes:
            changes += entry_changes
            self.table.clear()
            self.table.update(self.entries)
        for recorder, target in self.targets:
            if recorder.target_class is not target:
                changes.append(f"{where}: a recorder targets {_name(recorder.target_class)} (was {_name(target)})")
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


@dataclasses.dataclass
class _GlobalState:
    """The global state a patched load changes and must put back, as ``capture()`` found it."""

    registry: dict[str, type]
    conversion_cache: dict[str, Any]
    conversions: dict[str, Any]
    conversion_lists: dict[str, list[Any]]
    user_conversions: set[str] | None
    classes: dict[tuple[str, str], tuple[types.ModuleType, type]]
    tables: list[_Table]

    @classmethod
    def capture(cls) -> _GlobalState:
        from transformers import monkey_patching

        from ._compat import conversion_cache, user_registered_conversions

        conversions = conversion_cache()  # built now, so that a registration during the test shows
        user_keys = user_registered_conversions()  # 5.24, not 5.3
        classes = _loaded_classes()
        tables = _recorder_tables(cls for _, cls in classes.values())
        return cls(
            registry=monkey_patching.get_patch_mapping(),
            conversion_cache=conversions,
            conversions=dict(conversions),
            conversion_lists={key: list(value) for key, value in conversions.items() if isinstance(value, list)},
            user_conversions=set(user_keys) if user_keys is not None else None,
            classes=classes,
            tables=[_Table.capture(owner, table) for owner, table in tables.items()],
        )

    def restore(self) -> list[str]:
        """Put everything back; return what had changed."""
        return [
            *self._restore_registry(),
            *self._restore_conversions(),
            *self._restore_classes(),
            *self._restore_recorders(),
        ]

    def _restore_registry(self) -> list[str]:
        from transformers import monkey_patching

        changes = _mapping_changes("transformers' patch registry", monkey_patching.get_patch_mapping(), self.registry)
        if changes:
            monkey_patching.clear_patch_mapping()
            if self.registry:
                monkey_patching.register_patch_mapping(self.registry)
        return changes

    def _restore_conversions(self) -> list[str]:
        from transformers import conversion_mapping

        what = "transformers' conversion registry"
        changes: list[str] = []
        cache = self.conversion_cache
        if conversion_mapping._checkpoint_conversion_mapping_cache is not cache:
            changes.append(f"{what}: its dict was replaced by another object")
            conversion_mapping._checkpoint_conversion_mapping_cache = cache  # type: ignore[assignment]
        changes += _mapping_changes(what, cache, self.conversions)
        changes += [
            f"{what}: the list of {key!r} was edited in place"
            for key, items in self.conversion_lists.items()
            if not _same_items(self.conversions[key], items)
        ]
        if changes:
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
            user_keys.clear()
            user_keys.update(self.user_conversions)
        return changes

    def _restore_classes(self) -> list[str]:
        changes = []
        for (key, attribute), (module, original) in self.classes.items():
            current = vars(module).get(attribute, _MISSING)
            if current is not original:
                now = "deleted" if current is _MISSING else f"is {_name(current)}"
                changes.append(f"{key}.{attribute} {now} (was {_name(original)})")
                setattr(module, attribute, original)
        return changes

    def _restore_recorders(self) -> list[str]:
        changes = [change for table in self.tables for change in table.restore()]
        known = {table.owner for table in self.tables}
        new = _recorder_tables(cls for _, cls in _loaded_classes().values() if cls not in known)
        changes += [change for owner, table in new.items() for change in _foreign_recorders(owner, table)]
        return changes
