"""The routing value: which experts each token was routed to, per MoE layer.

* ``Routing`` is one ``LongTensor`` of shape ``(tokens, top_k)`` per router (MoE layer),
  tokens ordered as the routers see them, ``batch × sequence`` flattened row by row
  (``hidden_states.reshape(-1, hidden)``). It is frozen and validated once, here, so
  that the recorder, the replay and vLLM's layout meet on one checked form and the
  replay never sees a malformed selection mid-forward.
* ``Routing.from_vllm`` / ``Routing.to_vllm`` convert vLLM's ``routed_experts``
  layout ``(tokens, num_hidden_layers, top_k)``, ``Routing.from_sglang`` SGLang's flat int32 one
  (``wire`` reads the arrays against the model's ``DecoderLayout``).
* ``RoutingError`` (``errors``) is every error of the pack's API, raised by this module and by
  the replay and the recorder.

This module knows nothing of routers: it sits under every module that does (``errors`` <- ``wire``
<- ``values`` <- ``scope`` <- ...). Where a model's routers sit among its decoder layers (the
``DecoderLayout`` the engine methods need) is read by ``engines``, above the routers; the package's
``__init__`` hands this module that reader (``read_layouts_with``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from .errors import LIVE, RoutingError, shape
from .wire import (
    SGLANG,
    VLLM,
    DecoderLayout,
    checked_layers,
    completion_array,
    decode_int32,
    decode_npy,
    integer_tensor,
    sglang_rows,
)

__all__ = ["LIVE", "Routing", "RoutingError", "join_per_sequence", "read_layouts_with"]

# How a model's ``DecoderLayout`` is read: ``engines.decoder_layout``, which reads the model's routers
# (``routers``, ``discovery``: modules above this one). The package's ``__init__`` sets it, so it is
# set before any module of the pack is used.
_layout_reader: Callable[[torch.nn.Module], DecoderLayout] | None = None


def read_layouts_with(reader: Callable[[torch.nn.Module], DecoderLayout]) -> None:
    """Make ``reader`` what the engine methods (``Routing.from_vllm``, ...) ask a model's ``DecoderLayout``."""
    global _layout_reader
    _layout_reader = reader


def _layout_of(model: torch.nn.Module) -> DecoderLayout:
    if _layout_reader is None:  # only while the package's __init__ is still running
        raise RuntimeError("hfpatch_pack_moe_replay was not imported, so no model's decoder layout can be read.")
    return _layout_reader(model)


