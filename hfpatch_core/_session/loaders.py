"""Where hfpatch hooks into transformers, and turning it on and off.

``enable()`` wraps ``PreTrainedModel.from_pretrained`` and ``PreTrainedModel._from_config``
(which the Auto classes and ``from_config`` end in), stands hfpatch's exception-safe
application in for ``transformers.modeling_utils.apply_patches``, and guards
``modeling_utils.patch_output_recorders``.  ``enabled()`` does the same for a block of
the current thread or asyncio task.  The wrappers stay in place while ``enable()`` or any
``enabled()`` block is in force; ``disable()`` drops the process-wide choice and puts all
four back once no block is open.  While they are in place every ``from_pretrained`` /
``from_config`` holds ``scope.LOAD_LOCK``, patched or not, so a vanilla load never builds
while another thread's replacements are installed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedModel, modeling_utils

from .. import _compat
from .._pipeline.selection import Selection
from .._runtime import application, provenance, recorders, steps
from .._runtime.built import replaced_as_built
from .._runtime.frames import Loader, blame, unwind_entered_contexts
from .._runtime.layout import secure
from .._runtime.parallel_plans import add_declared_plans
from .._scope import LOAD_LOCK, in_vanilla_block, vanilla
from ..authoring.randomness import isolated_rng
from ..errors import HfPatchError, PackError
from ..plan import PLAN_ATTRIBUTE, Plan
from ..settings import AUTORUN_MODULE, STRICT_MODEL_ATTRIBUTE, log_level_from_env
from .announcement import announce
from .session import LockChoice, Session, activate, active_session, current_session, live_session, new_session, scoped

logger = logging.getLogger("hfpatch")

#: What the wrappers stand in for, while they are installed (guarded by ``LOAD_LOCK``).
_originals: dict[str, tuple[Any, Any]] = {}
#: ``enabled()`` blocks open, in every thread and task (guarded by ``LOAD_LOCK``).
_open_blocks = 0


def settle_autorun(*, enable: bool) -> None:
    """Finish the enable start-up left pending (``HF_PATCH_PACKS`` set, or ``hfpatch run``), or drop it.

    ``enable``: enable hfpatch now if start-up would at the first load (``enabled()`` blocks
    then nest inside that choice, and ``is_enabled()`` tells the truth before any load);
    otherwise forget it: the program chose for itself (``enable()``, ``disable()``).
    """
    settle = getattr(sys.modules.get(AUTORUN_MODULE), "settle", None)  # an older hfpatch-core's hook has none
    if settle is not None:
        settle(enable=enable)


def _unless_stand_in(name: str, value: Any) -> Any:
    """Transformers' own loader where ``value`` is the start-up hook's stand-in for it."""
    original_of = getattr(sys.modules.get(AUTORUN_MODULE), "original_of", None)
    return value if original_of is None else original_of(name, value)


def configure_logging() -> None:
    """Apply ``HF_PATCH_LOG``: the ``hfpatch`` logger's level, and a stderr handler when
    neither it nor an ancestor has one (a program that configured logging keeps its own).

    Raises:
        ValueError: ``HF_PATCH_LOG`` is not a level name.
    """
    level = log_level_from_env()
    if level is None:
        return
    logger.setLevel(level)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))  # every hfpatch message starts "hfpatch: "
        logger.addHandler(handler)


def attach(model: object, plan: Plan) -> None:
    """Record ``plan`` on ``model`` (``plan_of``) and log its summary."""
    if isinstance(model, nn.Module):
        object.__setattr__(model, PLAN_ATTRIBUTE, plan)
    if logger.isEnabledFor(logging.INFO):  # the summary hashes the plan: only when someone reads it
        logger.info(plan.summary())


def _managed(cls: type, load: Callable[[], Any], code: types.CodeType, *, loading_info: bool = False) -> Any:
    """Run transformers' loader ``load`` for ``cls`` with the session's plan registered.

    The plan is made when the loader enters ``apply_patches`` (see
    ``Session.applied``); ``code`` is the loader function's code, whose frame holds
    the config.  ``loading_info``: ``load`` returns ``(model, info)`` (``from_pretrained``
    asked for ``output_loading_info``), used to check that every weight a pack touches
    was loaded.
    """
    session = live_session()
    if session is None:
        with LOAD_LOCK:  # a vanilla load: not while another thread's replacements are installed
            return load()
    with session.applied(None, loader=Loader(cls, code)) as frame, recorders.RecorderLog() as log:
        try:
            result = load()
        except HfPatchError:
            raise
        except Exception as exc:
            plan = frame.final_plan()
            blamed = blame(exc, plan) if plan is not None else None
            if blamed is None:
                raise
            raise blamed from exc
        plan = frame.final_plan()
        model, info = result if loading_info else (result, None)
        if plan is None:
            # the loader never entered apply_patches (a custom from_pretrained): nothing was applied
            logger.warning("hfpatch: %s was built without transformers' apply_patches; no pack applied", cls.__name__)
            return result
        if isinstance(model, nn.Module):
            plan = replaced_as_built(plan, model)
        # sub-models are checked with the model holding them
        if isinstance(model, nn.Module) and session.in_root_load():
            secure(model, plan, info, strict=session.strict)
            if session.strict:  # what the model does after the load (a calibration, a model step) is strict too
                object.__setattr__(model, STRICT_MODEL_ATTRIBUTE, True)
        log.restore(model if isinstance(model, nn.Module) else None)
        # a step changes the model the user gets, whole and with its weights: a root load's
        if isinstance(model, nn.Module) and session.in_root_load() and not steps.is_deferred():
            plan = steps.install_steps(model, plan, session.report)
    attach(model, plan)
    if all(outer.loader is None for outer in session.frames()):  # a root load (its frame is gone)
        _compare_provenance(model, plan)
        announce(plan)
    return result


def _compare_provenance(model: object, plan: Plan) -> None:
    """Log how this load's packs differ from those a checkpoint saved from a patched model records."""
    source = getattr(getattr(model, "config", None), "_name_or_path", None)
    recorded = provenance.read(source) if isinstance(source, str) and source else None
    if recorded is None:
        return
    differences = provenance.differences(recorded, plan)
    if differences:
        logger.warning(
            "hfpatch: %s was saved from a model patched otherwise (%s): %s",
            source,
            provenance.FILE_NAME,
            "; ".join(differences),
        )


