"""Keeping transformers' output recorders as they were after a patched load.

transformers' ``patch_output_recorders`` points the class-level ``_can_record_outputs``
of a loaded model's classes at the replacement classes, for good: a vanilla model
loaded afterwards then records no hidden states or attentions.  While hfpatch is
enabled, the call is logged; at the end of the load, the patched model gets its
capture hooks installed from the patched recorders, and the recorders are put back.

Most replacements subclass the class they replace.  A recorder that matches modules
with ``isinstance`` then already matches the replacement's instances, so the call
would change nothing a forward pass records: it is skipped, and nothing needs undoing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from transformers import monkey_patching
from transformers.utils.output_capturing import OutputRecorder

from .._pipeline.resolution import find_replacement

_log = threading.local()


def _entries() -> list[tuple[Any, Any]] | None:
    return getattr(_log, "entries", None)


class RecorderLog:
    """Collects, for one outermost load on this thread, what ``patch_output_recorders`` changed."""

    def __enter__(self) -> RecorderLog:
        self.previous = _entries()
        self.entries: list[tuple[Any, Any]] = [] if self.previous is None else self.previous
        _log.entries = self.entries
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.restore(None)  # the load raised before restore(model): undo all the same
        finally:
            _log.entries = self.previous

    def restore(self, model: Any) -> None:
        """Install ``model``'s capture hooks from the patched recorders, then undo the changes."""
        if self.previous is not None or not self.entries:
            return  # an enclosing load restores
        from transformers.utils.output_capturing import install_all_output_capturing_hooks

        try:
            if model is not None and not getattr(model, "_output_capturing_hooks_installed", False):
                install_all_output_capturing_hooks(model)
        finally:
            for target, saved in reversed(self.entries):
                if isinstance(target, OutputRecorder):
                    target.target_class = saved
                else:
                    target.clear()
                    target.update(saved)
            self.entries.clear()


def _module_classes(model: Any) -> set[type]:
    """The classes of ``model`` and of its sub-modules (what ``model.modules()`` yields, walked
    without building each module's dotted name: this runs on every patched load)."""
    classes = {type(model)}
    seen = {id(model)}
    stack = [model]
    while stack:
        for child in stack.pop()._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                classes.add(type(child))
                stack.append(child)
    return classes


def _tables(model: Any) -> Iterator[dict[str, Any]]:
    """Each distinct ``_can_record_outputs`` dict of ``model``'s module classes (a class attribute)."""
    seen: set[int] = set()
    for owner in _module_classes(model):
        table = getattr(owner, "_can_record_outputs", None)
        if isinstance(table, dict) and id(table) not in seen:
            seen.add(id(table))
            yield table


def _recorders(table: dict[str, Any]) -> Iterator[Any]:
    """The recorders of one table: a recorder, or a list of them, per output name."""
    for value in table.values():
        yield from value if isinstance(value, list) else [value]


def _remember(model: Any) -> None:
    entries = _entries()
    if entries is None:
        return
    seen = {id(target) for target, _ in entries}
    for table in _tables(model):
        if id(table) in seen:
            continue
        seen.add(id(table))
        entries.append((table, dict(table)))
        for recorder in _recorders(table):
            if isinstance(recorder, OutputRecorder) and id(recorder) not in seen:
                seen.add(id(recorder))
                entries.append((recorder, recorder.target_class))


def _changes_capture(model: Any, mapping: Mapping[str, type]) -> bool:
    """Whether repointing ``model``'s recorders at ``mapping``'s replacements changes what they capture.

    transformers matches a recorder class with ``isinstance``; one repointed at a
    subclass of its class captures the same modules of a patched model.  A recorder
    given by name (a string, or an ``OutputRecorder`` without a class) would start
    matching by class instead, which does change it.
    """
    for table in _tables(model):
        for recorder in _recorders(table):
            target = recorder.target_class if isinstance(recorder, OutputRecorder) else recorder
            if isinstance(target, type):
                replacement = find_replacement(target.__name__, mapping)
                if replacement is not None and not issubclass(replacement, target):
                    return True
            else:
                name = recorder.class_name if isinstance(recorder, OutputRecorder) else recorder
                if isinstance(name, str) and find_replacement(name, mapping) is not None:
                    return True
    return False


def guarded(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``patch_output_recorders`` that logs what it is about to change, and skips it when nothing would."""

    def patch_output_recorders(model: Any) -> None:
        if _entries() is None:
            original(model)  # not a load hfpatch manages
            return
        mapping = monkey_patching.get_patch_mapping()
        if mapping and _changes_capture(model, mapping):
            _remember(model)
            original(model)

    patch_output_recorders.__doc__ = original.__doc__
    return patch_output_recorders
