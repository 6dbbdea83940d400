"""The one question every reader of the head asks: where do its rows live?  Answered here, as a value
(``rows.HeadRows``): ``whole.Whole``, ``fsdp2.FSDP2``, ``vocab_parallel.RowsSplit`` or ``zero3.ZeRO3``.

``locate`` answers it at ``install``, for the probe (a layout no reader reads carries its refusal);
``at_step`` answers it again at each training step, since a model can be sharded after the install
(``fully_shard``, ``deepspeed.initialize``), and the installed forward and ``token_log_probs`` read the
head through the value it gives.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .fsdp2 import FSDP2, fsdp_units_holding
from .rows import HeadRows, is_dtensor, split_refusal
from .vocab_parallel import RowsSplit, row_split
from .whole import Whole
from .zero3 import ZeRO3, is_partitioned, needs_gathering, partitioned_head

__all__ = ["at_step", "locate"]


def locate(model: nn.Module, head: Any) -> HeadRows:
    """Where the head's rows live at the install, for the probe.

    Called once per ``install`` (and ``detect``), before the probe runs the model.  A model with
    partitioned parameters (ZeRO-3 before ``deepspeed.initialize``) is ``ZeRO3``; a ``DTensor`` head is
    ``FSDP2`` where an FSDP2 unit holds it, ``RowsSplit`` where its rows are split over the ranks, and a
    refused ``FSDP2`` otherwise; a head partitioned otherwise is a refused ``Whole``; a plain head is
    ``RowsSplit`` where it holds this rank's rows only (5.3's tensor parallelism), else ``Whole``.
    """
    if isinstance(head, nn.Linear) and needs_gathering(model):
        # ZeRO-3 before deepspeed.initialize: probed gathered, on every rank
        return ZeRO3()
    sharded = _sharded(head)
    if sharded is not None and not is_dtensor(getattr(head, "weight", None)):
        return Whole(sharded, f"{sharded}: the chunked loss over a partitioned head is not written")
    rows = _sharded_rows(model, head, sharded)
    if rows is not None:
        return rows
    if sharded is not None:
        refusal = (
            f"{sharded}, outside any FSDP2 unit (so sharded for the whole step, as tensor parallelism shards it), "
            f"and {split_refusal(model, head)}: the vocabulary-parallel loss reads a head whose rows are split over "
            "a 1-D mesh of ranks (Shard(0)), as tp_plan='auto' shards it"
        )
        return FSDP2(sharded, refusal)
    return Whole()


def at_step(model: nn.Module, head: nn.Linear) -> HeadRows | None:
    """Where the head's rows live in this training step, or ``None`` when no reader reads them (a weight
    left empty by something else than ZeRO-3): vanilla's step then runs.

    Called by the installed forward before it runs the model, and by ``token_log_probs``.  FSDP2 has
    gathered a head it shards with the model by then (``Whole``); a head still a ``DTensor`` is read
    where its rows are split (``RowsSplit``), else where FSDP2 gathers it (``FSDP2``, whose ``readable``
    the forward asks when the decoder has returned).
    """
    if partitioned_head(head):
        return ZeRO3()
    sharded = _sharded(head)
    if sharded is not None and not is_dtensor(getattr(head, "weight", None)):
        return None
    return _sharded_rows(model, head, sharded) or (Whole() if sharded is None else FSDP2(sharded))


def _sharded_rows(model: nn.Module, head: Any, sharded: str | None) -> HeadRows | None:
    # a DTensor an FSDP2 unit holds is gathered whole in the forward; otherwise rows split for the step
    if sharded is not None and fsdp_units_holding(model, head):
        return FSDP2(sharded)
    split = row_split(model, head)
    return None if split is None else RowsSplit(split, sharded)


def _sharded(head: Any) -> str | None:
    """Why the head's weight is not a whole local tensor (FSDP2, tensor parallelism, ZeRO-3), or ``None``."""
    for parameter in (getattr(head, "weight", None), getattr(head, "bias", None)):
        if parameter is None:
            continue
        if type(parameter).__name__ == "DTensor":
            return "the LM head's weight is a DTensor (FSDP2 or tensor parallelism)"
        # ZeRO-3 leaves each rank an empty tensor and the shape in ds_shape, outside a gather
        if is_partitioned(parameter) or parameter.numel() == 0:
            return (
                f"the LM head's weight is partitioned (DeepSpeed ZeRO-3: local shape {tuple(parameter.shape)}, "
                f"whole {tuple(getattr(parameter, 'ds_shape', ()))})"
            )
    return None
