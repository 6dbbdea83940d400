"""Where hfpatch hooks into transformers, and turning it on and off.

``enable()`` wraps ``PreTrainedModel.from_pretrained`` and ``PreTrainedModel._from_config``
(which the Auto classes and ``from_config`` end in), stands hfpatch's exception-safe
application in for ``transformers.modeling_utils.apply_patches``, and guards
``modeling_utils.patch_output_recorders``.  ``disable()`` puts all four back.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch.nn as nn
from transformers import PreTrainedModel, modeling_utils

from . import application, recorders
from .errors import HfPatchError
from .frames import Loader, blame
from .layout import secure
from .plan import PLAN_ATTRIBUTE, Plan
from .selection import Selection
from .session import Session, activate, active_session, live_session, new_session

logger = logging.getLogger("hfpatch")

_state_lock = threading.Lock()
_originals: dict[str, tuple[Any, Any]] = {}


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
        # sub-models are checked with the model holding them
        if isinstance(model, nn.Module) and session.in_root_load():
            secure(model, plan, info)
        log.restore(model if isinstance(model, nn.Module) else None)
    attach(model, plan)
    return result


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
    session = live_session()
    if session is not None:
        session.resolve_pending()
    with application.apply_registered_patches():
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


def _hooked() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """Where hfpatch hooks into transformers: (owner, attribute, wrapper of the original)."""
    return [
        (PreTrainedModel, "from_pretrained", _wrap_from_pretrained),
        (PreTrainedModel, "_from_config", _wrap_from_config),
        (modeling_utils, "apply_patches", lambda _original: _apply_patches),
        (modeling_utils, "patch_output_recorders", recorders.guarded),
    ]


def install(session: Session) -> None:
    """Make ``session`` the active one, hooking into transformers if not already."""
    with _state_lock:
        if not _originals:
            for owner, name, wrap in _hooked():
                original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
                _originals[name] = (owner, original)
                setattr(owner, name, wrap(original))
        activate(session)


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
    session.report(session.selection.problems)
    install(session)
    return session.selection


def disable() -> None:
    """Turn hfpatch off: loads behave as in plain transformers again."""
    with _state_lock:
        activate(None)
        for name, (owner, original) in list(_originals.items()):
            setattr(owner, name, original)
            del _originals[name]


def is_enabled() -> bool:
    """Whether ``enable()`` is in force."""
    return active_session() is not None
