"""Turning hfpatch on for a process: every model load gathers, resolves and applies packs.

``enable()`` wraps ``PreTrainedModel.from_pretrained`` and ``PreTrainedModel._from_config``
(which the Auto classes and ``from_config`` end in) and stands hfpatch's
exception-safe application in for ``transformers.modeling_utils.apply_patches``.
``disable()`` puts all three back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn
from transformers import PreTrainedModel, modeling_utils, monkey_patching

from . import application, recorders
from .application import LOAD_LOCK, apply_mapping, registered, registered_conversions
from .composition import compose_for, unused_converters
from .context import LoadContext
from .errors import HfPatchError, PackError, PackWarning
from .gathering import PackSet
from .layout import check_loading_info, guard_saving, reversible_conversions
from .plan import Claim, Plan
from .resolution import resolve
from .selection import Selection, current_selection
from .settings import strict_from_env

logger = logging.getLogger("hfpatch")

#: The attribute of a loaded model that holds its ``Plan``.
PLAN_ATTRIBUTE = "hfpatch_plan"


_INTERNAL = ("hfpatch_core", "transformers", "contextlib", "importlib")


def _caller_stacklevel() -> int:
    """The stack level of the first frame outside hfpatch, transformers and contextlib,
    so that a warning points at the user's ``from_pretrained`` line."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_INTERNAL):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 1


class Session:
    """The packs one ``enable()`` selected, and the loads made with them."""

    def __init__(self, selection: Selection, *, strict: bool) -> None:
        self.selection = selection
        self.strict = strict
        self.packs = PackSet(selection.packs)
        self._warned: set[str] = set()
        self._local = threading.local()

    # nesting ------------------------------------------------------------------------
    def _frames(self) -> list[_Frame]:
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    @property
    def current(self) -> LoadContext | None:
        """The context of the innermost load running on this thread whose plan is made."""
        for frame in reversed(self._frames()):
            if frame.plan is not None:
                return frame.plan.context
        return None

    def _owned(self) -> frozenset[str]:
        return frozenset().union(*(frozenset(frame.plan.mapping) for frame in self._frames() if frame.plan))

    # reporting ----------------------------------------------------------------------
    def _report(self, errors: Iterable[HfPatchError]) -> None:
        errors = list(errors)
        if self.strict and errors:
            raise errors[0]
        for error in errors:
            message = str(error)
            if message not in self._warned:
                self._warned.add(message)
                warnings.warn(message, PackWarning, stacklevel=_caller_stacklevel())

    # planning -----------------------------------------------------------------------
    def plan(self, context: LoadContext, class_names: Iterable[str] = ()) -> Plan:
        """Gather the selected packs' claims for ``context`` and resolve them.

        Raises:
            PackError: strict mode, and a pack failed or was skipped.
            PatchConflictError: two packs tie on a target.
        """
        gathered = self.packs.gather(context, self.selection.spec.priority_offsets)
        self._report([*self.selection.problems, *gathered.failures])
        class_names = tuple(class_names)
        plan = resolve(
            gathered.claims,
            context=context,
            registered=monkey_patching.get_patch_mapping(),
            overridable=self._owned(),
            class_names=class_names,
            packs=gathered.packs,
        )
        unused = unused_converters(gathered.converters, gathered.claims, plan, classes_known=bool(class_names))
        offsets = self.selection.spec.priority_offsets
        conversions = compose_for(context, gathered.converters, offsets, unused)
        self._report(
            PackError(
                claim.pack,
                f"pack {claim.pack!r}: converter for {claim.key!r} replaces {pattern!r}, "
                "which matches no transform registered for that key; check the source pattern.",
            )
            for claim, pattern in conversions.unmatched
        )
        return dataclasses.replace(plan, conversions=conversions)

    @contextmanager
    def applied(
        self, context: LoadContext | None, class_names: Iterable[str] = (), *, loader: _Loader | None = None
    ) -> Iterator[_Frame]:
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
            frames = self._frames()
            frame = _Frame(self, root=frames[0] if frames else None, loader=loader)
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
        frames = self._frames()
        frame = frames[-1] if frames else None
        if frame is None or frame.plan is not None or frame.loader is None:
            return
        model_class = frame.loader.model_class
        context = LoadContext.for_model(model_class, frame.loader.config(), parent=self.current)
        frame.resolve(context, _module_class_names(model_class))