def _apply_patches(mapping: Mapping[str, type] | None = None) -> AbstractContextManager[None]:
    """hfpatch's ``modeling_utils.apply_patches``.

    Without ``mapping``: plan a pending load with its loader's config, then apply the
    registry.  transformers 5.25 calls it a second time with the patches of the load's
    ``fusion_config``, in the same init contexts, before entering either: the mapping is
    recorded on the pending load, which is planned with it as a direct registration
    (``Frame.fusion``), and applied inside the registry's block minus the targets a
    pack's claim won (the claim set ``overwrite=True``).
    """
    if mapping is None:
        return _apply_registry()
    session = live_session()
    if session is not None:
        session.expect_fusion(mapping)
    return _apply_fusion(mapping)


@contextmanager
def _apply_registry() -> Iterator[None]:
    with contextlib.ExitStack() as applied:
        try:
            session = live_session()
            if session is not None:
                session.resolve_pending()
            applied.enter_context(application.apply_registered_patches())
        except BaseException:
            unwind_entered_contexts()  # raising from __enter__: transformers' other contexts stay entered otherwise
            raise
        yield


@contextmanager
def _apply_fusion(mapping: Mapping[str, type]) -> Iterator[None]:
    session = live_session()
    plan = session.current_plan() if session is not None else None
    won = plan.mapping if plan is not None else {}
    with application.apply_mapping({key: value for key, value in mapping.items() if key not in won}):
        yield


def _wrap_from_pretrained(original: classmethod) -> classmethod:
    function = original.__func__

    @functools.wraps(function)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        if live_session() is None:
            with LOAD_LOCK:  # a vanilla load: not while another thread's replacements are installed
                loaded = function(cls, *args, **kwargs)
            if current_session() is not None and not in_vanilla_block():  # enabled, selecting no pack
                _compare_provenance(loaded[0] if kwargs.get("output_loading_info") else loaded, Plan(context=None))
            return loaded
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
        session = live_session()
        if session is not None and not session.frames() and _in_a_model_constructor(sys._getframe(1)):
            # transformers' generic heads (``LlamaForQuestionAnswering``, ``...ForSequenceClassification``)
            # build their base with ``AutoModel.from_config`` in ``__init__``: inside a model built by its
            # constructor, which hfpatch does not patch (no loader, so no plan, no save guard), a patched
            # base would be saved in the packs' layout unchecked, a checkpoint no load reads back.  The
            # base is built as the head is: vanilla.  Inside a load (``from_pretrained``, ``from_config``
            # of the head) it is a nested load, patched with the head.
            with vanilla():
                return function(cls, config, **kwargs)
        build = functools.partial(function, cls, config, **kwargs)
        if session is not None and not session.frames() and _initialises():
            return _initialised_as_vanilla(cls, build, function.__code__, session)
        return _managed(cls, build, function.__code__)

    return classmethod(_from_config)


