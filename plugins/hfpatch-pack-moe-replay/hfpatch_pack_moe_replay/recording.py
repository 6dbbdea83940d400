"""Recording a routing: ``record_routing`` collects the experts a model's routers select.

It works on any model of a replayable model type, loaded with the pack or not: it reads
the indices of each router's selection ``topk`` (``SelectionMode``: entered by the pack's
routers themselves, by forward hooks on a vanilla router), whatever the router returns
(llama4's router returns no indices). Hooks are installed for the block and removed when
it ends; a pre-hook on each router and its MoE block gives the ``(batch, seq_len)`` shape
that the router's flattened input has lost. Only calls from
the thread (and ``contextvars`` context) that opened the block are recorded, and not
the recomputation of activation checkpointing in a backward pass, which would record a
forward twice. ``RoutingRecording`` turns the calls into one ``Routing`` per forward
pass (``steps``) or into the whole generation (``routing``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from .routers import _SELECTIONS, ReplayableRouter, routers_of
from .scope import _in_backward
from .selection import _RECORDINGS, SelectionMode
from .values import Routing, RoutingError, _join_per_sequence

__all__ = ["RoutingRecording", "record_routing"]


@dataclasses.dataclass(frozen=True)
class _Call:
    batch_size: int
    seq_len: int
    indices: torch.Tensor


_RECORDING = _RECORDINGS


class RoutingRecording:
    """What ``record_routing`` collected: every router call of every forward pass in the block.

    Attributes:
        layer_names: the routers' module names, one per layer of the routing.
    """

    def __init__(self, layer_names: Sequence[str], routers: Sequence[nn.Module] = ()) -> None:
        self.layer_names = tuple(layer_names)
        self._layers: dict[nn.Module, int] = {router: layer for layer, router in enumerate(routers)}
        self._modes: dict[nn.Module, list[SelectionMode | None]] = {}
        self._calls: list[list[_Call]] = [[] for _ in self.layer_names]
        self._pending: dict[int, tuple[int, int]] = {}
        self._last_shape: tuple[int, int] | None = None

    def _before_block(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self not in _RECORDING.get():
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            self._pending[layer] = self._last_shape = (int(hidden.shape[0]), int(hidden.shape[1]))

    def _before_model(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self not in _RECORDING.get():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shaped = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else embeds
        if isinstance(shaped, torch.Tensor) and shaped.dim() >= 2:
            self._last_shape = (int(shaped.shape[0]), int(shaped.shape[1]))

    def _enter(self, router: nn.Module) -> None:
        """Before a vanilla router's forward: watch its selection, unless another recording does."""
        listeners = [recording for recording in _RECORDINGS.get() if router in recording._layers]
        mode = None
        if listeners and listeners[0] is self:
            mode = SelectionMode(router, _SELECTIONS[router], None)
            mode.__enter__()
        self._modes.setdefault(router, []).append(mode)

    def _exit(self, router: nn.Module) -> None:
        modes = self._modes.get(router)
        mode = modes.pop() if modes else None
        if mode is not None:
            mode.__exit__(None, None, None)

    def _selected(self, router: nn.Module, indices: torch.Tensor) -> None:
        # the recomputation of gradient checkpointing repeats a forward already recorded
        layer = self._layers.get(router)
        if layer is None or self not in _RECORDING.get() or _in_backward():
            return
        rows = int(indices.shape[0])
        # a router its block calls from another method (jetmoe's attention experts: ``map``) sees no
        # (batch, seq_len) input: it routes the same tokens as the last block that did
        batch_size, seq_len = self._pending.pop(layer, self._last_shape or (1, rows))
        if batch_size * seq_len != rows:  # the block was called on a flattened batch
            batch_size, seq_len = 1, rows
        self._calls[layer].append(_Call(batch_size, seq_len, indices.detach()))

    def _passes(self) -> int:
        counts = {len(calls) for calls in self._calls}
        if len(counts) > 1:
            detail = ", ".join(
                f"{name}: {len(calls)}" for name, calls in zip(self.layer_names, self._calls, strict=True)
            )
            raise RoutingError(
                f"record_routing: the routers ran different numbers of times ({detail}), so the calls cannot be "
                "matched into forward passes: a forward pass stopped half-way (an exception, or the block ended "
                "inside one); record complete forward passes."
            )
        return counts.pop()

    @property
    def steps(self) -> tuple[Routing, ...]:
        """One ``Routing`` per forward pass, in call order (for ``generate``: the prompt,
        then one token per sequence per step)."""
        return tuple(
            Routing(tuple(calls[step].indices for calls in self._calls), batch_size=self._calls[0][step].batch_size)
            for step in range(self._passes())
        )

    @property
    def routing(self) -> Routing:
        """The forward passes of the block as one routing over the whole sequences.

        Every forward pass is taken as the continuation of the previous one, which is what
        ``generate`` with a KV cache (the default) runs: the prompt (``batch × prompt_len``
        tokens), then ``batch × 1`` per new token. Per sequence, the passes' tokens are
        concatenated in order, so the result has ``batch_size`` sequences of
        ``prompt_len + new_tokens - 1`` tokens (the last generated token is never fed
        back); ``routing.padded(sequences.shape[1])`` covers a training forward over
        ``generate``'s output. A single forward pass gives its own routing. Generation
        without a KV cache, beam search or assisted decoding re-route tokens and do not
        concatenate like this: use ``steps`` there.

        Raises:
            RoutingError: nothing was recorded, or the passes have different batch sizes.
        """
        if not self._passes():
            raise RoutingError(
                "record_routing: no forward pass ran inside the block; call the model (or generate) inside "
                "`with record_routing(model) as recording:` and read recording.routing after it."
            )
        batch_sizes = [call.batch_size for call in self._calls[0]]
        if len(set(batch_sizes)) > 1:
            raise RoutingError(
                f"record_routing: the forward passes in the block have batch sizes {batch_sizes}, so they are not "
                "one generation; record each forward pass or generate() call in its own block, or read "
                "recording.steps."
            )
        batch_size = batch_sizes[0]
        layers = tuple(
            _join_per_sequence([(call.indices, call.seq_len) for call in calls], batch_size) for calls in self._calls
        )
        return Routing(layers, batch_size=batch_size)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecording]:
    """Record the experts ``model``'s routers select in the forward passes run inside the block.

    Works on any model of a covered family, loaded with the pack or not. Hooks are
    installed on the routers (and their MoE blocks, for the batch shape) for the block
    only, and record only calls made from the current thread and context. Indices stay on
    the routers' device. Recording inside ``replay_routing`` records the replayed
    selection.

    Example::

        with torch.no_grad(), record_routing(model) as recording:
            sequences = model.generate(**inputs, max_new_tokens=64)
        routing = recording.routing.padded(sequences.shape[1])
        with replay_routing(model, routing):
            model(sequences, attention_mask=mask).logits ...

    Yields:
        a ``RoutingRecording``; read its ``routing`` (or
        ``steps``) after the forward passes.

    Raises:
        RoutingError: ``model`` has no router of a covered family.
    """
    routers = routers_of(model)
    recording = RoutingRecording([name for name, _ in routers], [router for _, router in routers])
    handles = []
    try:

        def before_model(_module: nn.Module, args: Any, kwargs: Any) -> None:
            recording._before_model(args, kwargs)

        handles.append(model.register_forward_pre_hook(before_model, with_kwargs=True))
        for layer, (name, router) in enumerate(routers):
            block = model.get_submodule(name.rpartition(".")[0])

            def before(_module: nn.Module, args: Any, kwargs: Any, layer: int = layer) -> None:
                recording._before_block(layer, args, kwargs)

            handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(router.register_forward_pre_hook(before, with_kwargs=True))
            if not isinstance(router, ReplayableRouter):

                def enter(module: nn.Module, _args: Any) -> None:
                    if recording in _RECORDING.get():
                        recording._enter(module)

                def leave(module: nn.Module, _args: Any, _output: Any) -> None:
                    if recording in _RECORDING.get():
                        recording._exit(module)

                handles.append(router.register_forward_pre_hook(enter))
                handles.append(router.register_forward_hook(leave, always_call=True))
        token = _RECORDING.set((*_RECORDING.get(), recording))
        try:
            yield recording
        finally:
            _RECORDING.reset(token)
    finally:
        for handle in handles:
            handle.remove()