@dataclasses.dataclass(frozen=True)
class _Loader:
    """A transformers loader hfpatch wraps: the class it builds and the code of the loader function."""

    model_class: type
    code: types.CodeType

    def config(self) -> Any:
        """The ``config`` local of the running loader (the config it is about to build with)."""
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is self.code:
                return frame.f_locals.get("config")
            frame = frame.f_back  # type: ignore[assignment]
        return None


@dataclasses.dataclass(eq=False)
class _Frame:
    """One load in progress on this thread."""

    session: Session
    root: _Frame | None = None
    loader: _Loader | None = None
    plan: Plan | None = None
    nested: list[Plan] = dataclasses.field(default_factory=list)
    cleanup: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

    def resolve(self, context: LoadContext, class_names: Iterable[str]) -> Plan:
        """Make this load's plan and register it until the load ends."""
        plan = self.session.plan(context, class_names)
        (self.root or self).cleanup.enter_context(registered_conversions(plan.conversions))
        if self.root is not None:
            self.root.nested.append(plan)
        self.cleanup.enter_context(registered(plan))
        self.plan = plan
        return plan

    def final_plan(self) -> Plan | None:
        if self.plan is None or not self.nested:
            return self.plan
        return dataclasses.replace(self.plan, nested=tuple(self.nested))


def _blame(exc: BaseException, plan: Plan) -> PackError | None:
    """A PackError naming the replacement class whose code raised ``exc``, if one did."""
    claims: dict[type, Claim] = {claim.patch.replacement: claim for each in plan.all_plans() for claim in each.entries}
    culprit = None
    traceback = exc.__traceback__
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if type(owner) in claims:
            culprit = claims[type(owner)]
        traceback = traceback.tb_next
    if culprit is None:
        return None
    where = plan.context.model_class_name if plan.context else "the model"
    return PackError(
        culprit.pack,
        f"pack {culprit.pack!r}: {culprit.patch.replacement_name} (replacing {culprit.target!r}) raised "
        f"{type(exc).__name__}: {exc} while building {where}; the load was undone, nothing is left patched.",
    )


_active: Session | None = None
_state_lock = threading.Lock()
_suspension = threading.local()


@contextmanager
def suspended() -> Iterator[None]:
    """Build vanilla models inside the block: loads on this thread skip hfpatch."""
    previous = getattr(_suspension, "active", False)
    _suspension.active = True
    try:
        yield
    finally:
        _suspension.active = previous


def _live_session() -> Session | None:
    session = _active
    if session is None or not session.selection.packs or getattr(_suspension, "active", False):
        return None
    return session


_originals: dict[str, Any] = {}


def active_session() -> Session | None:
    """The session ``enable()`` started, or ``None`` while hfpatch is disabled."""
    return _active


def new_session(packs: str | Iterable[str] | None = None, strict: bool | None = None) -> Session:
    """Discover and select packs as ``enable()`` would, without enabling anything."""
    return Session(current_selection(packs), strict=strict_from_env() if strict is None else strict)


def module_classes(module: types.ModuleType) -> dict[str, type]:
    """The ``nn.Module`` classes a module holds, by attribute name (what a load resolves claims against)."""
    return {
        name: value for name, value in vars(module).items() if isinstance(value, type) and issubclass(value, nn.Module)
    }


def _module_class_names(model_class: type) -> list[str]:
    module = sys.modules.get(model_class.__module__)
    return list(module_classes(module)) if module is not None else [model_class.__name__]


def _attach(model: object, plan: Plan) -> None:
    if isinstance(model, nn.Module):
        object.__setattr__(model, PLAN_ATTRIBUTE, plan)
    logger.info(plan.summary())


