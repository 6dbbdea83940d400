"""The pack's refusal: raised wherever a model's head or loss path is found not to be one the chunked loss
reproduces, and turned into the model step's ``Refusal`` by ``step.py``."""

from __future__ import annotations

__all__ = ["ChunkedLossRefused"]


class ChunkedLossRefused(ValueError):
    """The model's head or loss path is not one the chunked loss reproduces exactly; the message says why."""
