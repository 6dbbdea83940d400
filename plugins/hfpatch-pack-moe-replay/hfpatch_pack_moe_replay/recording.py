"""Recording a routing: ``record_routing`` collects the experts a model's routers select.

It works on any model of a replayable model type, loaded with the pack or not: it reads
the indices of each router's selection ``topk`` (``SelectionMode``: entered by the pack's
routers themselves, by forward hooks on a vanilla router), whatever the router returns
(llama4's router returns no indices). Hooks are installed for the block and removed when
it ends; a pre-hook on each router and its MoE block gives the ``(batch, seq_len)`` shape
that the router's flattened input has lost. By default only calls from the thread (and
``contextvars`` context) that opened the block are recorded; with ``threads="any"``, calls
from every thread (continuous batching runs the model on a background thread), each
forward pass of the model collected apart per thread and added whole when it ends. Never
recorded: the recomputation of activation checkpointing in a backward pass, which would
record a forward twice. ``RoutingRecording`` turns the calls into one ``Routing`` per
forward pass (``steps``), into the whole generation (``routing``), or, for continuous
batching, into one ``Routing`` per request (``requests``).

Continuous batching packs the new tokens of several requests into one flattened forward
(``input_ids`` of shape ``(1, tokens)``, request ``i`` at rows ``cu_seq_lens_q[i]`` to
``cu_seq_lens_q[i + 1]``, at the positions ``position_ids`` holds). The forward's arguments
do not say which request each segment is; the batch processor that calls the model holds
them, in segment order (``inputs_and_outputs.requests_in_batch``), so the model's pre-hook
reads them from its caller's frame. A prompt prefix that shares cached blocks with another
request (prefix caching) is not computed again: its routes are those of the request it
shares them with, the same tokens at the same positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
import torch.nn as nn

from .errors import RoutingError
from .routers import SELECTIONS, ReplayableRouter, routers_of
from .scope import in_backward
from .selection import RECORDINGS, SelectionMode, listen_in_every_thread, recordings
from .values import Routing, join_per_sequence

__all__ = ["RoutingRecording", "record_routing"]

Threads = Literal["context", "any"]


@dataclasses.dataclass(frozen=True)
class _Call:
    batch_size: int
    seq_len: int
    indices: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One request's tokens in a continuous batch: rows ``start``..``start + len(positions)``."""

    request_id: str
    start: int
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    prompt: tuple[int, ...]


@dataclasses.dataclass
class _Forward:
    """A forward pass of the model running in one thread (``threads="any"``): its router calls, and
    the requests of its continuous batch."""

    calls: list[list[_Call]]
    segments: tuple[_Segment, ...] | None = None
    error: RoutingError | None = None


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.pending: dict[int, tuple[int, int]] = {}
        self.last_shape: tuple[int, int] | None = None
        self.modes: dict[nn.Module, list[SelectionMode | None]] = {}
        self.depth = 0
        self.forward: _Forward | None = None


_CONTINUOUS_BATCH_ARGUMENTS = ("cu_seq_lens_q", "logits_indices", "position_ids")