# --- the value ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
    """The experts each token was routed to, per MoE layer: a frozen value.

    Attributes:
        layers: one ``torch.long`` tensor of shape ``(tokens, top_k)`` per router, in the
            model's module order (dense layers have no router and no entry). Row ``t`` is
            the ``t``-th token the router saw: ``batch × sequence`` flattened row by row,
            padding included. A row of ``LIVE`` (``-1``) means "keep the live top-k".
        batch_size: how many sequences the tokens are (``tokens == batch_size * seq_len``).

    The tensors are copied (detached, ``torch.long``) at construction, so later in-place
    changes to the inputs do not reach the routing. Two routings are equal when their
    batch sizes and every index are.

    Raises:
        RoutingError: no layer; a layer that is not a 2-D integer tensor; layers of
            different shapes; an id below ``-1``; a row mixing ``LIVE`` and expert ids;
            the same expert twice in a row; ``batch_size`` not dividing the token count.
    """

    layers: tuple[torch.Tensor, ...]
    batch_size: int = 1

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            raise RoutingError(
                "Routing(layers=...) takes a sequence of per-layer (tokens, top_k) tensors, got "
                f"{type(layers).__name__}; for vLLM's routed_experts use Routing.from_vllm(value, model=model)."
            )
        if not layers:
            raise RoutingError("Routing(layers=()) has no layer; pass one (tokens, top_k) tensor per MoE layer.")
        converted = tuple(_index_tensor(layer, position) for position, layer in enumerate(layers))
        expected = shape(converted[0])
        for position, layer in enumerate(converted):
            if shape(layer) != expected:
                raise RoutingError(
                    f"Routing layer {position} has shape {shape(layer)}, layer 0 has {expected}: every layer routes "
                    "the same tokens with the same top_k; pass tensors of one shape (tokens, top_k)."
                )
        batch_size = self.batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RoutingError(f"Routing batch_size must be a positive int, got {batch_size!r}.")
        if expected[0] % batch_size:
            raise RoutingError(
                f"Routing has {expected[0]} tokens, which batch_size={batch_size} does not divide: tokens are "
                "batch_size × seq_len (padding included); pad the sequences to one length (Routing.stack)."
            )
        for position, layer in enumerate(converted):
            _check_ids(layer, position)
        object.__setattr__(self, "layers", converted)
        object.__setattr__(self, "batch_size", batch_size)

    @property
    def num_layers(self) -> int:
        """How many routers (MoE layers) the routing covers."""
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        """How many tokens each router sees: ``batch_size * seq_len``."""
        return int(self.layers[0].shape[0])

    @property
    def seq_len(self) -> int:
        """The length of each sequence (padding included)."""
        return self.num_tokens // self.batch_size

    @property
    def top_k(self) -> int:
        """How many experts each token is routed to."""
        return int(self.layers[0].shape[1])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Routing):
            return NotImplemented
        return (
            self.batch_size == other.batch_size
            and self.num_layers == other.num_layers
            and all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(self.layers, other.layers, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, and tensors are mutable

    def __repr__(self) -> str:
        return (
            f"Routing(num_layers={self.num_layers}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"top_k={self.top_k})"
        )

    # --- vLLM ------------------------------------------------------------------------

    @classmethod
    def from_vllm(cls, value: Any, *, model: torch.nn.Module) -> Routing:
        """The routing of what vLLM returns with ``enable_return_routed_experts``, for ``model``'s routers.

        vLLM's ``routed_experts`` is an array of shape ``(tokens, num_hidden_layers, top_k)``: a slot
        for every decoder layer (a dense layer's is zeros), a row for every token but the last
        sampled one, from prompt row ``SamplingParams.routed_experts_prompt_start`` on. ``model``
        says which decoder layers route (the routers the pack finds, wherever they sit): their
        slots become the routing's layers, in order, and the dense slots are dropped.

        Args:
            value: one of

                * a ``RequestOutput``: the routing of each completion's whole sequence,
                  ``prompt_token_ids + completion.token_ids``, with the tokens vLLM did not report
                  (the prompt rows before ``routed_experts_prompt_start`` and the last token)
                  ``LIVE``; several completions (``n > 1``) are rows of one batch, right-padded
                  with ``LIVE`` to the longest;
                * a ``CompletionOutput``: the rows it reports, as they are;
                * its ``routed_experts`` array (numpy or torch, any integer dtype), or
                  ``(batch, tokens, num_hidden_layers, top_k)`` (``to_vllm``'s batches);
                * the OpenAI server's ``choices[i]["routed_experts"]``: the base64 of an ``.npy`` file.
            model: the model the routing is replayed on (loaded with or without the pack), or any
                module holding it.

        Returns:
            a ``Routing`` with one layer per router of ``model``; ``batch_size`` 1 (the
            completions of a ``RequestOutput``, the batch of a 4-D array). A batch of requests
            is ``Routing.stack([...], padding_side="left")``, as the trainer pads its prompts.

        Raises:
            RoutingError: what vLLM sent does not fit ``model`` (its layer count, top-k, an expert
                id the router does not have, a dense layer's slot that is not zeros, an expert
                twice for a token), saying what was sent and what the model has; vLLM returned
                no routed experts (the engine runs without ``enable_return_routed_experts``);
                the array's rows do not fit the request's tokens; ``model`` has no router.
        """
        layout = _layout_of(model)
        if hasattr(value, "outputs") and hasattr(value, "prompt_token_ids"):
            return _from_vllm_request(value, layout)
        if hasattr(value, "routed_experts") and hasattr(value, "token_ids"):
            array, _ = completion_array(value, "CompletionOutput")
            return _engine_routing(array, layout, "CompletionOutput.routed_experts")
        if isinstance(value, (str, bytes)):
            return _engine_routing(decode_npy(value), layout, "the server's routed_experts")
        return _engine_routing(integer_tensor(value, "routed_experts"), layout, "routed_experts")

    @classmethod
    def from_sglang(cls, value: Any, *, model: torch.nn.Module, start_len: int | None = None) -> Routing:
        """The routing of what SGLang returns with ``return_routed_experts``, for ``model``'s routers.

        SGLang (a server started with ``--enable-return-routed-experts``, a request with
        ``"return_routed_experts": true``) sends ``meta_info["routed_experts"]``: the base64 of the
        raw bytes of a flat ``int32`` array ``[tokens, num_hidden_layers, top_k]``, a slot for every
        decoder layer (a dense layer's is zeros), a row for every token of prompt + completion but
        the last, from the request's ``routed_experts_start_len`` on. The array carries no shape:
        ``model`` gives it (its decoder layers and top-k), and says which slots are its routers'.

        Args:
            value: one of

                * a ``/generate`` response (or ``Engine.generate``'s dict), or its ``meta_info``: the
                  routing of the whole sequence, ``prompt_tokens + completion_tokens`` tokens, with
                  the rows SGLang did not report (before ``routed_experts_start_len``, the last
                  token) ``LIVE``;
                * the string ``meta_info["routed_experts"]`` (the OpenAI-compatible routes:
                  ``response["sglext"]["routed_experts"]``): its reported rows, as they are;
                * the decoded array (flat, or ``(tokens, num_hidden_layers, top_k)``), any integer dtype.
            model: the model the routing is replayed on (loaded with or without the pack), or any
                module holding it.
            start_len: the ``routed_experts_start_len`` the request sent; with a response, its rows
                are checked against it (without it, the skipped rows are what the counts leave).

        Returns:
            a ``Routing`` of batch size 1 with one layer per router of ``model``.

        Raises:
            RoutingError: as ``from_vllm``, saying what SGLang sent and what the model has; also an
                array whose length is no whole number of the model's ``num_hidden_layers × top_k``
                tokens, a string that is not base64 of int32 values, a response without routes
                (the server or the request did not ask for them) or whose rows do not fit its
                token counts and ``start_len``.
        """
        layout = _layout_of(model)
        if isinstance(value, dict):
            return _from_sglang_response(value, layout, start_len)
        if isinstance(value, (str, bytes)):
            rows = sglang_rows(decode_int32(value), layout, "routed_experts")
            return _engine_routing(rows, layout, "routed_experts", SGLANG)
        tensor = integer_tensor(value, "routed_experts", SGLANG)
        if tensor.dim() == 1:
            tensor = sglang_rows(tensor, layout, "routed_experts")
        return _engine_routing(tensor, layout, "routed_experts", SGLANG)

    def to_vllm(self, *, model: torch.nn.Module | None = None) -> torch.Tensor:
        """This routing in vLLM's ``routed_experts`` layout.

        Args:
            model: the model it routes: every decoder layer gets a slot, a dense layer's is
                zeros, as vLLM returns it (``Routing.from_vllm(routing.to_vllm(model=model),
                model=model) == routing``). Without it, one slot per routing layer.

        Returns:
            a CPU ``torch.long`` tensor of shape ``(seq_len, layers, top_k)`` when
            ``batch_size`` is 1, else ``(batch_size, seq_len, layers, top_k)``
            (``.numpy()`` for an array). ``LIVE`` rows stay ``-1``.

        Raises:
            RoutingError: the routing's layer count or top-k is not ``model``'s.
        """
        if model is not None:
            return self._to_decoder_layers(_layout_of(model))
        stacked = torch.stack([layer.cpu() for layer in self.layers], dim=1)
        if self.batch_size == 1:
            return stacked
        return stacked.reshape(self.batch_size, self.seq_len, self.num_layers, self.top_k)

    def _to_decoder_layers(self, layout: DecoderLayout) -> torch.Tensor:
        """``to_vllm(model=...)``: a slot per decoder layer of ``layout``, a dense one's zeros."""
        if self.num_layers != len(layout.moe_layers) or self.top_k != layout.top_k:
            raise RoutingError(
                f"Routing.to_vllm: the routing has {self.num_layers} layers of top_k {self.top_k}; {layout.describe()}."
            )
        full = torch.zeros(self.num_tokens, layout.num_layers, self.top_k, dtype=torch.long)
        for layer, indices in zip(layout.moe_layers, self.layers, strict=True):
            full[:, layer] = indices.cpu()
        if self.batch_size == 1:
            return full
        return full.reshape(self.batch_size, self.seq_len, layout.num_layers, self.top_k)

    # --- padding and batching ----------------------------------------------------------

    def padded(self, seq_len: int, *, side: Literal["left", "right"] = "right") -> Routing:
        """Each sequence extended to ``seq_len`` tokens with ``LIVE`` rows.

        Use it where the forward pass routes tokens the routing does not cover: the padding
        of a batch, or the last generated token (which ``generate`` never feeds back, so a
        routing recorded during ``generate`` has ``prompt + new_tokens - 1`` positions).

        Args:
            seq_len: the padded length, at least ``seq_len``.
            side: ``"right"`` appends, ``"left"`` prepends (for a left-padded batch).

        Returns:
            a new ``Routing`` with the same ``batch_size``.
        """
        if side not in ("left", "right"):
            raise RoutingError(f"Routing.padded(side={side!r}): side must be 'left' or 'right'.")
        if seq_len < self.seq_len:
            raise RoutingError(
                f"Routing.padded({seq_len}) is shorter than the routing's seq_len {self.seq_len}; "
                "pass a length of at least seq_len."
            )
        extra = seq_len - self.seq_len
        layers = []
        for layer in self.layers:
            padding = torch.full((self.batch_size * extra, self.top_k), LIVE, dtype=torch.long, device=layer.device)
            parts = [(layer, self.seq_len), (padding, extra)]
            layers.append(join_per_sequence(parts if side == "right" else parts[::-1], self.batch_size))
        return Routing(tuple(layers), batch_size=self.batch_size)

    @classmethod
    def stack(
        cls,
        routings: Sequence[Routing],
        *,
        padding_side: Literal["left", "right"] = "right",
        seq_len: int | None = None,
    ) -> Routing:
        """One routing for a batch of sequences, padded to one length with ``LIVE`` rows.

        Args:
            routings: the routings of the batch's sequences (or sub-batches), in batch order,
                e.g. ``[Routing.from_vllm(output, model=model) for output in outputs]``.
            padding_side: where the tokenizer pads the training batch.
            seq_len: the padded length (default: the longest routing's).

        Returns:
            a ``Routing`` whose ``batch_size`` is the sum of theirs.

        Raises:
            RoutingError: no routing, or routings of different layer counts or top-k.
        """
        if not routings or not all(isinstance(routing, Routing) for routing in routings):
            raise RoutingError("Routing.stack takes a non-empty sequence of Routing objects.")
        first = routings[0]
        for position, routing in enumerate(routings):
            if (routing.num_layers, routing.top_k) != (first.num_layers, first.top_k):
                raise RoutingError(
                    f"Routing.stack: routing {position} has {routing.num_layers} layers of top_k {routing.top_k}, "
                    f"routing 0 has {first.num_layers} of top_k {first.top_k}; stack routings of one model."
                )
        length = max(routing.seq_len for routing in routings) if seq_len is None else seq_len
        padded = [routing.padded(length, side=padding_side) for routing in routings]
        layers = tuple(
            torch.cat([routing.layers[layer].to(first.layers[layer].device) for routing in padded])
            for layer in range(first.num_layers)
        )
        return cls(layers, batch_size=sum(routing.batch_size for routing in routings))

    # --- rows ----------------------------------------------------------------------------

    def select(self, rows: int | slice | Sequence[int] | torch.Tensor) -> Routing:
        """The routing of some rows (sequences) of the batch, in the order given.

        What a trainer does to a batch (shuffle, split into micro-batches, drop rows)
        it does to the routing with this: ``routing.select(permutation)``,
        ``routing.select(slice(0, 4))``.

        Args:
            rows: a row number, a slice, a sequence of row numbers or a 1-D integer tensor
                (a boolean mask of ``batch_size`` rows also works). Negative numbers count from the end.

        Returns:
            a ``Routing`` of ``len(rows)`` sequences of ``seq_len`` tokens.

        Raises:
            RoutingError: no row is selected, or a row number is out of range.
        """
        numbers = self._row_numbers(rows)
        layers = tuple(
            layer.reshape(self.batch_size, self.seq_len, self.top_k)[numbers.to(layer.device)].reshape(-1, self.top_k)
            for layer in self.layers
        )
        return Routing(layers, batch_size=int(numbers.numel()))

    def rows(self) -> tuple[Routing, ...]:
        """Each sequence of the batch as a routing of its own (``batch_size`` 1), in order.

        ``Routing.stack(routing.rows())`` gives the routing back; routings of rows of
        different lengths go into one batch with ``Routing.stack`` (which pads them).
        """
        return tuple(self.select(row) for row in range(self.batch_size))

    def truncated(self, seq_len: int, *, side: Literal["left", "right"] = "right") -> Routing:
        """Each sequence cut to ``seq_len`` tokens: the inverse of ``padded``.

        Args:
            seq_len: the new length, between 1 and ``seq_len``.
            side: ``"right"`` keeps the first ``seq_len`` tokens (drops the end),
                ``"left"`` keeps the last ones (drops left padding).

        Returns:
            a new ``Routing`` with the same ``batch_size``.
        """
        if side not in ("left", "right"):
            raise RoutingError(f"Routing.truncated(side={side!r}): side must be 'left' or 'right'.")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= self.seq_len:
            raise RoutingError(
                f"Routing.truncated({seq_len!r}) needs a length between 1 and the routing's seq_len {self.seq_len}; "
                "to lengthen a routing use Routing.padded."
            )
        start = 0 if side == "right" else self.seq_len - seq_len
        layers = tuple(
            layer.reshape(self.batch_size, self.seq_len, self.top_k)[:, start : start + seq_len].reshape(-1, self.top_k)
            for layer in self.layers
        )
        return Routing(layers, batch_size=self.batch_size)

    def to_tensor(self) -> torch.Tensor:
        """The routing as one tensor with a row per sequence: ``(batch_size, seq_len, num_layers, top_k)``.

        It travels with the other per-row tensors of a batch (``input_ids``,
        ``attention_mask``) through a trainer's shuffling, splitting and concatenation;
        ``Routing.from_tensor`` turns it back. It stays on the routing's device.
        """
        stacked = torch.stack(list(self.layers), dim=1)
        return stacked.reshape(self.batch_size, self.seq_len, self.num_layers, self.top_k)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Routing:
        """The routing of a ``(batch, seq_len, num_layers, top_k)`` tensor (``to_tensor``'s inverse).

        Raises:
            RoutingError: the tensor is not 4-D, or holds invalid ids.
        """
        value = _as_tensor(tensor)
        if value.dim() != 4:
            raise RoutingError(
                f"Routing.from_tensor expects a (batch, seq_len, num_layers, top_k) tensor (Routing.to_tensor), got "
                f"shape {shape(value)}."
            )
        batch, length, num_layers, top_k = (int(size) for size in value.shape)
        flat = value.reshape(batch * length, num_layers, top_k)
        return cls(tuple(flat[:, layer, :] for layer in range(num_layers)), batch_size=batch)

    def _row_numbers(self, rows: int | slice | Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(rows, slice):
            numbers = torch.arange(self.batch_size)[rows]
        else:
            try:
                numbers = torch.as_tensor(rows).reshape(-1)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise RoutingError(
                    f"Routing.select takes a row number, a slice, row numbers or a mask, got {rows!r} ({exc})."
                ) from None
            if numbers.dtype == torch.bool:
                if numbers.numel() != self.batch_size:
                    raise RoutingError(
                        f"Routing.select: a mask of {numbers.numel()} rows for a routing of {self.batch_size} rows; "
                        "pass one boolean per row."
                    )
                numbers = numbers.nonzero().reshape(-1)
            elif (numbers.is_floating_point() or numbers.is_complex()) and numbers.numel():
                raise RoutingError(f"Routing.select takes integer row numbers, got dtype {numbers.dtype}.")
        numbers = numbers.to(device="cpu", dtype=torch.long)
        if numbers.numel() == 0:
            raise RoutingError("Routing.select selects no row; a routing has at least one row.")
        if bool(((numbers < -self.batch_size) | (numbers >= self.batch_size)).any()):
            raise RoutingError(
                f"Routing.select: row numbers {numbers.tolist()} out of range for a routing of {self.batch_size} rows."
            )
        return numbers % self.batch_size


# --- an engine's routes, as a Routing --------------------------------------------------


def _engine_routing(tensor: torch.Tensor, layout: DecoderLayout, what: str, api: str = VLLM) -> Routing:
    """The routing of an array of vLLM's layout (SGLang's once shaped), checked against ``layout``."""
    layers, batch_size = checked_layers(tensor, layout, what, api)
    return Routing(layers, batch_size=batch_size)


def _from_vllm_request(request: Any, layout: DecoderLayout) -> Routing:
    """A ``RequestOutput``: each completion's sequence ``prompt + completion``, unreported tokens ``LIVE``."""
    prompt = request.prompt_token_ids
    if prompt is None:
        raise RoutingError(
            "Routing.from_vllm: the RequestOutput has no prompt_token_ids (a prompt given as embeddings?), so the "
            "routing cannot be laid over its sequence; pass each CompletionOutput (its reported rows only)."
        )
    completions = list(request.outputs)
    if not completions:
        raise RoutingError("Routing.from_vllm: the RequestOutput has no completion.")
    rows = []
    for number, completion in enumerate(completions):
        what = f"RequestOutput.outputs[{number}].routed_experts"
        array, generated = completion_array(completion, what)
        reported = _engine_routing(array, layout, what)
        length = len(prompt) + generated
        # vLLM reports the rows from routed_experts_prompt_start to the last token but one
        skipped = length - 1 - reported.seq_len
        if not 0 <= skipped <= len(prompt):
            raise RoutingError(
                f"Routing.from_vllm: {what} has {reported.seq_len} rows; a sequence of {len(prompt)} prompt and "
                f"{generated} generated tokens has {length - 1} routed tokens (the last one is never fed back), "
                "from routed_experts_prompt_start on: pass the RequestOutput this array came with."
            )
        rows.append(reported.padded(length - 1, side="left").padded(length))
    return Routing.stack(rows)


def _from_sglang_response(response: dict[str, Any], layout: DecoderLayout, start_len: int | None) -> Routing:
    """A response of SGLang's ``/generate`` (or ``Engine.generate``): the routing of ``prompt + completion``.

    SGLang reports rows ``[routed_experts_start_len, prompt_tokens + completion_tokens - 1)``; the
    rows before and the last token are ``LIVE``.
    """
    meta = response.get("meta_info", response)
    encoded = meta.get("routed_experts") if isinstance(meta, dict) else None
    if encoded is None:
        raise RoutingError(
            f"{SGLANG}: the response has no meta_info['routed_experts']: SGLang returns them when the server is "
            'started with --enable-return-routed-experts and the request sets "return_routed_experts": true.'
        )
    prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        raise RoutingError(
            f"{SGLANG}: the response's meta_info has no prompt_tokens and completion_tokens, so its routes cannot "
            "be laid over the sequence; pass meta_info['routed_experts'] for its reported rows only."
        )
    reported = _engine_routing(
        sglang_rows(decode_int32(encoded), layout, "meta_info['routed_experts']"),
        layout,
        "meta_info['routed_experts']",
        SGLANG,
    )
    length = prompt + completion
    skipped = length - 1 - reported.seq_len
    if not 0 <= skipped <= prompt or (start_len is not None and skipped != start_len):
        sent = "" if start_len is None else f" from routed_experts_start_len={start_len}"
        raise RoutingError(
            f"{SGLANG}: meta_info['routed_experts'] has {reported.seq_len} rows; a sequence of {prompt} prompt and "
            f"{completion} generated tokens has {length - 1} routed tokens (the last one is never fed back){sent}, "
            f"so {length - 1 - (start_len or 0)} rows were expected: pass the response these routes came with."
        )
    return reported.padded(length - 1, side="left").padded(length)


def _as_tensor(value: Any) -> torch.Tensor:
    """``value`` as a tensor: a tensor detached, anything else (vLLM's numpy arrays, lists) through numpy."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    import numpy

    return torch.tensor(numpy.asarray(value))


def join_per_sequence(parts: Sequence[tuple[torch.Tensor, int]], batch_size: int) -> torch.Tensor:
    """Flattened ``(tokens, top_k)`` parts joined sequence by sequence, flattened again.

    Part ``(indices, length)`` holds ``batch_size`` sequences of ``length`` tokens, row by
    row; sequence ``b`` of the result is sequence ``b`` of every part, in order (padding
    appended or prepended, or the forward passes of a generation one after the other).
    """
    top_k = int(parts[0][0].shape[1])
    joined = torch.cat([indices.reshape(batch_size, length, top_k) for indices, length in parts], dim=1)
    return joined.reshape(-1, top_k)


def _index_tensor(value: Any, position: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = _as_tensor(value)
        except (TypeError, ValueError) as exc:
            raise RoutingError(
                f"Routing layer {position} is {type(value).__name__}, not a tensor of expert ids ({exc})."
            ) from None
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise RoutingError(
            f"Routing layer {position} has dtype {value.dtype}; expert ids are integers (router_indices, or "
            "vLLM's routed_experts): pass an integer tensor."
        )
    if value.dim() != 2 or value.shape[0] == 0 or value.shape[1] == 0:
        raise RoutingError(
            f"Routing layer {position} has shape {shape(value)}; each layer is (tokens, top_k) with tokens = "
            "batch × seq_len flattened row by row (for a (batch, seq_len, top_k) tensor use .reshape(-1, top_k))."
        )
    return value.detach().to(torch.long, copy=True).contiguous()


def _check_ids(layer: torch.Tensor, position: int) -> None:
    if bool((layer < LIVE).any()):
        raise RoutingError(
            f"Routing layer {position} holds expert id {int(layer.min())}; ids are >= 0, or {LIVE} (LIVE) for a "
            "token the router routes itself."
        )
    live = layer == LIVE
    mixed = live.any(dim=1) & ~live.all(dim=1)
    if bool(mixed.any()):
        token = int(mixed.nonzero()[0, 0])
        raise RoutingError(
            f"Routing layer {position}, token {token}: {layer[token].tolist()} mixes LIVE ({LIVE}) with expert ids; "
            "a token is either replayed (all top_k ids) or routed live (all LIVE)."
        )
    ordered = layer.sort(dim=1).values
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != LIVE)).any(dim=1)
    if bool(repeated.any()):
        token = int(repeated.nonzero()[0, 0])
        raise RoutingError(
            f"Routing layer {position}, token {token}: {layer[token].tolist()} names an expert twice; a router "
            "selects top_k distinct experts per token."
        )
