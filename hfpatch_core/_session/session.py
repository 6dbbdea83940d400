"""A session: the packs one ``enable()`` or ``enabled()`` selected, and the loads made with them.

A ``Session`` plans each load (``planning.plan_load``), keeps the plan registered in
transformers for exactly that load (``Session.applied``), and reports pack failures as
warnings or, in strict mode, errors.  Loads nest: a composite model's text model is a
load inside the outer one, on the same thread.  How a session gets into transformers'
loaders is ``hooks``; models built by hand are ``manual``.

Which session a load uses is decided where it runs: the innermost ``enabled()`` block
of the current thread or asyncio task (a context variable), else the process-wide one
``enable()`` made.  Loads are serialised by ``scope.LOAD_LOCK``, so one session's
registrations are in transformers at a time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Literal

from transformers import monkey_patching

from .._pipeline.foreign import changed_registry_error, registry_changes
from .._pipeline.gathering import PackSet
from .._pipeline.locking import Lock
from .._pipeline.planning import class_names_for, plan_load
from .._pipeline.selection import Selection, current_selection
from .._runtime.application import registered, registered_conversions
from .._runtime.frames import Loader, caller_stacklevel
from .._runtime.snapshot import HOOK_GUARD
from .._scope import LOAD_LOCK, in_vanilla_block
from ..context import LoadContext
from ..errors import HfPatchError, PackWarning
from ..plan import Plan
from ..settings import lock_from_env, strict_from_env

#: What ``enable(lock=...)`` takes: a lock file, ``None`` for ``HF_PATCH_LOCK``'s, ``False`` for none.
LockChoice = str | os.PathLike[str] | Literal[False] | None


class Session:
    """The packs one ``enable()`` selected, and the loads made with them.

    ``lock``: every plan is checked against it (``Lock.check_packs`` / ``check_plan``).
    """

    def __init__(self, selection: Selection, *, strict: bool, lock: Lock | None = None) -> None:
        self.selection = selection
        self.strict = strict
        self.lock = lock
        self.packs = PackSet(selection.packs, guard=HOOK_GUARD)
        self._warned: set[str] = set()
        self._local = threading.local()

    # nesting ------------------------------------------------------------------------
    def frames(self) -> list[Frame]:
        """The loads in progress on this thread, outermost first."""
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    @property
    def current(self) -> LoadContext | None:
        """The context of the innermost load running on this thread whose plan is made."""
        for frame in reversed(self.frames()):
            if frame.plan is not None:
                return frame.plan.context
        return None

    def _owned(self) -> frozenset[str]:
        return frozenset().union(*(frozenset(frame.plan.mapping) for frame in self.frames() if frame.plan))

    # reporting ----------------------------------------------------------------------
    def report(self, errors: Iterable[HfPatchError]) -> None:
        """Raise the first error in strict mode; otherwise warn once per distinct message."""
        errors = list(errors)
        if self.strict and errors:
            raise errors[0]
        for error in errors:
            message = str(error)
            if message not in self._warned:
                self._warned.add(message)
                warnings.warn(message, PackWarning, stacklevel=caller_stacklevel())

    # planning -----------------------------------------------------------------------
    def plan(
        self, context: LoadContext, class_names: Iterable[str] = (), fusion: Mapping[str, type] | None = None
    ) -> Plan:
        """The plan of a load of ``context`` made now, on this thread (see ``planning.plan_load``).

        ``fusion``: the patches of the load's ``fusion_config`` (transformers 5.25 applies
        them for the load only, see ``Frame.fusion``), planned as if registered directly.

        Raises:
            LockError: a lock is in force, and the packs or the plan differ from it (raised
                before the load builds anything or reads a weight).
            PackError: strict mode, and a pack failed or was skipped.
            PatchConflictError: two packs tie on a target.
        """
        if self.lock is not None:
            self.lock.check_packs(self.selection)
        self.report(self.selection.problems)
        plan = plan_load(
            context,
            self.packs,
            priority_offsets=self.selection.spec.priority_offsets,
            class_names=class_names,
            registered={**monkey_patching.get_patch_mapping(), **(fusion or {})},
            overridable=self._owned(),
            report=self.report,
            selection=self.selection.spec,
        )
        if self.lock is not None:
            self.lock.check_plan(plan)
        return plan

    @contextmanager
    def applied(
        self, context: LoadContext | None, class_names: Iterable[str] = (), *, loader: Loader | None = None
    ) -> Iterator[Frame]:
        """Keep a plan registered for the block (lock held).

        With a ``context`` the plan is made on entry.  With ``loader`` instead it is made
        when transformers' loader (``from_pretrained`` / ``_from_config``) enters
        ``apply_patches``, just before it builds the model: the config is then the very
        object the model receives, with every keyword argument, ``attn_implementation``
        and ``dtype`` already applied, and transformers has read ``config.json`` once.

        A load nested in another on the same thread (a composite model's text model)
        registers its patches for its own block, but its converters until the outermost
        load ends: transformers collects the conversions of every sub-model only after
        the whole model is built.
        """
        with LOAD_LOCK:
            frames = self.frames()
            frame = Frame(self, root=frames[0] if frames else None, loader=loader)
            frames.append(frame)
            try:
                with frame.cleanup:
                    if context is not None:
                        frame.resolve(context, class_names)
                    yield frame
            finally:
                frames.pop()

    def resolve_pending(self) -> None:
        """Plan the innermost load on this thread if it waits for its loader's config (see ``applied``)."""
        frames = self.frames()
        frame = frames[-1] if frames else None
        if frame is None or frame.plan is not None or frame.loader is None:
            return
        model_class = frame.loader.model_class
        config, parallel = frame.loader.arguments()
        context = LoadContext.for_model(model_class, config, parent=self.current, parallel=parallel)
        frame.resolve(context, class_names_for(model_class))

    def expect_fusion(self, mapping: Mapping[str, type]) -> Plan | None:
        """Record the fusion patches transformers will apply in the innermost load on this thread.

        transformers 5.25 builds a load's init contexts (``apply_patches()``, then
        ``apply_patches(fusion mapping)``) before entering any: the mapping is known here
        before the load is planned, and planned with it (see ``Frame.fusion``).  Returns
        the load's plan when it is already made (the mapping then came too late to plan).
        """
        frames = self.frames()
        if not frames:
            return None
        frame = frames[-1]
        if frame.plan is None:
            frame.fusion.update(mapping)
        return frame.plan

    def current_plan(self) -> Plan | None:
        """The plan of the innermost load on this thread, once made."""
        frames = self.frames()
        return frames[-1].plan if frames else None

    def in_root_load(self) -> bool:
        """Whether the innermost load on this thread is a root: no loader runs around it (a
        load inside ``patched()`` is one; a composite model's text model is not)."""
        return all(outer.loader is None for outer in self.frames()[:-1])


@dataclasses.dataclass(eq=False)
class Frame:
    """One load in progress on this thread."""

    session: Session
    root: Frame | None = None
    loader: Loader | None = None
    plan: Plan | None = None
    nested: list[Plan] = dataclasses.field(default_factory=list)
    #: transformers' fusion patches for this load (5.25's ``apply_patches(mapping)``): they
    #: rank as a direct registration, so a pack's claim on one of their classes wins only
    #: with ``overwrite=True``
    fusion: dict[str, type] = dataclasses.field(default_factory=dict)
    cleanup: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

    def resolve(self, context: LoadContext, class_names: Iterable[str]) -> Plan:
        """Make this load's plan and register it until the load ends."""
        plan = self.session.plan(context, class_names, self.fusion)
        (self.root or self).cleanup.enter_context(registered_conversions(plan.conversions))
        if self.root is not None:
            self.root.nested.append(plan)
        self.cleanup.enter_context(registered(plan))
        self.plan = plan
        return plan

    def final_plan(self) -> Plan | None:
        """The load's plan with the plans of the sub-models loaded inside it, and the entries
        of its own that code run by the load took out of transformers' patch registry."""
        if self.plan is None:
            return None
        plan = self.plan
        changed = registry_changes(plan.mapping, monkey_patching.get_patch_mapping()) if plan.mapping else ()
        if changed:
            self.session.report(changed_registry_error(plan, changed))
            plan = dataclasses.replace(plan, foreign=(*plan.foreign, *changed))
        return dataclasses.replace(plan, nested=tuple(self.nested)) if self.nested else plan


_active: Session | None = None

#: The session of the innermost ``hooks.enabled()`` block of this thread or asyncio task.
_scoped: contextvars.ContextVar[Session | None] = contextvars.ContextVar("hfpatch_scoped_session", default=None)


def activate(session: Session | None) -> None:
    """Make ``session`` the process-wide default (``None``: none); ``hooks.enable`` / ``disable`` call it."""
    global _active
    _active = session


def active_session() -> Session | None:
    """The process-wide session ``enable()`` started, or ``None`` while there is none."""
    return _active


@contextmanager
def scoped(session: Session) -> Iterator[None]:
    """Make ``session`` the one this thread or asyncio task loads with, for the block (``hooks.enabled``)."""
    token = _scoped.set(session)
    try:
        yield
    finally:
        _scoped.reset(token)


def current_session() -> Session | None:
    """The session loads here use: the innermost ``enabled()`` block's on this thread or task,
    else the one ``enable()`` started; ``None`` when neither is in force."""
    return _scoped.get() or _active


def live_session() -> Session | None:
    """The session a load here uses now (``current_session``): ``None`` when there is none, it
    selects no pack (and its lock, if any, locks none), or inside ``scope.vanilla()``."""
    session = current_session()
    if session is None or in_vanilla_block():
        return None
    if not session.selection.packs and (session.lock is None or not session.lock.packs):
        return None
    return session


def lock_for(lock: LockChoice) -> Lock | None:
    """The lock ``enable(lock=...)`` asks for: ``None`` reads ``HF_PATCH_LOCK``, ``False`` is none.

    Raises:
        LockError: the lock file cannot be read or is not a lock.
    """
    if lock is None:
        lock = lock_from_env()
    if lock is None or lock is False:
        return None
    if lock is True:
        raise TypeError("lock=True names no file: pass the lock file, None (HF_PATCH_LOCK) or False")
    return Lock.read(lock)


def new_session(
    packs: str | Iterable[str] | None = None, strict: bool | None = None, lock: LockChoice = None
) -> Session:
    """Discover and select packs as ``enable()`` would, without enabling anything."""
    locked = lock_for(lock)
    return Session(
        current_selection(packs, locked=locked.selection if locked is not None else None),
        strict=strict_from_env() if strict is None else strict,
        lock=locked,
    )
