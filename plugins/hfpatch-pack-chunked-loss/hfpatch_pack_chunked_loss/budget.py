"""How many tokens a chunk holds: the byte budget of a step's logits, from ``install`` or the environment."""

from __future__ import annotations

import os
import re

__all__ = ["BUDGET_ENV", "DEFAULT_BUDGET", "LOGIT_COPIES", "budget_from_env", "chunk_for"]

#: The environment variable that sets the byte budget of a step's logits (``install``'s default):
#: ``HF_PATCH_PACKS=chunked-loss HF_PATCH_CHUNKED_LOSS_BUDGET=512MiB``.  Read at each install.
BUDGET_ENV = "HF_PATCH_CHUNKED_LOSS_BUDGET"

#: The default budget: 256 MiB of chunk x vocabulary tensors, 110 tokens per chunk at a 151,936
#: vocabulary, 524 at 32,000 (``chunk_for``).
DEFAULT_BUDGET = 256 * 2**20

#: How many chunk x vocabulary tensors one chunk's loss holds at once, at most, where autograd computes it
#: (a soft-cap, bfloat16, autocast; float32 otherwise holds one buffer: ``loss.logit_bytes_per_token``): the
#: logits (their transform's output and the float32 copy replace them), ``log_softmax``'s output
#: saved for the backward, and in the backward the gradient it receives and the one it makes; a
#: soft-cap's ``tanh`` output, saved for its backward, is the fourth (a scale's product replaces
#: the logits).  ``tests/test_budget.py`` measures a step's logits against the budget.
LOGIT_COPIES = 4

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}
_BYTES = re.compile(r"\s*(?P<number>\d+)\s*(?P<unit>[a-z]*)\s*")


def budget_from_env() -> int:
    """The budget ``HF_PATCH_CHUNKED_LOSS_BUDGET`` sets, or ``DEFAULT_BUDGET`` when it is unset or empty.

    Called by ``install`` when given neither ``chunk`` nor ``budget``.

    Raises:
        ValueError: the variable is not a positive number of bytes (``268435456``, ``256MiB``, ``1GiB``).
    """
    raw = os.environ.get(BUDGET_ENV, "")
    if not raw.strip():
        return DEFAULT_BUDGET
    match = _BYTES.fullmatch(raw.lower())
    if match is None or match["unit"] not in _UNITS or int(match["number"]) < 1:
        raise ValueError(
            f"{BUDGET_ENV}={raw!r} is not a positive number of bytes; write it as 268435456, 256MiB or 1GiB "
            "(units B, KiB, MiB, GiB), or unset it for the default (256MiB)"
        )
    return int(match["number"]) * _UNITS[match["unit"]]


def chunk_for(budget: int, vocab: int, held: int = 0, *, per_token: int | None = None) -> int:
    """Tokens per chunk such that a chunk's logits and ``held`` bytes (the last position's logits a
    training step returns) fit ``budget`` bytes.  ``per_token``: what one token of a chunk holds
    (``loss.logit_bytes_per_token`` for the path the loss takes); at most ``LOGIT_COPIES`` float32
    tensors of ``vocab`` entries, the default.

    One token at least: a budget below one token's logits gives chunks of one token.
    """
    return max(1, (budget - held) // (per_token or vocab * 4 * LOGIT_COPIES))
