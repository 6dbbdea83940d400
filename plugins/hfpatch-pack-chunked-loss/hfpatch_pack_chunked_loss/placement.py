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

from . import fsdp2, vocab_parallel, zero3
from .rows import HeadRows
from .whole import Whole

__all__ = ["at_step", "locate"]


def locate(model: nn.Module, head: Any) -> HeadRows:
    """Where the head's rows live at the install, for the probe.

    Called once per ``install`` (and ``detect``), before the probe runs the model.  Each layout claims the
    head or not, in turn: ``FSDP2`` (a ``DTensor`` an FSDP2 unit holds), ``RowsSplit`` (rows split over the
    ranks; a ``DTensor`` split otherwise is refused there), ``ZeRO3`` (a model with partitioned parameters;
    a head empty or partitioned otherwise is refused there), else ``Whole``.
    """
    return fsdp2.claim(model, head) or vocab_parallel.claim(model, head) or zero3.claim(model, head) or Whole()


def at_step(model: nn.Module, head: nn.Linear) -> HeadRows | None:
    """Where the head's rows live in this training step, or ``None`` when no reader reads them (a weight
    left empty by something else than ZeRO-3): vanilla's step then runs.

    Called by the installed forward before it runs the model, and by ``token_log_probs``.  FSDP2 has
    gathered a head it shards with the model by then (``Whole``); a head still a ``DTensor`` is read
    where its rows are split (``RowsSplit``), else where FSDP2 gathers it (``FSDP2``, whose ``readable``
    the forward asks when the decoder has returned, falling back to vanilla's step with the reason).
    """
    rows = (
        fsdp2.claim(model, head)
        or vocab_parallel.claim(model, head)
        or zero3.claim(model, head, whole_model=False)
        or Whole()
    )
    if rows.refusal is None:
        return rows
    if isinstance(rows, vocab_parallel.RowsSplit):
        return fsdp2.FSDP2(rows.sharded, after_decoder=fsdp2.after_decoder(model, head))
    return None
