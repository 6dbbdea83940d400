"""A head whose weight is a ``DTensor`` outside the forward, gathered whole by FSDP2 inside it.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a DTensor shard between
steps and, in the pre-forward hook of the unit that holds it, all-gathers it into a whole local
tensor that the module uses until that unit's forward (and backward) are done; the gradient of
that whole tensor is reduce-scattered by FSDP2 after the backward.  When the head belongs to the
model's own unit (``fully_shard(model)``, with or without units of its own for the decoder
layers, as accelerate and TRL shard), the installed forward, which runs inside the model's
forward, sees the head whole, and the chunked loss is the single-process one: nothing is gathered
beyond what FSDP2 gathers for vanilla's head matmul.  A head that is a unit of its own
(``fully_shard(model.lm_head)``) is gathered only when the head module itself is called, which the
chunked loss does not do: refused.

A ``DTensor`` head that no FSDP2 unit holds and whose rows are not split as ``vocab_parallel`` reads
them is refused before the probe (``vocab_parallel.claim``); found so at a training step (sharded after
the install), it is read as this layout, and the step falls back to vanilla's with how it is placed.
"""

from __future__ import annotations

from torch import nn

from .rows import DTENSOR, HeadRows, dtensor_weight, fsdp_module_type, is_dtensor, split_refusal

__all__ = ["FSDP2", "after_decoder", "claim", "fsdp_head_unit", "fsdp_units_holding"]


class FSDP2(HeadRows):
    """A ``DTensor`` head, read where FSDP2 has gathered it whole (``HeadRows``)."""

    name = "fsdp2"

    def readable(self, head: nn.Module) -> bool:
        """Whether FSDP2 has gathered the weight whole now."""
        return not is_dtensor(getattr(head, "weight", None))


def claim(model: nn.Module, head: nn.Module) -> FSDP2 | None:
    """``FSDP2`` when the head's weight is a ``DTensor`` an FSDP2 unit holds (``placement``), else ``None``."""
    if not dtensor_weight(head) or not fsdp_units_holding(model, head):
        return None
    return FSDP2(DTENSOR, after_decoder=after_decoder(model, head))


def after_decoder(model: nn.Module, head: nn.Module) -> str:
    """What a refusal says of a ``DTensor`` head still sharded when the decoder has returned, after how it is
    sharded: which FSDP2 unit gathers it, or how it is placed."""
    unit = fsdp_head_unit(model, head)
    if unit is not None:
        return (
            f", and still one when the decoder has returned: the FSDP2 unit {unit!r} gathers it only when "
            "that module is called, which the chunked loss does not do; shard the head with the model "
            "(fully_shard(model), or together with the final norm: "
            f"fully_shard([model.model.norm, model.lm_head])) instead of fully_shard on {unit!r}"
        )
    return (
        ", and still one when the decoder has returned, sharded in a way the vocabulary-parallel loss does "
        f"not read: {split_refusal(model, head)} (it reads a head whose rows are split over a 1-D mesh, "
        "Shard(0), as tensor parallelism's tp_plan='auto' shards it)"
    )


def fsdp_head_unit(model: nn.Module, head: nn.Module) -> str | None:
    """The name of the FSDP2 unit under the model that holds the head (the head's own, or a parent's),
    or ``None`` when there is none."""
    fsdp = fsdp_module_type()
    if fsdp is None:
        return None
    for name, module in model.named_modules():
        if name and isinstance(module, fsdp) and any(sub is head for sub in module.modules()):
            return name
    return None


def fsdp_units_holding(model: nn.Module, head: nn.Module) -> bool:
    """Whether any FSDP2 unit (the model's own included) holds the head: its weight is then a ``DTensor``
    between FSDP2's gathers, never split over the ranks for a step (``vocab_parallel.row_split``)."""
    fsdp = fsdp_module_type()
    return fsdp is not None and any(
        isinstance(module, fsdp) and any(sub is head for sub in module.modules()) for module in model.modules()
    )
