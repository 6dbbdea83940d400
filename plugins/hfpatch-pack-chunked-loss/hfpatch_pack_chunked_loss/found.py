"""What the probe finds on a model and ``install`` records: which cross-entropy (``LossKind``), and the whole
of it (``Installed``)."""

from __future__ import annotations

import dataclasses

from .budget import DEFAULT_BUDGET, chunk_for
from .loss import HeadTransform

__all__ = ["Installed", "LossKind"]


@dataclasses.dataclass(frozen=True)
class LossKind:
    """Which token-wise cross-entropy (``ignore_index=-100``) a family's forward computes from its logits,
    found by probing its loss against each (``compare.loss_kind``).

    Attributes:
        shift: the logits at position t are compared with the label at t + 1 (``ForCausalLMLoss``);
            ``False``: with the label at t (bart's, xlnet's, xlm's and cpmant's causal-LM heads).
        loss_kwargs: the forward hands its loss keyword arguments to the loss: a sum divided by
            ``num_items_in_batch`` when given, and ``ignore_index`` and ``shift_labels`` are read;
            ``False``: the mean over the counted tokens whatever the call passes.
    """

    shift: bool = True
    loss_kwargs: bool = True


@dataclasses.dataclass(frozen=True)
class Installed:
    """What ``install`` found and put on a model.

    Attributes:
        transform: what the family's forward does between the head and the loss.
        chunk: tokens per chunk when ``install`` was given one; ``None`` when chunks are sized by ``budget``.
        budget: bytes of chunk x vocabulary logits a step holds at most (``chunk_for``); ``None``
            when ``chunk`` is fixed.
        aux_loss_coefficient: where the family's forward reads the coefficient of the auxiliary
            (MoE load-balancing) loss it adds to the loss, as a dotted attribute path from the model
            (``"router_aux_loss_coef"``), read at each step; ``None`` when the forward adds none.
        loss: which cross-entropy the family's forward computes (``LossKind``).
    """

    transform: HeadTransform
    chunk: int | None = None
    budget: int | None = None
    aux_loss_coefficient: str | None = None
    loss: LossKind = LossKind()

    def chunk_of(self, vocab: int, held: int = 0, *, per_token: int | None = None) -> int:
        """Tokens per chunk for a head of ``vocab`` rows, with ``held`` bytes of logits already alive
        and ``per_token`` bytes held by each token of a chunk (``chunk_for``)."""
        if self.chunk is not None:
            return self.chunk
        return chunk_for(self.budget or DEFAULT_BUDGET, vocab, held, per_token=per_token)
