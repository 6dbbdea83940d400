"""Which replay each router is under: the state ``replay_routing`` opens and the routers read.

A replay is scoped to one model's routers and to the thread (and ``contextvars``
context) that opened it, so a ``contextvars.ContextVar`` maps each router to what it
replays. One case escapes that context: the recomputation of activation checkpointing
during a backward pass, which autograd runs on its own worker threads (one per GPU).
For it, every open replay is also registered per router in a process-wide table, used
only inside a backward pass and only when the context has no replay for the router.

A recomputation must route as its forward pass did, whatever ran in between (a live
forward, another replay). So a forward pass under activation checkpointing remembers,
per router, what it replayed (or that it routed live), keyed by the checkpoint call it
runs in: ``torch.utils.checkpoint``'s own state for that call (the ``_CheckpointFrame``
of a non-reentrant checkpoint, the autograd node of a reentrant one), which its
recomputation runs under again. The entry goes when the checkpoint's graph is freed.

It lives apart from ``replay`` because the routers' forward reads it, and ``replay``
imports the routers: ``errors`` <- ``scope`` <- ``routers`` <- ``replay`` / ``recording``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .errors import RoutingError, shape


@dataclasses.dataclass
class LayerReplay:
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
        if shape(self.indices) != expected:
            raise RoutingError(
                f"replay_routing: layer {self.layer} ({self.name}) routes {rows} tokens in this forward pass, so it "
                f"expected routing of shape {expected}, got {shape(self.indices)}. The routing must cover every "
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


REPLAY: contextvars.ContextVar[Mapping[nn.Module, LayerReplay] | None] = contextvars.ContextVar(
    "hfpatch_moe_replay", default=None
)
# The open replays of each router, for the recomputation of activation checkpointing
# inside a backward pass: autograd runs it on its own worker threads (one per GPU), which
# do not see the context of the thread that opened the replay.
OPEN: dict[nn.Module, list[LayerReplay]] = {}
OPEN_LOCK = threading.Lock()


def in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


# What each checkpointed forward pass replayed, per router (``None``: it routed live), by
# the checkpoint call it ran in; weak, so an entry lives as long as the call's graph.
_CHECKPOINTED: weakref.WeakKeyDictionary[Any, dict[nn.Module, LayerReplay | None]] = weakref.WeakKeyDictionary()
_CHECKPOINTED_LOCK = threading.Lock()
_NOT_CHECKPOINTED: Any = object()


def _closure_value(function: Any, name: str) -> Any:
    """The value of free variable ``name`` of ``function`` (through decorators' ``__wrapped__``), or ``None``."""
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is not None and name in code.co_freevars:
            return function.__closure__[code.co_freevars.index(name)].cell_contents
        function = getattr(function, "__wrapped__", None)
    return None


def _reentrant_forward_context() -> Any:
    """The ``ctx`` of the reentrant ``CheckpointFunction.forward`` this call runs in, or ``None``."""
    from torch.utils.checkpoint import CheckpointFunction

    code = CheckpointFunction.forward.__code__
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    return None


def _checkpoint_call(training: bool) -> Any:
    """The ``torch.utils.checkpoint`` call that the running forward pass, or its recomputation in
    a backward pass, belongs to; ``None`` outside activation checkpointing (or an implementation
    of it this does not know, where the context alone decides)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks is not None:
        # non-reentrant: its forward runs under _checkpoint_hook(frame), the recomputation
        # under _recomputation_hook(weakref(frame), ...): the same frame
        frame = _closure_value(hooks[0], "frame")
        if frame is not None:
            return frame
        reference = _closure_value(hooks[0], "target_frame_ref")
        if reference is not None:
            return reference()
    if in_backward():
        # reentrant: the recomputation runs in CheckpointFunction.backward, whose node is its forward's ctx
        node = torch._C._current_autograd_node()
        return node if type(node).__name__ == "CheckpointFunctionBackward" else None
    if training and not torch.is_grad_enabled():
        return _reentrant_forward_context()  # reentrant forwards run under no_grad
    return None


def _open_replay(router: nn.Module) -> LayerReplay | None:
    """The replay of ``router`` this context sees, else (a backward pass on an autograd thread) the open one."""
    active = REPLAY.get()
    if active is not None:
        found = active.get(router)
        if found is not None:
            return found
    if not OPEN or not in_backward():
        return None
    with OPEN_LOCK:
        owners = list(OPEN.get(router, ()))
    if len(owners) > 1:
        raise RoutingError(
            f"replay_routing: router {owners[0].name} is recomputed in a backward pass on an autograd thread while "
            f"{len(owners)} replay blocks are open on this model in different threads, so which routing applies is "
            "ambiguous; run the backward passes of one model one at a time, or disable gradient checkpointing."
        )
    return owners[0] if owners else None


def _still_open(router: nn.Module, replay: LayerReplay) -> bool:
    active = REPLAY.get()
    if active is not None and active.get(router) is replay:
        return True
    with OPEN_LOCK:
        return any(owner is replay for owner in OPEN.get(router, ()))


def replay_of(router: nn.Module) -> LayerReplay | None:
    """What ``router`` replays in this call: in a forward pass, the replay open here (remembered for
    the recomputation of activation checkpointing); in that recomputation, what its forward pass
    replayed, or live routing where the forward pass routed live.

    Raises:
        RoutingError: the recomputation of a forward pass that replayed runs after its
            ``replay_routing`` block ended.
    """
    call = _checkpoint_call(router.training)
    if not in_backward():
        replay = _open_replay(router)
        if call is not None:
            with _CHECKPOINTED_LOCK:
                _CHECKPOINTED.setdefault(call, {})[router] = replay
        return replay
    if call is None:
        return _open_replay(router)
    with _CHECKPOINTED_LOCK:
        remembered = _CHECKPOINTED.get(call, {}).get(router, _NOT_CHECKPOINTED)
    if remembered is _NOT_CHECKPOINTED:
        return _open_replay(router)
    if remembered is None or _still_open(router, remembered):
        return remembered
    raise RoutingError(
        f"{type(router).__name__} ({remembered.name}): activation checkpointing recomputes this router in a "
        "backward pass that runs outside replay_routing, while its forward pass replayed a routing: the "
        "recomputation would route live and give wrong gradients. Call loss.backward() inside the "
        "`with replay_routing(model, routing):` block."
    )