def _managed(cls: type, load: Callable[[], Any], code: types.CodeType, *, loading_info: bool = False) -> Any:
    """Run transformers' loader ``load`` for ``cls`` with the session's plan registered.

    The plan is made when the loader enters ``apply_patches`` (see
    ``Session.applied``); ``code`` is the loader function's code, whose frame holds
    the config.  ``loading_info``: ``load`` returns ``(model, info)`` (``from_pretrained``
    asked for ``output_loading_info``), used to check that every weight a pack touches
    was loaded.
    """
    session = _live_session()
    if session is None:
        return load()
    loader = _Loader(cls, code)
    with session.applied(None, loader=loader) as frame, recorders.RecorderLog() as log:
        try:
            result = load()
        except HfPatchError:
            raise
        except Exception as exc:
            plan = frame.final_plan()
            blamed = _blame(exc, plan) if plan is not None else None
            if blamed is None:
                raise
            raise blamed from exc
        plan = frame.final_plan()
        model, info = result if loading_info else (result, None)
        if plan is None:
            # the loader never entered apply_patches (a custom from_pretrained): nothing was applied
            logger.warning("hfpatch: %s was built without transformers' apply_patches; no pack applied", cls.__name__)
            return result
        # sub-models are checked with the model holding them; a load inside patched() is a root
        is_root = all(outer.loader is None for outer in session._frames()[:-1])
        if isinstance(model, nn.Module) and is_root:
            if info is not None and plan.touches_weights:
                check_loading_info(model, plan, info)
            if info is None and plan.conversions and getattr(model, "_weight_conversions", None) is None:
                # built from a config: keep the conversions that saving must reverse
                object.__setattr__(model, "_weight_conversions", reversible_conversions(model))
            guard_saving(model, plan)
        log.restore(model if isinstance(model, nn.Module) else None)
    _attach(model, plan)
    return result


@contextmanager
def _apply_patches() -> Iterator[None]:
    """hfpatch's ``modeling_utils.apply_patches``: plan a pending load with its loader's config, then apply."""
    session = _live_session()
    if session is not None:
        session.resolve_pending()
    with application.apply_registered_patches():
        yield


def _wrap_from_pretrained(original: classmethod) -> classmethod:
    function = original.__func__

    @functools.wraps(function)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _live_session() is None:
            return function(cls, *args, **kwargs)
        wanted = bool(kwargs.pop("output_loading_info", False))
        result = _managed(
            cls,
            lambda: function(cls, *args, output_loading_info=True, **kwargs),
            function.__code__,
            loading_info=True,
        )
        return result if wanted else result[0]

    return classmethod(from_pretrained)


def _wrap_from_config(original: classmethod) -> classmethod:
    function = original.__func__

    @functools.wraps(function)
    def _from_config(cls: type, config: Any, **kwargs: Any) -> Any:
        return _managed(cls, lambda: function(cls, config, **kwargs), function.__code__)

    return classmethod(_from_config)


def enable(packs: str | Iterable[str] | None = None, strict: bool | None = None) -> Selection:
    """Turn hfpatch on for this process.

    From now on every ``from_pretrained`` / ``from_config`` (Auto classes included)
    gathers the enabled packs for the model it builds, resolves their claims and
    applies the winners for that load only.  Calling it again replaces the choice.

    Args:
        packs: which packs run, in ``HF_PATCH_PACKS`` syntax (a string or a list of
            items, e.g. ``["all", "-experimental", "fast@+10"]``); ``None`` reads
            ``HF_PATCH_PACKS``.
        strict: make every pack failure an error; ``None`` reads ``HF_PATCH_STRICT``.

    Returns:
        The selection: which packs run, and why each other installed pack does not.

    Raises:
        SelectionError: the choice is malformed or names a pack that is not installed.
        PackError: strict mode, and a selected pack is incompatible or ambiguous.
    """
    session = new_session(packs, strict)
    session._report(session.selection.problems)
    _install(session)
    return session.selection


def _install(session: Session) -> None:
    """Make ``session`` the active one, hooking into transformers if not already."""
    global _active
    with _state_lock:
        if not _originals:
            for owner, name, wrap in _hooked():
                original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
                _originals[name] = (owner, original)
                setattr(owner, name, wrap(original))
        _active = session


def _hooked() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """Where hfpatch hooks into transformers: (owner, attribute, wrapper of the original)."""
    return [
        (PreTrainedModel, "from_pretrained", _wrap_from_pretrained),
        (PreTrainedModel, "_from_config", _wrap_from_config),
        (modeling_utils, "apply_patches", lambda _original: _apply_patches),
        (modeling_utils, "patch_output_recorders", recorders.guarded),
    ]


