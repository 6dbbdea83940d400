"""Heads whose weight is sharded outside the forward: which of them the chunked loss runs on.

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

Tensor parallelism (transformers' ``tp_plan="auto"``) splits the head's rows over the ranks for the
whole step: ``vocab_parallel`` computes the loss over those rows.  A head sharded any other way
when the decoder has returned is refused, with how it is placed.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from torch import nn

__all__ = [
    "fsdp_head_unit",
    "fsdp_units_holding",
    "is_dtensor",
    "plain_linear",
    "sharded_after_decoder",
    "tensor_parallel_refusal",
]


def _fsdp_module_type() -> type[Any] | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    return FSDPModule


def plain_linear(module: Any) -> TypeGuard[nn.Linear]:
    """Whether ``module`` is a plain ``nn.Linear``, or one that ``fully_shard`` made an FSDP2 unit of (its
    class then ``FSDPLinear(FSDPModule, nn.Linear)``, which adds hooks and no computation)."""
    kind = type(module)
    if kind is nn.Linear:
        return True
    fsdp = _fsdp_module_type()
    return fsdp is not None and kind.__bases__ == (fsdp, nn.Linear)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (a shard, outside FSDP2's gathers)."""
    return type(tensor).__name__ == "DTensor"


def sharded_after_decoder(model: nn.Module, head: nn.Module, why: str) -> str:
    """The refusal of a head whose weight is still a DTensor when the decoder has returned."""
    unit = fsdp_head_unit(model, head)
    if unit is not None:
        return (
            f"{why}, and still one when the decoder has returned: the FSDP2 unit {unit!r} gathers it only when "
            "that module is called, which the chunked loss does not do; shard the head with the model "
            f"(fully_shard(model), or together with the final norm: fully_shard([model.model.norm, model.lm_head])) "
            f"instead of fully_shard on {unit!r}"
        )
    from .vocab_parallel import split_refusal

    return (
        f"{why}, and still one when the decoder has returned, sharded in a way the vocabulary-parallel loss does "
        f"not read: {split_refusal(model, head)} (it reads a head whose rows are split over a 1-D mesh, "
        "Shard(0), as tensor parallelism's tp_plan='auto' shards it)"
    )


def fsdp_head_unit(model: nn.Module, head: nn.Module) -> str | None:
    """The name of the FSDP2 unit under the model that holds the head (the head's own, or a parent's),
    or ``None`` when there is none."""
    fsdp = _fsdp_module_type()
    if fsdp is None:
        return None
    for name, module in model.named_modules():
        if name and isinstance(module, fsdp) and any(sub is head for sub in module.modules()):
            return name
    return None


def fsdp_units_holding(model: nn.Module, head: nn.Module) -> bool:
    """Whether any FSDP2 unit (the model's own included) holds the head: its weight is then a ``DTensor``
    between FSDP2's gathers, never split over the ranks for a step (``vocab_parallel.row_split``)."""
    fsdp = _fsdp_module_type()
    return fsdp is not None and any(
        isinstance(module, fsdp) and any(sub is head for sub in module.modules()) for module in model.modules()
    )


def tensor_parallel_refusal(model: nn.Module, head: nn.Module, why: str) -> str | None:
    """Why a head sharded outside FSDP2 (tensor parallelism, or a ``DTensor`` set by hand) is refused before
    the probe runs the model, or ``None``: its weight is not a ``DTensor``, FSDP2 holds it, or its rows are
    split as the vocabulary-parallel loss reads them (``vocab_parallel.row_split``)."""
    from .vocab_parallel import row_split, split_refusal

    if not is_dtensor(head.weight) or fsdp_units_holding(model, head) or row_split(model, head) is not None:
        return None
    return (
        f"{why}, outside any FSDP2 unit (so sharded for the whole step, as tensor parallelism shards it), and "
        f"{split_refusal(model, head)}: the vocabulary-parallel loss reads a head whose rows are split over a "
        "1-D mesh of ranks (Shard(0)), as tp_plan='auto' shards it"
    )
