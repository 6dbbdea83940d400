"""Which replay each router is under: the state ``replay_routing`` opens and the routers read.

A replay is scoped to one model's routers and to the thread (and ``contextvars``
context) that opened it, so a ``contextvars.ContextVar`` maps each router to what it
replays. One case escapes that context: the recomputation of activation checkpointing
during a backward pass, which autograd runs on its own worker threads (one per GPU).
For it, every open replay is also registered per router in a process-wide table, used
only inside a backward pass and only when the context has no replay for the router.

It lives apart from ``replay`` because the routers' forward reads it, and ``replay``
imports the routers: ``values`` <- ``scope`` <- ``routers`` <- ``replay`` / ``recording``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
from collections.abc import Mapping

import torch
import torch.nn as nn

from .values import RoutingError, _shape


@dataclasses.dataclass
class _LayerReplay:
    """What one router replays: its layer's indices, and the rows that stay live."""

    layer: int
    name: str
    indices: torch.Tensor
    live: torch.Tensor | None
    _by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = dataclasses.field(default_factory=dict)

    def on(self, live_indices: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The indices (and live rows) on ``live_indices``' device, checked against its token count
        and the router's ``top_k``."""
        rows = int(live_indices.shape[0])
        expected = (rows, int(top_k))
        if _shape(self.indices) != expected:
            raise RoutingError(
                f"replay_routing: layer {self.layer} ({self.name}) routes {rows} tokens in this forward pass, so it "
                f"expected routing of shape {expected}, got {_shape(self.indices)}. The routing must cover every "
                "token of the forward, batch × seq_len in order, padding included: a routing recorded during "
                "generate() lacks the last generated token (use routing.padded(seq_len)); sequences of different "
                "lengths are batched with Routing.stack(..., padding_side=...). One replay block replays one "
                "forward pass (plus its backward); do not call generate() inside it."
            )
        cached = self._by_device.get(live_indices.device)
        if cached is None:
            live = None if self.live is None else self.live.to(live_indices.device)
            cached = self._by_device[live_indices.device] = (self.indices.to(live_indices.device), live)
        return cached


_REPLAY: contextvars.ContextVar[Mapping[nn.Module, _LayerReplay] | None] = contextvars.ContextVar(
    "hfpatch_moe_replay", default=None
)
# The open replays of each router, for the recomputation of activation checkpointing
# inside a backward pass: autograd runs it on its own worker threads (one per GPU), which
# do not see the context of the thread that opened the replay.
_OPEN: dict[nn.Module, list[_LayerReplay]] = {}
_OPEN_LOCK = threading.Lock()


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _replay_of(router: nn.Module) -> _LayerReplay | None:
    active = _REPLAY.get()
    if active is not None:
        found = active.get(router)
        if found is not None:
            return found
    if not _OPEN or not _in_backward():
        return None
    with _OPEN_LOCK:
        owners = list(_OPEN.get(router, ()))
    if len(owners) > 1:
        raise RoutingError(
            f"replay_routing: router {owners[0].name} is recomputed in a backward pass on an autograd thread while "
            f"{len(owners)} replay blocks are open on this model in different threads, so which routing applies is "
            "ambiguous; run the backward passes of one model one at a time, or disable gradient checkpointing."
        )
    return owners[0] if owners else None