def disable() -> None:
    """Turn hfpatch off: loads behave as in plain transformers again."""
    global _active
    with _state_lock:
        _active = None
        for name, (owner, original) in list(_originals.items()):
            setattr(owner, name, original)
            del _originals[name]


def is_enabled() -> bool:
    """Whether ``enable()`` is in force."""
    return _active is not None


def _context_for_manual(config_or_model_type: Any, model_class: type | None) -> tuple[LoadContext, list[str]]:
    if isinstance(config_or_model_type, str):
        config = None
        model_type: str | None = config_or_model_type
    else:
        config = config_or_model_type
        model_type = getattr(config, "model_type", None)
    if model_class is not None:
        return LoadContext.for_model(model_class, config), _module_class_names(model_class)
    names = list(getattr(config, "architectures", None) or ())
    if not names and model_type:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

        mapped = MODEL_MAPPING_NAMES.get(model_type)
        names = [mapped] if isinstance(mapped, str) else list(mapped or ())
    class_name = names[0] if names else "PreTrainedModel"
    module = f"transformers.models.{model_type}.modeling_{model_type}" if model_type else ""
    class_names = list(module_classes(sys.modules[module])) if module in sys.modules else []
    return LoadContext(model_type=model_type, model_class_name=class_name, config=config), class_names


@contextmanager
def patched(config_or_model_type: Any, *, model_class: type | None = None) -> Iterator[Plan]:
    """Apply the enabled packs to models built by hand inside the block.

    ``with patched(config) as plan: model = LlamaForCausalLM(config)``.  The packs see
    the same context a load of that config would give them; the same lock is held and
    the same restore runs on exit.  Uses the session ``enable()`` started, or, when
    hfpatch is not enabled, the packs ``HF_PATCH_PACKS`` selects.

    Args:
        config_or_model_type: a config, or a ``model_type`` string.
        model_class: the class about to be built, when the config does not name it.

    Each model built in the block (and not loaded by ``from_pretrained`` /
    ``from_config``, which do this themselves) gets the plan (``plan_of``), and, when
    the packs convert weights, saves through the reversed conversions with the layout
    check, as a model loaded from a config does.

    Yields:
        The plan in force inside the block.
    """
    # a nested patched() without enable() shares the outer block's session, so that the
    # outer block's registrations count as hfpatch's own (overridable), not the user's
    outer_session = getattr(_manual, "session", None)
    session = _active or outer_session or new_session()
    _manual.session = session
    context, class_names = _context_for_manual(config_or_model_type, model_class)
    with (
        _manual_session_restored(outer_session),
        session.applied(context, class_names) as frame,
        recorders.RecorderLog(),
        apply_mapping(monkey_patching.get_patch_mapping()),
        _models_built() as built,
    ):
        assert frame.plan is not None  # a context was given: planned on entry
        yield frame.plan
        plan = frame.plan
        inner = {id(module) for model in built for module in list(model.modules())[1:]}
        for model in built:
            if id(model) in inner or plan_of(model) is not None:
                continue  # a sub-model, or loaded by a managed loader inside the block
            if plan.conversions:
                # what from_config records: the conversions saving must reverse
                object.__setattr__(model, "_weight_conversions", reversible_conversions(model))
            guard_saving(model, plan)
            _attach(model, plan)


#: The session of the innermost ``patched()`` block on this thread made without ``enable()``.
_manual = threading.local()


@contextmanager
def _manual_session_restored(outer: Session | None) -> Iterator[None]:
    try:
        yield
    finally:
        _manual.session = outer


@contextmanager
def _models_built() -> Iterator[list[nn.Module]]:
    """The ``PreTrainedModel`` instances this thread builds in the block (their ``post_init`` runs)."""
    built: list[nn.Module] = []
    thread = threading.get_ident()
    original = PreTrainedModel.__dict__["post_init"]

    @functools.wraps(original)
    def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if threading.get_ident() == thread:
            built.append(self)
        return result

    PreTrainedModel.post_init = post_init  # type: ignore[method-assign]
    try:
        yield built
    finally:
        PreTrainedModel.post_init = original  # type: ignore[method-assign]


def plan_of(model: object) -> Plan | None:
    """The plan a model was loaded with, or ``None`` if hfpatch did not load it."""
    plan = getattr(model, PLAN_ATTRIBUTE, None)
    return plan if isinstance(plan, Plan) else None