def _batch_owner() -> Any:
    """The continuous batching object whose method called the model: the first caller up the stack
    whose ``self`` holds the batch's ``inputs_and_outputs`` (transformers' model runner, or the batch
    processor in older releases)."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(24):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "inputs_and_outputs"):
            return owner
        frame = frame.f_back
    return None


def _continuous_batch(kwargs: dict[str, Any]) -> tuple[_Segment, ...]:
    """The requests of the continuous batch that this forward pass computes, one segment each.

    Raises:
        RoutingError: the requests cannot be told, or the batch runs in a way the hooks do not see.
    """
    owner = _batch_owner()
    if owner is None:
        raise RoutingError(
            "record_routing: a forward pass has continuous batching's arguments (cu_seq_lens_q, logits_indices) "
            "but no continuous batching object calls it, so its tokens cannot be attributed to requests; record "
            "continuous batching through model.generate_batch or model.init_continuous_batching."
        )
    # the attributes of transformers 5.25's model runner, then of 5.3's batch processor
    graphs = ("use_cuda_graph_varlen", "use_cuda_graph_decode", "use_cuda_graph")
    compiled = ("_compiled_varlen", "_compiled_decode", "compile_config")
    if any(getattr(owner, name, False) is True for name in graphs) or any(
        getattr(owner, name, None) is not None for name in compiled
    ):
        raise RoutingError(
            "record_routing: this continuous batching replays CUDA graphs or runs a compiled forward, whose "
            "router calls Python hooks never see, so the routing of some forward passes would be missing; "
            "generate with ContinuousBatchingConfig(use_cuda_graph=False) and no compile config while recording."
        )
    io = owner.inputs_and_outputs
    if hasattr(io, "io_pairs"):  # async batching: the pair this forward pass reads
        io = io.io_pairs[io.current_pair].host_io
    requests = list(io.requests_in_batch)
    bounds = [int(value) for value in kwargs["cu_seq_lens_q"].tolist()]
    positions = [int(value) for value in kwargs["position_ids"].reshape(-1).tolist()]
    ids = kwargs.get("input_ids")
    tokens = [int(value) for value in ids.reshape(-1).tolist()] if isinstance(ids, torch.Tensor) else []
    if len(bounds) <= len(requests) or len(tokens) < bounds[len(requests)]:
        raise RoutingError(
            f"record_routing: a continuous batch of {len(requests)} requests has {len(bounds) - 1} query segments "
            f"and {len(tokens)} tokens, so its tokens cannot be attributed to requests (transformers' continuous "
            "batching changed); record with model.generate(...) instead."
        )
    segments = []
    for index, future in enumerate(requests):
        start, end = bounds[index], bounds[index + 1]
        state = future.state
        query_length = getattr(future, "query_length", end - start)
        if query_length != end - start:
            raise RoutingError(
                f"record_routing: request {state.request_id} has {query_length} query tokens but segment {index} of "
                f"the continuous batch has {end - start}, so the segments are not the requests in order."
            )
        segments.append(
            _Segment(
                str(state.request_id),
                start,
                tuple(positions[start:end]),
                tuple(tokens[start:end]),
                tuple(int(token) for token in state.initial_tokens),
            )
        )
    return tuple(segments)


class RoutingRecording:
    """What ``record_routing`` collected: every router call of every forward pass in the block.

    Attributes:
        layer_names: the routers' module names, one per layer of the routing.
        threads: whose router calls it records (``record_routing``'s argument).
    """

    def __init__(
        self, layer_names: Sequence[str], routers: Sequence[nn.Module] = (), *, threads: Threads = "context"
    ) -> None:
        self.layer_names = tuple(layer_names)
        self.threads: Threads = threads
        self._layers: dict[nn.Module, int] = {router: layer for layer, router in enumerate(routers)}
        self._calls: list[list[_Call]] = [[] for _ in self.layer_names]
        self._batches: list[tuple[int, tuple[_Segment, ...]]] = []
        self._errors: list[RoutingError] = []
        self._lock = threading.Lock()
        self._thread = _ThreadState()

    def _listening(self) -> bool:
        if in_backward():  # the recomputation of gradient checkpointing repeats a recorded forward
            return False
        return self in RECORDINGS.get() or (self.threads == "any" and self in recordings())

    def _before_block(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._listening():
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            state = self._thread
            state.pending[layer] = state.last_shape = (int(hidden.shape[0]), int(hidden.shape[1]))

    def _before_model(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._listening():
            return
        state = self._thread
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shaped = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else embeds
        if isinstance(shaped, torch.Tensor) and shaped.dim() >= 2:
            state.last_shape = (int(shaped.shape[0]), int(shaped.shape[1]))
        if self.threads != "any":
            return
        state.depth += 1
        if state.depth > 1:
            return
        forward = state.forward = _Forward([[] for _ in self.layer_names])
        if all(isinstance(kwargs.get(name), torch.Tensor) for name in _CONTINUOUS_BATCH_ARGUMENTS):
            try:
                forward.segments = _continuous_batch(kwargs)
            except RoutingError as error:
                # raised where the routes are read: raising here would stop the generation thread
                forward.error = error

    def _after_model(self) -> None:
        state = self._thread
        if state.depth == 0:
            return
        state.depth -= 1
        forward = state.forward
        if state.depth or forward is None:
            return
        state.forward = None
        with self._lock:
            if forward.error is not None:
                self._errors.append(forward.error)
            if not any(forward.calls):
                return
            if forward.segments is not None:
                if {len(calls) for calls in forward.calls} != {1}:
                    self._errors.append(
                        RoutingError(
                            "record_routing: in a continuous batch's forward pass the routers ran "
                            f"{[len(calls) for calls in forward.calls]} times, not once each, so its tokens cannot "
                            "be attributed to requests."
                        )
                    )
                else:
                    self._batches.append((len(self._calls[0]), forward.segments))
            for layer, calls in enumerate(forward.calls):
                self._calls[layer].extend(calls)

    def _enter(self, router: nn.Module) -> None:
        """Before a vanilla router's forward: watch its selection, unless another recording does
        (``_exit`` pops what this pushes, so the two stay paired whatever opens or closes between)."""
        mode = None
        listeners = [recording for recording in recordings() if router in recording._layers]
        if listeners and listeners[0] is self and self._listening():
            mode = SelectionMode(router, SELECTIONS[router], None)
            mode.__enter__()
        self._thread.modes.setdefault(router, []).append(mode)

    def _exit(self, router: nn.Module) -> None:
        modes = self._thread.modes.get(router)
        mode = modes.pop() if modes else None
        if mode is not None:
            mode.__exit__(None, None, None)

    def _selected(self, router: nn.Module, indices: torch.Tensor) -> None:
        layer = self._layers.get(router)
        if layer is None or not self._listening():
            return
        state = self._thread
        rows = int(indices.shape[0])
        # a router its block calls from another method (jetmoe's attention experts: ``map``) sees no
        # (batch, seq_len) input: it routes the same tokens as the last block that did
        batch_size, seq_len = state.pending.pop(layer, state.last_shape or (1, rows))
        if batch_size * seq_len != rows:  # the block was called on a flattened batch
            batch_size, seq_len = 1, rows
        call = _Call(batch_size, seq_len, indices.detach())
        if state.forward is not None:
            state.forward.calls[layer].append(call)
            return
        with self._lock:
            self._calls[layer].append(call)

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
            join_per_sequence([(call.indices, call.seq_len) for call in calls], batch_size) for calls in self._calls
        )
        return Routing(layers, batch_size=batch_size)

    @property
    def requests(self) -> dict[str, Routing]:
        """One ``Routing`` per request of the continuous batching run inside the block, by request id.

        ``model.generate_batch(...)`` (or a manager of ``model.init_continuous_batching()``)
        computes each forward pass over the new tokens of several requests, packed in one
        row; each request's routes are taken from the passes it took part in, position by
        position, so a request's ``Routing`` (batch size 1) covers its prompt and generated
        tokens but the last (never fed back), ``len(prompt_ids) + len(generated_tokens) - 1``
        tokens, exactly as ``routing`` after ``generate`` of that prompt alone:
        ``routes[request_id].padded(len(prompt_ids) + len(generated_tokens))`` covers a
        training forward over the request's sequence; ``Routing.stack`` batches several.
        A position computed twice (a request re-prefilled after its cache was dropped)
        keeps its last routes; a prompt prefix read from cached blocks that another request
        computed (prefix caching) takes that request's routes, the same tokens at the same
        positions. Record with ``record_routing(model, threads="any")``: the batch runs on
        a background thread.

        Raises:
            RoutingError: no continuous batch ran in the block, one ran in a way the hooks do
                not see (CUDA graphs, a compiled forward), or a request lacks the routes of
                some position.
        """
        with self._lock:
            batches = list(self._batches)
            errors = list(self._errors)
            calls = [list(layer_calls) for layer_calls in self._calls]
        if errors:
            raise errors[0]
        if not batches:
            hint = (
                'record with `record_routing(model, threads="any")`: continuous batching runs the model on a '
                "background thread"
                if self.threads != "any"
                else "generate with model.generate_batch(...) inside the block"
            )
            raise RoutingError(f"record_routing: no forward pass of continuous batching was recorded; {hint}.")
        offsets = [0]
        for call in calls[0]:
            offsets.append(offsets[-1] + int(call.indices.shape[0]))
        rows: dict[str, dict[int, int]] = {}
        tokens: dict[str, dict[int, int]] = {}
        prompts: dict[str, tuple[int, ...]] = {}
        for forward, segments in batches:
            base = offsets[forward]
            for segment in segments:
                request_rows = rows.setdefault(segment.request_id, {})
                request_tokens = tokens.setdefault(segment.request_id, {})
                prompts[segment.request_id] = segment.prompt
                for offset, (position, token) in enumerate(zip(segment.positions, segment.tokens, strict=True)):
                    request_rows[position] = base + segment.start + offset
                    request_tokens[position] = token
        _fill_shared_prefixes(rows, tokens, prompts)
        flat = [torch.cat([call.indices for call in layer_calls]) for layer_calls in calls]
        routes = {}
        for request_id, request_rows in rows.items():
            length = max(request_rows) + 1
            missing = [position for position in range(length) if position not in request_rows]
            if missing:
                raise RoutingError(
                    f"record_routing: request {request_id} has no recorded routes at positions {missing[:8]} "
                    f"(of {length}): its tokens there were computed outside the block (a manager that ran before "
                    "it, or a prefix cached by a request that is gone); open the block before the requests are added."
                )
            index = torch.tensor([request_rows[position] for position in range(length)], dtype=torch.long)
            routes[request_id] = Routing(tuple(layer.index_select(0, index.to(layer.device)) for layer in flat))
        return routes


def _fill_shared_prefixes(
    rows: dict[str, dict[int, int]], tokens: dict[str, dict[int, int]], prompts: dict[str, tuple[int, ...]]
) -> None:
    """Give each request the rows of the positions it read from another request's cached blocks.

    A request's position is taken from a request whose tokens agree with it up to that position,
    the one agreeing longest: the same prefix, so the same computation.
    """

    def sequence(request_id: str, length: int) -> list[int | None]:
        known, prompt = tokens[request_id], prompts[request_id]
        return [known.get(position, prompt[position] if position < len(prompt) else None) for position in range(length)]

    # each request's tokens up to its last recorded position, built once (filling adds no later position)
    known = {request_id: sequence(request_id, max(request_rows) + 1) for request_id, request_rows in rows.items()}
    for request_id, request_rows in rows.items():
        own = known[request_id]
        length = len(own)
        if len(request_rows) == length:
            continue
        sources = []
        for other, other_rows in rows.items():
            if other == request_id:
                continue
            theirs = known[other][:length]
            agree = 0
            while agree < len(theirs) and own[agree] is not None and own[agree] == theirs[agree]:
                agree += 1
            sources.append((agree, other_rows))
        sources.sort(key=lambda source: -source[0])
        for position in range(length):
            if position in request_rows:
                continue
            for agree, other_rows in sources:
                if position < agree and position in other_rows:
                    request_rows[position] = other_rows[position]
                    break


@contextlib.contextmanager
def record_routing(model: nn.Module, *, threads: Threads = "context") -> Iterator[RoutingRecording]:
    """Record the experts ``model``'s routers select in the forward passes run inside the block.

    Works on any model of a covered family, loaded with the pack or not. Hooks are
    installed on the routers (and their MoE blocks, for the batch shape) for the block
    only. Indices stay on the routers' device. Recording inside ``replay_routing`` records
    the replayed selection; the recomputation of activation checkpointing in a backward
    pass is never recorded.

    Example::

        with torch.no_grad(), record_routing(model) as recording:
            sequences = model.generate(**inputs, max_new_tokens=64)
        routing = recording.routing.padded(sequences.shape[1])
        with replay_routing(model, routing):
            model(sequences, attention_mask=mask).logits ...

    Continuous batching (``model.generate_batch``, TRL's ``use_transformers_continuous_batching``)::

        with record_routing(model, threads="any") as recording:
            outputs = model.generate_batch(prompts, generation_config=config)
        routes = recording.requests  # {request_id: Routing}

    Args:
        model: the model (or its base model) whose routers to record.
        threads: ``"context"``: only calls made from the thread and ``contextvars`` context
            that opened the block; ``"any"``: calls from every thread (the background thread
            of continuous batching), each forward pass of ``model`` kept whole, whichever
            thread runs it.

    Yields:
        a ``RoutingRecording``; read its ``routing`` (or ``steps``, or ``requests``) after
        the forward passes.

    Raises:
        RoutingError: ``model`` has no router of a covered family.
        ValueError: ``threads`` is not ``"context"`` or ``"any"``.
    """
    if threads not in ("context", "any"):
        raise ValueError(f'record_routing: threads must be "context" or "any", got {threads!r}.')
    routers = routers_of(model)
    recording = RoutingRecording([name for name, _ in routers], [router for _, router in routers], threads=threads)
    handles = []
    try:

        def before_model(_module: nn.Module, args: Any, kwargs: Any) -> None:
            recording._before_model(args, kwargs)

        def after_model(_module: nn.Module, _args: Any, _output: Any) -> None:
            recording._after_model()

        handles.append(model.register_forward_pre_hook(before_model, with_kwargs=True))
        handles.append(model.register_forward_hook(after_model, always_call=True))
        for layer, (name, router) in enumerate(routers):
            block = model.get_submodule(name.rpartition(".")[0])

            def before(_module: nn.Module, args: Any, kwargs: Any, layer: int = layer) -> None:
                recording._before_block(layer, args, kwargs)

            handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(router.register_forward_pre_hook(before, with_kwargs=True))
            if not isinstance(router, ReplayableRouter):

                def enter(module: nn.Module, _args: Any) -> None:
                    recording._enter(module)

                def leave(module: nn.Module, _args: Any, _output: Any) -> None:
                    recording._exit(module)

                handles.append(router.register_forward_pre_hook(enter))
                handles.append(router.register_forward_hook(leave, always_call=True))
        token = RECORDINGS.set((*RECORDINGS.get(), recording)) if threads == "context" else None
        if threads == "any":
            listen_in_every_thread(recording, True)
        try:
            yield recording
        finally:
            if token is not None:
                RECORDINGS.reset(token)
            else:
                listen_in_every_thread(recording, False)
    finally:
        for handle in handles:
            handle.remove()