def _initialises() -> bool:
    """Whether a ``from_config`` here gives its model initial values (not on the meta device,
    where nothing is initialised; not partitioned by DeepSpeed ZeRO-3, whose own initialisation
    runs after the build, on the partitions)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return torch.get_default_device().type != "meta" and not is_deepspeed_zero3_enabled()


def _initialised_as_vanilla(cls: type, build: Callable[[], Any], code: types.CodeType, session: Session) -> Any:
    """A root ``from_config`` load with packs, starting where vanilla's starts.

    Vanilla transformers builds and initialises the model first (it draws from the global
    generators exactly what a ``from_config`` without hfpatch draws); its weights are taken in
    the original layout (``original_state_dict``: what its checkpoint would hold).  Then the
    load runs as any other (``_managed``: the packs' hooks once, with the config the model is
    built with, the plan, the guards, the steps), its model built without initial values
    (``no_init_weights``) and given vanilla's weights through the packs' converters, as a
    checkpoint load maps them (``load_original_layout``).  Everything after vanilla's build runs
    under ``isolated_rng``: the random streams are left where vanilla's ``from_config`` leaves
    them.  A model the packs' converters cannot fill keeps an initialisation of its own, with a
    ``PackWarning`` saying so (``_initial_weights``).  Costs a second model in memory while
    the weights are copied.
    """
    from .._runtime.state_dicts import original_state_dict

    with LOAD_LOCK:
        with vanilla():
            reference = build()
        if not isinstance(reference, PreTrainedModel):
            return reference  # pragma: no cover - a from_config returns a model
        weights = {key: value.detach() for key, value in original_state_dict(reference).items()}
        buffers = dict(reference.named_buffers())
        with isolated_rng(None):
            return _managed(cls, lambda: _initial_weights(cls, build, weights, buffers, session), code)


def _initial_weights(
    cls: type,
    build: Callable[[], Any],
    weights: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    session: Session,
) -> Any:
    """The patched model built without initial values, given ``weights`` (vanilla's, original
    layout) through the load's conversions, and vanilla's non-persistent ``buffers``."""
    from .._runtime.state_dicts import load_original_layout

    uninitialised = _compat.no_init_weights()
    with uninitialised if uninitialised is not None else contextlib.nullcontext():
        model = build()
    if uninitialised is None or not isinstance(model, PreTrainedModel):
        return model
    model.tie_weights()  # what init_weights, skipped, would have done
    try:
        with torch.no_grad():
            load_original_layout(model, weights, strict=True)
            for name, buffer in model.named_buffers():
                found = buffers.get(name)
                if found is not None and found.shape == buffer.shape and found is not buffer:
                    buffer.copy_(found)
    except (RuntimeError, HfPatchError) as exc:
        plan = session.current_plan()
        packs = sorted({claim.pack for claim in plan.entries}) if plan is not None else []
        session.report(
            [
                PackError(
                    ", ".join(packs) or "?",
                    f"{cls.__name__}.from_config: the packs' layout cannot take vanilla's initial weights "
                    f"({type(exc).__name__}: {exc}); the model is initialised by its own classes instead, so its "
                    "initial weights differ from vanilla's for the same seed",
                    stage="load",
                )
            ]
        )
        model.init_weights()
    return model


def _in_a_model_constructor(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` or a caller of it is the ``__init__`` of a transformers model being built."""
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), PreTrainedModel):
            return True
        frame = frame.f_back
    return False


def _composing(patch_output_recorders: Callable[[Any], None]) -> Callable[[Any], None]:
    """``patch_output_recorders``, which transformers calls on a model just built (before it
    distributes it), preceded by adding the replacements' declared plans to the model's
    (``sharding``) in a load sharded by transformers."""

    def composing(model: Any) -> None:
        session = live_session()
        plan = session.current_plan() if session is not None else None
        if plan is not None and plan.context is not None and plan.context.parallel:
            assert session is not None  # a plan comes from a session
            frames = session.frames()
            loader = frames[-1].loader if frames else None
            add_declared_plans(model, plan.context.parallel, expert_mesh=loader.expert_mesh if loader else None)
        patch_output_recorders(model)

    composing.__doc__ = patch_output_recorders.__doc__
    return composing


def _hooked() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """Where hfpatch hooks into transformers: (owner, attribute, wrapper of the original)."""
    return [
        (PreTrainedModel, "from_pretrained", _wrap_from_pretrained),
        (PreTrainedModel, "_from_config", _wrap_from_config),
        (modeling_utils, "apply_patches", lambda _original: _apply_patches),
        (modeling_utils, "patch_output_recorders", lambda original: _composing(recorders.guarded(original))),
    ]


def _hook() -> None:
    """Put the wrappers into transformers, unless they are there (``LOAD_LOCK`` held)."""
    if not _originals:
        for owner, name, wrap in _hooked():
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            original = _unless_stand_in(name, original)
            _originals[name] = (owner, original)
            setattr(owner, name, wrap(original))


def _unhook_if_unused() -> None:
    """Put transformers' functions back once neither ``enable()`` nor an ``enabled()`` block is in force."""
    if _open_blocks or active_session() is not None:
        return
    for name, (owner, original) in list(_originals.items()):
        setattr(owner, name, original)
        del _originals[name]


