"""The one loop over chunks of tokens, shared by the loss (``loss.py``) and the log-probabilities (``logprobs.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["chunks"]


def chunks(hidden: torch.Tensor, chunk: int, *, grad: bool | None = None) -> Iterator[tuple[slice, torch.Tensor]]:
    """Each chunk of ``chunk`` rows (tokens) of the flattened ``hidden`` states, in order: the chunk's slice of
    the tokens and its rows.

    Called by the chunked loss (its forward) and the chunked log-probabilities (forward and backward).
    ``grad``: ``None`` gives the rows as they are (a view); ``True`` or ``False``, detached rows that
    require a gradient or not, so that one chunk's graph is differentiated on its own.
    """
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        rows = hidden[part]
        yield part, rows if grad is None else rows.detach().requires_grad_(grad)
