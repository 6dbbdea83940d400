"""A head whose rows are all on this rank when the decoder has returned: one process, data parallelism, or a
head FSDP2 shards with the model after the install (gathered whole in the forward).  The loss reads the head
itself, over the whole vocabulary."""

from __future__ import annotations

from torch import nn

from .rows import HeadRows, is_dtensor

__all__ = ["Whole"]


class Whole(HeadRows):
    """The head's rows, all of them, on this rank (``HeadRows``)."""

    name = "whole"

    def readable(self, head: nn.Module) -> bool:
        """Whether the weight is a whole local tensor now (a ``DTensor`` set since the install is not)."""
        return not is_dtensor(getattr(head, "weight", None))
