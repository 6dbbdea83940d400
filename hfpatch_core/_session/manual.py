"""``patched()``: the packs applied to models built by hand inside a block.

``with patched(config): model = LlamaForCausalLM(config)`` plans as a load of that
config would, keeps the replacements in place for the block (lock held), and gives
each model built in it what a ``from_config`` load gives: its plan, the conversions
its save must reverse, and the save guard.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn
from transformers import AutoConfig, PreTrainedModel, monkey_patching

from .._pipeline.model_types import ModelNotFoundError, unknown_model_type
from .._pipeline.planning import context_for
from .._runtime import recorders
from .._runtime.application import apply_mapping
from .._runtime.layout import secure
from ..plan import Plan, plan_of
from .announcement import announce
from .loaders import attach
from .session import Session, current_session, new_session

#: The session of the innermost ``patched()`` block on this thread made without ``enable()``.
_manual = threading.local()


@contextmanager
def patched(config_or_model_type: Any, *, model_class: type | None = None) -> Iterator[Plan]:
    """Apply the enabled packs to models built by hand inside the block.

    ``with patched(config) as plan: model = LlamaForCausalLM(config)``.  The packs see
    the same context a load of that config would give them; the same lock is held and
    the same restore runs on exit.  Uses the packs of the innermost ``enabled()`` block
    on this thread or task, else those ``enable()`` chose, else (hfpatch not enabled)
    those ``HF_PATCH_PACKS`` selects.

    Args:
        config_or_model_type: a config, or a ``model_type`` string (planned with that type's
            default config, ``AutoConfig.for_model(model_type)``: packs decide from a config, as
            they do for the models built in the block).
        model_class: the class about to be built, when the config does not name it
            (otherwise the config's architecture, else the model type's causal LM,
            else its base model).

    Each model built in the block (and not loaded by ``from_pretrained`` /
    ``from_config``, which do this themselves) gets the plan (``plan_of``), and, when
    the packs convert weights, saves through the reversed conversions with the layout
    check, as a model loaded from a config does.

    Yields:
        The plan in force inside the block.

    Raises:
        ModelNotFoundError: ``config_or_model_type`` is a string that names no model type of the
            installed transformers (a ``ValueError``).
    """
    if isinstance(config_or_model_type, str):
        # without a config the packs that read one (most do) would claim nothing in the block, while the
        # models built in it have one, and a nested from_config inside them (a generic head's base) is planned with it
        problem = unknown_model_type(config_or_model_type)
        if problem is not None:
            raise ModelNotFoundError(f"patched(): {problem}; pass a model type or a config")
        config_or_model_type = AutoConfig.for_model(config_or_model_type)
    context, class_names = context_for(config_or_model_type, model_class, load_module=True)
    # a nested patched() without enable() shares the outer block's session, so that the
    # outer block's registrations count as hfpatch's own (overridable), not the user's
    outer_session: Session | None = getattr(_manual, "session", None)
    session = current_session() or outer_session or new_session()
    _manual.session = session  # from here on, the with statement below puts the outer one back
    with (
        _manual_session_restored(outer_session),
        session.applied(context, class_names) as frame,
        recorders.RecorderLog(),
        apply_mapping(monkey_patching.get_patch_mapping()),
        _models_built() as built,
    ):
        assert frame.plan is not None  # a context was given: planned on entry
        yield frame.plan
        # with the plans of the sub-models built inside (a composite model's text model), as a load attaches
        plan = frame.final_plan() or frame.plan
        inner = {id(module) for model in built for module in list(model.modules())[1:]}
        for model in built:
            if id(model) in inner or plan_of(model) is not None:
                continue  # a sub-model, or loaded by a managed loader inside the block
            secure(model, plan, None)
            attach(model, plan)
            announce(plan)


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
