"""The pack's hooks: the chunked loss as a model step, selected by ``HF_PATCH_PACKS=chunked-loss``.

A load with the pack enabled installs it on the model it returns (``install``), after the weights
are loaded; ``detect``'s refusals become the step's ``Refusal`` (on the model's plan, in
``hfpatch verify`` and the zoo); ``hfpatch_core.revert(model)`` uninstalls it.
"""

from __future__ import annotations

import inspect
import logging

from torch import nn

import hfpatch_core
from hfpatch_core import LoadContext, ModelStep, Refusal

from .budget import budget_from_env
from .errors import ChunkedLossRefused
from .install import install, uninstall

logger = logging.getLogger("hfpatch")

#: What the step changes on the model: another pack's step for the same target competes with it.
TARGET = "causal-lm-loss"

#: Where ``hfpatch check`` and ``verify`` check the pack by default: the plain head, a soft-cap,
#: a scale (the pack decides from the loaded model, so asked with ``config=None`` it offers nothing).
SAMPLE_MODEL_TYPES = ("llama", "gemma2", "granite")


def install_step(model: nn.Module) -> Refusal | None:
    """``ModelStep.install``: the chunked loss on ``model``, or the refusal ``detect`` gives."""
    # a budget that is not a number is the user's error, raised (a pack failure), not a refusal
    budget = budget_from_env()
    try:
        install(model, budget=budget)  # type: ignore[arg-type]
    except ChunkedLossRefused as exc:
        return _refused(type(model).__name__, str(exc))
    except Exception as exc:  # the probe runs the model's own forward: one this cannot run is not claimed
        # install changes nothing before detect has passed, so the model is as it was
        return _refused(type(model).__name__, f"probing the model's forward raised {type(exc).__name__}: {exc}")
    return None


def _refused(model: str, reason: str) -> Refusal:
    # the pack was selected: a user who asked for it learns that this model's steps hold vanilla's logits
    # (the plan records the refusal too, logged at info level only)
    logger.warning(
        "hfpatch: chunked-loss refused %s: %s; its training steps compute vanilla's full logits", model, reason
    )
    return Refusal(TARGET, reason)


def uninstall_step(model: nn.Module) -> None:
    """``ModelStep.uninstall``: vanilla's forward back."""
    uninstall(model)


def _has_a_loss_path(model_class: type | None) -> bool:
    # a head class whose forward takes labels and logits_to_keep computes a causal LM's loss from
    # logits; any other model has no loss this replaces (and is not probed at each load)
    forward = getattr(model_class, "forward", None)
    if forward is None:
        return False
    parameters = inspect.signature(forward).parameters
    return "labels" in parameters and "logits_to_keep" in parameters


@hfpatch_core.hookimpl
def provide_model_types() -> list[str]:
    """``SAMPLE_MODEL_TYPES``."""
    return list(SAMPLE_MODEL_TYPES)


@hfpatch_core.hookimpl
def provide_model_steps(context: LoadContext) -> list[ModelStep | Refusal]:
    """The chunked loss for a load of a class with a causal-LM loss path.

    Under transformers' FSDP2 load (``DistributedConfig(fsdp_size=...)``) or tensor-parallel load
    (``tp_plan="auto"``), one of them alone, it is installed and its probe decides, on every rank alike:
    FSDP2 gathers the head whole in the forward (transformers shards it with the final norm, kept whole
    after the forward), and the chunked loss is the single-process one; tensor parallelism splits the
    head's rows over the ranks for the whole step, and the loss is computed over them
    (``vocab_parallel``).  Refused where transformers shards the model otherwise (pipeline or expert
    parallelism, or tensor parallelism with another: not checked against vanilla)."""
    if context.config is None or not _has_a_loss_path(context.model_class):
        return []
    if context.parallel and (len(context.parallel) > 1 or context.parallel[0] not in _INSTALLED_SHARDED):
        reason = (
            f"the load is sharded by transformers ({', '.join(context.parallel)}): the chunked loss runs under "
            "FSDP2 or tensor parallelism alone (tp_plan='auto'), whose heads it is checked on; the vanilla loss runs"
        )
        return [_refused(context.model_class_name, reason)]
    return [ModelStep(TARGET, install_step, uninstall_step)]


# transformers' parallelisms the install's probe decides on: FSDP2 gathers the head whole in the forward,
# tensor parallelism splits its rows for the whole step (the vocabulary-parallel loss)
_INSTALLED_SHARDED = frozenset({"fsdp", "tp"})
