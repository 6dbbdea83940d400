"""The selection a router computes: the one ``topk`` call that picks each token's experts.

Every top-k MoE router of transformers, whatever its scores (softmax, sigmoid with a
correction bias and group limits, llama4's sigmoid of the selected logits, gpt-oss's
softmax over the selected logits, zero-computation experts), picks the experts with one
``torch.topk`` over a ``(tokens, experts)`` tensor and computes the routing weights from
that call's indices (and values). So a replay does not re-implement any family's rule: while
the router's own forward runs, ``SelectionMode`` (a ``TorchFunctionMode``) answers that one
call with the replayed indices and the values the call's input holds at them, exactly what
``topk`` returns when it picks those experts. Everything after it (gathering unbiased
scores, renormalising, scaling, scattering) is the family's own code on the live router's
tensors, so gradients reach the router weights. The same mode records the call's indices.

Outside a replay or a recording no mode is entered: the router is vanilla, bit for bit.

``scope`` <- ``selection`` <- ``probe`` <- ``discovery`` <- ``routers`` <- ``replay`` / ``recording``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .errors import RoutingError
from .scope import LayerReplay

__all__ = ["RECORDINGS", "TOPK", "Selection", "SelectionMode", "listen_in_every_thread", "recordings", "topk_arguments"]

TOPK: frozenset[Callable[..., Any]] = frozenset({torch.topk, torch.Tensor.topk})


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which ``topk`` call of a router is its expert selection.

    Attributes:
        width: the number of experts it selects among (the selection tensor's last
            dimension; zero-computation experts included).
        top_k: how many it selects per token.
    """

    width: int
    top_k: int

    def matches(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether ``topk(*args, **kwargs)`` is this selection: the largest ``top_k`` along the
        last dimension of a ``(tokens, width)`` tensor."""
        source, k, dim, largest = topk_arguments(args, kwargs)
        return (
            isinstance(source, torch.Tensor)
            and source.dim() == 2
            and int(source.shape[1]) == self.width
            and k == self.top_k
            and dim in (-1, 1)
            and bool(largest)
        )


def topk_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    names = ("input", "k", "dim", "largest")
    defaults: dict[str, Any] = {"dim": -1, "largest": True}
    values = []
    for position, name in enumerate(names):
        if position < len(args):
            values.append(args[position])
        else:
            values.append(kwargs.get(name, kwargs.get("self") if name == "input" else defaults.get(name)))
    source, k, dim, largest = values
    return source, k, dim, largest


class _Listener(Protocol):
    _layers: dict[nn.Module, int]

    def _selected(self, router: nn.Module, indices: torch.Tensor) -> None: ...


# The open recordings of this context (``record_routing``): each is told the selection of
# the routers it listens to.
RECORDINGS: contextvars.ContextVar[tuple[_Listener, ...]] = contextvars.ContextVar("hfpatch_moe_recordings", default=())
# The open recordings that listen in every thread (``record_routing(..., threads="any")``):
# continuous batching runs the model on a background thread that the block's context never
# reaches. Replaced as a whole under the lock, so a reader sees one consistent tuple.
_ANY_THREAD: tuple[_Listener, ...] = ()
_ANY_THREAD_LOCK = threading.Lock()


def recordings() -> tuple[_Listener, ...]:
    """The recordings that listen to router calls made here: this context's, then those of every thread."""
    local = RECORDINGS.get()
    anywhere = _ANY_THREAD
    if not anywhere:
        return local
    return local + tuple(recording for recording in anywhere if recording not in local)


def listen_in_every_thread(recording: _Listener, listen: bool) -> None:
    """Add ``recording`` to (``listen``) or remove it from the recordings of every thread."""
    global _ANY_THREAD
    with _ANY_THREAD_LOCK:
        others = tuple(open_recording for open_recording in _ANY_THREAD if open_recording is not recording)
        _ANY_THREAD = (*others, recording) if listen else others


class SelectionMode(TorchFunctionMode):
    """Active around one router forward: replays and/or records its selection ``topk``.

    Args:
        router: the router (for the recordings and the messages).
        selection: which ``topk`` call is the selection.
        replay: the replay of this router (``None``: the router selects live).
        record: whether to tell the open recordings (``record_routing``) the selection.
    """

    def __init__(
        self,
        router: nn.Module,
        selection: Selection,
        replay: LayerReplay | None,
        *,
        record: bool = True,
    ) -> None:
        super().__init__()
        self.router = router
        self.selection = selection
        self.replay = replay
        self.record = record
        self.calls = 0

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in TOPK or not self.selection.matches(args, kwargs):
            return func(*args, **kwargs)
        self.calls += 1
        if self.calls > 1:
            raise RoutingError(
                f"{type(self.router).__name__}: this router computed a second top-{self.selection.top_k} over its "
                f"{self.selection.width} experts in one forward pass, so which one selects the experts is ambiguous; "
                "hfpatch-pack-moe-replay cannot replay this router (report it with the model type)."
            )
        source, _, _, _ = topk_arguments(args, kwargs)
        assert isinstance(source, torch.Tensor)  # matches() checked it
        if self.replay is None:
            result = func(*args, **kwargs)
            indices = result[1]
        else:
            indices, live = self.replay.on(source, self.selection.top_k)
            if live is not None:
                live_indices = func(*args, **kwargs)[1]
                indices = torch.where(live[:, None], live_indices, indices)
            result = torch.return_types.topk((source.gather(1, indices), indices))
        if self.record:
            for recording in recordings():
                recording._selected(self.router, indices)
        return result
