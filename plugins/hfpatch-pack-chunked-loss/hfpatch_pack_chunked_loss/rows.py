"""Where the LM head's rows live: the one interface the probe, the installed forward and the log-probabilities
read a head through (``HeadRows``), and what it is decided from (is a tensor a ``DTensor``, how is it placed).

Four layouts implement it, one module each: ``whole.py`` (one process, or a head whole on every rank),
``fsdp2.py`` (a ``DTensor`` that FSDP2 gathers whole in the forward), ``vocab_parallel.py`` (rows split over
the ranks for the whole step: tensor parallelism) and ``zero3.py`` (partitioned by DeepSpeed ZeRO-3).
``placement.py`` decides which, once at ``install`` (for the probe) and once per training step (a model
can be sharded after the install: ``fully_shard``, ``deepspeed.initialize``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar, TypeGuard

from torch import nn

from .loss import WholeRows

__all__ = [
    "DTENSOR",
    "HeadRows",
    "dtensor_weight",
    "fsdp_module_type",
    "is_dtensor",
    "placements",
    "plain_linear",
    "rows_placed",
    "split_refusal",
]


#: How a ``DTensor`` head is described in a refusal.
DTENSOR = "the LM head's weight is a DTensor (FSDP2 or tensor parallelism)"


class HeadRows:
    """Where the head's rows live, and how each reader reads them there.

    Attributes:
        name: the layout's name (``"whole"``, ``"fsdp2"``, ``"tensor-parallel rows"``, ``"zero3"``).
        sharded: why the head's weight is not a whole local tensor now (a ``DTensor``: FSDP2 or tensor
            parallelism), or ``None``; the probe then reads a copy of the weight the forward used.
        refusal: why the probe refuses the head before running the model (a layout no reader reads),
            or ``None``.
        after_decoder: what ``unreadable`` says after how the weight is sharded (``FSDP2``: which unit).
        compare: the probe's comparison with vanilla where the layout needs its own (rows split over the
            ranks: ``vocab_parallel.RowsSplit.compare``), or ``None`` for the one-process comparison.
    """

    name: ClassVar[str]
    compare: Callable[..., str | None] | None = None

    def __init__(self, sharded: str | None = None, refusal: str | None = None, after_decoder: str = "") -> None:
        self.sharded = sharded
        self.refusal = refusal
        self.after_decoder = after_decoder or ", and still one when the decoder has returned"

    def probing(self, model: nn.Module, head: nn.Module) -> contextlib.AbstractContextManager[None]:
        """What makes the model's forward runnable for the probe (ZeRO-3 gathers); nothing otherwise."""
        return contextlib.nullcontext()

    def readable(self, head: nn.Module) -> bool:
        """Whether the loss can read the head now, when the decoder has returned (called from a hook there)."""
        raise NotImplementedError

    def unreadable(self, why: str) -> str:
        """Why the head was not readable when the decoder returned (``why``: how its weight is sharded)."""
        return f"{why}{self.after_decoder}"

    @contextlib.contextmanager
    def reading(self, head: nn.Module) -> Any:
        """Around one computation of the loss or log-probabilities: yields what is read as the head (the head,
        or this rank's rows of it: ``weight``, ``bias``) and how a chunk's logits become losses
        (``loss.WholeRows``, or a rank's share of the vocabulary)."""
        yield head, WholeRows()


def fsdp_module_type() -> type[Any] | None:
    """torch's ``FSDPModule`` (FSDP2), or ``None`` on a torch without it."""
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
    fsdp = fsdp_module_type()
    return fsdp is not None and kind.__bases__ == (fsdp, nn.Linear)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (a shard, outside FSDP2's gathers)."""
    return type(tensor).__name__ == "DTensor"


def placements(tensor: Any) -> tuple[str, ...]:
    """A ``DTensor``'s placements, as text."""
    return tuple(repr(p) for p in getattr(tensor, "placements", ()))


def rows_placed(tensor: Any, mesh: Any) -> bool:
    """Whether a ``DTensor`` is split by rows on ``mesh``, 1-D: rank r holds the r-th block (torch.chunk's split)."""
    from torch.distributed.tensor import Shard

    return tuple(tensor.placements) == (Shard(0),) and tensor.device_mesh == mesh


def split_refusal(model: nn.Module, head: nn.Module) -> str:
    """Why a head that is a ``DTensor`` when the decoder has returned is not one the vocabulary-parallel loss
    reads (``vocab_parallel.row_split`` is ``None`` for it); called for the refusal's message."""
    weight, bias = head.weight, getattr(head, "bias", None)
    mesh = getattr(weight, "device_mesh", None)
    if mesh is not None and mesh.ndim != 1:
        return f"it is placed {placements(weight)} on a {mesh.ndim}-D mesh {mesh!r}"
    if not is_dtensor(weight) or not rows_placed(weight, mesh):
        return f"it is placed {placements(weight)}, not split by rows (Shard(0))"
    if bias is not None:
        return f"its bias is placed {placements(bias) or 'as a plain tensor'}, not split by rows as the weight is"
    return f"its mesh {mesh!r} has one rank"


def dtensor_weight(head: Any) -> bool:
    """Whether the head's weight is a ``DTensor``."""
    return is_dtensor(getattr(head, "weight", None))