def install(session: Session) -> None:
    """Make ``session`` the process-wide one, hooking into transformers if not already.

    Waits for a load running in another thread to finish (``LOAD_LOCK``).
    """
    with LOAD_LOCK:
        _hook()
        activate(session)


def enable(packs: str | Iterable[str] | None = None, strict: bool | None = None, lock: LockChoice = None) -> Selection:
    """Turn hfpatch on for this process.

    From now on every ``from_pretrained`` / ``from_config`` (Auto classes included)
    gathers the enabled packs for the model it builds, resolves their claims and
    applies the winners for that load only.  Calling it again replaces the choice.
    It is the default: inside an ``enabled()`` block, that block's choice applies.

    Args:
        packs: which packs run, in ``HF_PATCH_PACKS`` syntax (a string or a list of
            items, e.g. ``["all", "-experimental", "fast@+10"]``); ``None`` reads
            ``HF_PATCH_PACKS``.
        strict: make every pack failure an error; ``None`` reads ``HF_PATCH_STRICT``.
        lock: a lock file ``hfpatch lock`` wrote: every load checks its packs and plan
            against it before reading a weight (``LockError``), and ``packs=None`` with
            ``HF_PATCH_PACKS`` unset selects no pack; ``None`` reads ``HF_PATCH_LOCK``,
            ``False`` locks nothing.

    Returns:
        The selection: which packs run, and why each other installed pack does not.

    Raises:
        SelectionError: the choice is malformed or names a pack that is not installed.
        PackError: strict mode, and a selected pack is incompatible or ambiguous.
        LockError: the lock file cannot be read or is not a lock.
        ValueError: ``HF_PATCH_STRICT``, ``HF_PATCH_AUTOLOAD`` or ``HF_PATCH_LOG`` holds no valid value.
    """
    session = new_session(packs, strict, lock)
    configure_logging()
    session.report(session.selection.problems)
    install(session)
    settle_autorun(enable=False)  # this call is the choice (after install: no load between finds transformers' own)
    return session.selection


@contextmanager
def enabled(
    packs: str | Iterable[str] | None = None, strict: bool | None = None, lock: LockChoice = None
) -> Iterator[Selection]:
    """Turn hfpatch on, with these packs, for the loads of the current thread or asyncio task in the block.

    ``with hfpatch_core.enabled(packs="fused-mlp") as selection: model = ...from_pretrained(...)``.
    Inside the block, loads on this thread or task (and in the copies of its context that
    ``asyncio.to_thread`` and new tasks get) use this choice; other threads keep theirs,
    and ``enable()``'s process-wide choice applies again after the block.  Blocks nest:
    the innermost wins, and leaving it restores the one around it.  ``packs="none"``
    makes the block's loads vanilla even where ``enable()`` selected packs.  Loads of all
    threads still run one at a time (``scope.LOAD_LOCK``); the block decides which packs
    each one gets.

    Args:
        packs: which packs run, in ``HF_PATCH_PACKS`` syntax; ``None`` reads ``HF_PATCH_PACKS``.
        strict: make every pack failure an error; ``None`` reads ``HF_PATCH_STRICT``.
        lock: a lock file, as ``enable``'s; ``None`` reads ``HF_PATCH_LOCK``, ``False`` locks nothing.

    Yields:
        The selection: which packs run in the block, and why each other installed pack does not.

    Raises:
        SelectionError: the choice is malformed or names a pack that is not installed.
        PackError: strict mode, and a selected pack is incompatible or ambiguous.
        LockError: the lock file cannot be read or is not a lock.
        ValueError: ``HF_PATCH_STRICT``, ``HF_PATCH_AUTOLOAD`` or ``HF_PATCH_LOG`` holds no valid value.
    """
    global _open_blocks
    settle_autorun(enable=True)  # the block nests in the process-wide choice start-up made
    session = new_session(packs, strict, lock)
    configure_logging()
    session.report(session.selection.problems)
    with LOAD_LOCK:
        _hook()
        _open_blocks += 1
    try:
        with scoped(session):
            yield session.selection
    finally:
        with LOAD_LOCK:
            _open_blocks -= 1
            _unhook_if_unused()


def disable() -> None:
    """Drop ``enable()``'s process-wide choice: loads outside ``enabled()`` blocks behave as in
    plain transformers again (and, once no block is open, transformers' functions are back)."""
    settle_autorun(enable=False)
    with LOAD_LOCK:
        activate(None)
        _unhook_if_unused()


def is_enabled() -> bool:
    """Whether loads here go through hfpatch: ``enable()`` is in force, or an ``enabled()`` block
    is open on this thread or task."""
    settle_autorun(enable=True)
    return current_session() is not None
