"""Installing the chunked loss on a loaded causal LM, and taking it off.

``install`` decides once where the head's rows live (``placement.locate``), probes the model there
(``probe.find``) and puts the installed forward (``forward.ChunkedForward``) on the instance.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from .budget import BUDGET_ENV, DEFAULT_BUDGET, LOGIT_COPIES, budget_from_env, chunk_for
from .errors import ChunkedLossRefused
from .forward import FUSED_FLAG, STATE, ChunkedForward, Watch, described
from .found import Installed, LossKind
from .placement import locate
from .probe import detect, find

__all__ = [
    "BUDGET_ENV",
    "DEFAULT_BUDGET",
    "LOGIT_COPIES",
    "ChunkedLossRefused",
    "Installed",
    "LossKind",
    "budget_from_env",
    "chunk_for",
    "detect",
    "install",
    "installed",
    "loss_computed_by",
    "uninstall",
]

logger = logging.getLogger("hfpatch")


def install(model: PreTrainedModel, *, chunk: int | None = None, budget: int | None = None) -> Installed:
    """Make the model's training steps compute the loss in chunks of tokens.

    Called once per model, after it is loaded (and before ``peft.get_peft_model`` or a Trainer
    wraps it, or after: both call the model's own forward).  Afterwards a forward with ``labels``,
    in training mode and with autograd on, returns vanilla's loss (within rounding; with the MoE
    auxiliary loss the family adds) computed without the tokens x vocabulary logits, and ``.logits``
    holds the logits of the last position only (``(batch, 1, vocabulary)``, as ``logits_to_keep=1``
    gives).  Every other forward (no labels, ``eval()``, ``no_grad``, generation, a
    ``logits_to_keep`` of the caller's) is vanilla's.  The model deep-copies, pickles and is freed
    as any model.

    Args:
        model: a loaded ``*ForCausalLM``.
        chunk: tokens per chunk, whatever the vocabulary; give it or ``budget``, not both.
        budget: bytes of chunk x vocabulary logits a step holds at most (``chunk_for``).  Neither
            given: ``HF_PATCH_CHUNKED_LOSS_BUDGET`` (``budget_from_env``), else 256 MiB.

    Returns:
        What was found and installed.

    Raises:
        ChunkedLossRefused: the model's head or loss path is not one this reproduces (``detect``).
        ValueError: ``chunk`` or ``budget`` is not positive, both are given, the budget variable is
            not a number of bytes, or the model already has it.
    """
    if chunk is not None and budget is not None:
        raise ValueError(f"give install a chunk ({chunk} tokens) or a budget ({budget} bytes), not both")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be positive, not {chunk}")
    if budget is not None and budget < 1:
        raise ValueError(f"budget must be a positive number of bytes, not {budget}")
    if chunk is None and budget is None:
        budget = budget_from_env()
    if installed(model) is not None:
        raise ValueError(f"{type(model).__name__} already has the chunked loss")
    # where the head's rows live, decided once here: the probe runs, and compares, as they live
    rows = locate(model, model.get_output_embeddings())
    with rows.probing(model, model.get_output_embeddings()):
        found = find(model, rows)
    result = Installed(found.transform, chunk, budget, found.aux_loss_coefficient, found.loss)
    original = model.__dict__.get("forward")
    forward = ChunkedForward(
        model, found.decoder, result, original, at_head=found.at_head, linear_subclass=found.linear_subclass
    )
    forward.watch = Watch(forward)
    forward.handles = [found.decoder.register_forward_hook(forward.watch.after)]
    model.__dict__["forward"] = forward
    model.__dict__[STATE] = forward
    _say_who_computes(model, original)
    return result


def _say_who_computes(model: nn.Module, original: Any) -> None:
    # the load's log: who will compute a training step's loss.  A trainer may wrap the forward after the load
    # (TRL's add_fused_lm_head, in every TRL 1.16 trainer) and answer its own loss calls: a PackWarning then
    # names it at its first such step (forward.Watch)
    wrapped = (
        f" It wraps {described(original)}, set on the model before the install: a call that wrapper answers "
        f"itself ({FUSED_FLAG}=True) is the wrapper's step."
        if original is not None
        else ""
    )
    logger.info(
        "hfpatch: chunked-loss on %s: the loss of a training step that calls the model's forward with labels is "
        "computed by chunked-loss (Trainer, PEFT, a loop of yours); a wrapper set on model.forward afterwards that "
        "computes its own (TRL's add_fused_lm_head: SFTTrainer, GRPOTrainer and TRL's other trainers, with "
        "%s=True) computes those steps instead, and a PackWarning says so at the first.%s",
        type(model).__name__,
        FUSED_FLAG,
        wrapped,
    )


def installed(model: nn.Module) -> Installed | None:
    """What ``install`` put on ``model``, or ``None``.  Called by anyone who wants to know."""
    state = model.__dict__.get(STATE)
    return state.installed if isinstance(state, ChunkedForward) and not state.disabled else None


def uninstall(model: nn.Module) -> None:
    """Give the model vanilla's forward back.  Called after ``install``; does nothing otherwise.

    A wrapper set on ``model.forward`` after the install (TRL's fused head) keeps calling what it
    wrapped, which from now on is the model's own forward.
    """
    state: Any = model.__dict__.pop(STATE, None)
    if not isinstance(state, ChunkedForward):
        return
    state.disabled = True
    for handle in state.handles:
        handle.remove()
    original = state.original
    if model.__dict__.get("forward") is state:
        if original is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = original


def loss_computed_by(model: nn.Module) -> str | None:
    """Who computes a training step's loss on ``model``: ``"chunked-loss"``, the wrapper set on
    ``model.forward`` after the install (described by where its code is, e.g. TRL's
    ``trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward``), or ``None`` without the pack.

    A wrapper decides at each call: TRL's computes its own loss when called with ``fused_lm_head=True``
    (every TRL 1.16 trainer's loss call) and otherwise calls the pack's forward, which then computes it; a
    ``PackWarning`` names the wrapper at its first step, the ``hfpatch`` log the pack's per caller.  Installed
    over such a wrapper (after the trainer wrapped the model), this says ``"chunked-loss"``, and the pack's
    forward hands a ``fused_lm_head=True`` call to the wrapper untouched (a ``PackWarning`` says so too).
    """
    state = model.__dict__.get(STATE)
    if not isinstance(state, ChunkedForward) or state.disabled:
        return None
    wrapper = model.__dict__.get("forward")
    return "chunked-loss" if wrapper is state else described(wrapper)
