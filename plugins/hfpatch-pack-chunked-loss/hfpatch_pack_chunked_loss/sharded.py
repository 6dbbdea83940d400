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
"""

from __future__ import annotations

from typing import Any, TypeGuard

from torch import nn

__all__ = ["fsdp_head_unit", "is_dtensor", "plain_linear", "sharded_after_decoder"]


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
    return (
        f"{why}, and still one when the decoder has returned (tensor parallelism shards its rows for the whole "
        "step): the chunked loss over vocabulary shards is not written"
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
