"""What every module of the pack raises, and the expert id that means "route live".

The bottom of the pack's imports: ``errors`` <- ``wire`` <- ``values`` <- ``scope`` <- ``selection``
<- ``sites`` <- ``probe`` <- ``discovery`` <- ``routers`` <- ``replay`` / ``recording`` / ``engines``
<- ``trl`` (the pack's pyproject holds the layers, ``make lint`` checks them).
"""

from __future__ import annotations

import torch

from hfpatch_core.errors import HfPatchError

__all__ = ["LIVE", "RoutingError", "shape"]

#: The expert id that marks a token "route live" in a ``Routing``: a row of
#: ``LIVE`` (padding added by ``Routing.padded`` / ``Routing.stack``) makes the
#: router keep its own top-k for that token during a replay.
LIVE = -1


class RoutingError(HfPatchError, ValueError):
    """A routing is malformed, or does not fit the model or forward pass it is replayed on."""


def shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s shape as a plain tuple, for messages."""
    return tuple(tensor.shape)
