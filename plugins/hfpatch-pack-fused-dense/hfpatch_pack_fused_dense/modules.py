"""The fused replacement classes: one ``qkv_proj`` per attention, one ``gate_up_proj`` per MLP.

Each replacement is built at runtime as a subclass of the installed transformers class it
replaces (as transformers' own ``fusion_mapping`` builds its fused patch embeddings), so
that ``__init__`` builds exactly what the original builds (norms, sliding window,
scaling, sizes from the config) before the projections are swapped, and ``isinstance``
checks (output recorders, ``_no_split_modules``, PEFT) still see the original class.

The forwards are the originals' with the projections fused:

* MLP: ``down_proj(act_fn(gate) * up)`` with ``gate, up = gate_up_proj(x).chunk(2)``;
* attention: the q/k/v states are three splits of one matmul; rotary, the q/k norms
  (qwen3), the KV cache, the attention interface, the sliding window and ``o_proj`` are
  as in the original.  transformers changed the attention's cache arguments after 5.3
  (``past_key_values`` + ``cache_position`` -> ``cache``); each class takes the
  convention of the installed class it replaces, read from that class's signature.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn as nn

AttentionOutput = tuple[torch.Tensor, torch.Tensor | None]


class SlidingWindow(enum.Enum):
    """Where an attention's forward takes the ``sliding_window=`` it passes to the attention function."""

    #: Passes none (llama, qwen2_moe: a window lives in the mask only).
    NONE = "none"
    #: ``getattr(self.config, "sliding_window", None)`` (mistral).
    CONFIG = "config"
    #: ``self.sliding_window``, set per layer from ``config.layer_types`` (qwen2, qwen3).
    LAYER = "layer"


@dataclasses.dataclass(frozen=True)
class AttentionFlavor:
    """What an attention family's forward does besides the projections.

    Attributes:
        name: the family whose forward this is (``"llama"``), for messages.
        qk_norm: ``q_norm`` / ``k_norm`` applied per head before rotary (qwen3).
        sliding_window: what the forward passes as ``sliding_window=``.
    """

    name: str
    qk_norm: bool = False
    sliding_window: SlidingWindow = SlidingWindow.NONE


#: The four attention forwards of the covered families (qwen2_moe's is llama's, qwen3_moe's
#: is qwen3's, token for token; the tests check this against the installed sources).
LLAMA = AttentionFlavor("llama")
MISTRAL = AttentionFlavor("mistral", sliding_window=SlidingWindow.CONFIG)
QWEN2 = AttentionFlavor("qwen2", sliding_window=SlidingWindow.LAYER)
QWEN3 = AttentionFlavor("qwen3", qk_norm=True, sliding_window=SlidingWindow.LAYER)


def _linear_like(reference: nn.Linear, out_features: int) -> nn.Linear:
    """An ``nn.Linear`` with ``reference``'s input size, bias setting, device and dtype."""
    return nn.Linear(
        reference.in_features,
        out_features,
        bias=reference.bias is not None,
        device=reference.weight.device,
        dtype=reference.weight.dtype,
    )


class FusedGateUpMLP(nn.Module):
    """Mixin for a SiLU-gated MLP class: fuses ``gate_proj`` and ``up_proj`` into ``gate_up_proj``.

    First among the bases, before the original MLP class.  Rows ``[0, I)`` of
    ``gate_up_proj.weight`` are ``gate_proj``'s, rows ``[I, 2I)`` ``up_proj``'s (the
    pack's converter concatenates them in this order).
    """

    gate_up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        gate, up = self.get_submodule("gate_proj"), self.get_submodule("up_proj")
        assert isinstance(gate, nn.Linear) and isinstance(up, nn.Linear)
        #: The intermediate size (the output size of each half).
        self.gate_up_sizes: tuple[int, int] = (gate.out_features, up.out_features)
        self.gate_up_proj = _linear_like(gate, sum(self.gate_up_sizes))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.gate_up_sizes, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class FusedQKVAttention(nn.Module):
    """Mixin for an attention class: fuses ``q_proj`` / ``k_proj`` / ``v_proj`` into ``qkv_proj``.

    First among the bases, before the original attention class.  The rows of
    ``qkv_proj.weight`` are ``q_proj``'s, then ``k_proj``'s, then ``v_proj``'s (sizes
    ``heads * head_dim``, ``kv_heads * head_dim``, ``kv_heads * head_dim``).

    Class attributes set by :func:`fused_attention_class`:
        flavor: what the original forward does besides the projections.
        family_module: the original's modeling module; ``apply_rotary_pos_emb``,
            ``eager_attention_forward`` and ``ALL_ATTENTION_FUNCTIONS`` are looked up
            there at call time, as the original does.
    """

    flavor: ClassVar[AttentionFlavor]
    family_module: ClassVar[ModuleType]

    # Set by the original's __init__; declared for the type checker.
    config: Any
    layer_idx: int
    head_dim: int
    scaling: float
    attention_dropout: float
    sliding_window: int | None
    q_norm: Any
    k_norm: Any
    o_proj: Any

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        query, key, value = (self.get_submodule(name) for name in ("q_proj", "k_proj", "v_proj"))
        assert isinstance(query, nn.Linear) and isinstance(key, nn.Linear) and isinstance(value, nn.Linear)
        #: Output sizes of the three parts, in ``qkv_proj``'s order.
        self.qkv_sizes: tuple[int, int, int] = (query.out_features, key.out_features, value.out_features)
        self.qkv_proj = _linear_like(query, sum(self.qkv_sizes))
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value states, ``[batch, heads, seq, head_dim]``, from the fused projection."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
        query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
        if self.flavor.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    def _rotate(
        self, query: torch.Tensor, key: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if position_embeddings is None:
            raise TypeError(f"{type(self).__name__}.forward() needs position_embeddings (cos, sin), got None")
        cos, sin = position_embeddings
        rotated: tuple[torch.Tensor, torch.Tensor] = self.family_module.apply_rotary_pos_emb(query, key, cos, sin)
        return rotated

    def _attend(
        self,
        hidden_states: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> AttentionOutput:
        family = self.family_module
        attention_interface: Callable[..., AttentionOutput] = family.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, family.eager_attention_forward
        )
        window = self.flavor.sliding_window
        extra: dict[str, Any] = {}
        if window is SlidingWindow.LAYER:
            extra["sliding_window"] = self.sliding_window
        elif window is SlidingWindow.CONFIG:
            extra["sliding_window"] = getattr(self.config, "sliding_window", None)
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **extra,
            **kwargs,
        )
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


def _forward_with_cache(
    self: FusedQKVAttention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> AttentionOutput:
    """The forward of transformers releases whose attention takes ``cache`` (after 5.3)."""
    query, key, value = self._project(hidden_states)
    query, key = self._rotate(query, key, position_embeddings)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    return self._attend(hidden_states, query, key, value, attention_mask, kwargs)


def _forward_with_past_key_values(
    self: FusedQKVAttention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    cache_position: torch.LongTensor | None = None,
    **kwargs: Any,
) -> AttentionOutput:
    """The forward of transformers 5.3, whose attention takes ``past_key_values`` and ``cache_position``."""
    query, key, value = self._project(hidden_states)
    query, key = self._rotate(query, key, position_embeddings)
    if past_key_values is not None:
        assert position_embeddings is not None  # checked by _rotate
        cos, sin = position_embeddings
        # the static cache needs cache_position; sin and cos are for RoPE-aware caches
        cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
        key, value = past_key_values.update(key, value, self.layer_idx, cache_kwargs)
    return self._attend(hidden_states, query, key, value, attention_mask, kwargs)


def forward_for(original: type[nn.Module]) -> Callable[..., AttentionOutput]:
    """The fused forward matching ``original``'s cache convention.

    Raises:
        TypeError: the installed class takes neither ``cache`` nor ``past_key_values``;
            the pack cannot reproduce its forward (hfpatch then reports the pack as
            failed for this load and the model loads unpatched, or raises in strict mode).
    """
    parameters = inspect.signature(original.forward).parameters
    if "cache" in parameters:
        from transformers.utils.deprecation import deprecate_kwarg

        # The original accepts the old name with a deprecation warning; so does this one.
        wrapped: Callable[..., AttentionOutput] = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(
            _forward_with_cache
        )
        return wrapped
    if "past_key_values" in parameters:
        return _forward_with_past_key_values
    raise TypeError(
        f"{original.__module__}.{original.__qualname__}.forward takes neither 'cache' nor 'past_key_values' "
        f"({list(parameters)}); hfpatch-pack-fused-dense does not support this transformers release."
    )


_CLASSES: dict[tuple[type[nn.Module], str], type[nn.Module]] = {}
_CLASSES_LOCK = threading.Lock()


def _publish(name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> type[nn.Module]:
    cls: type[nn.Module] = type(name, bases, {"__module__": __name__, "__qualname__": name, **namespace})
    # Reachable as hfpatch_pack_fused_dense.modules.<name> once built (pickle, copy by reference).
    setattr(sys.modules[__name__], name, cls)
    return cls


def fused_mlp_class(original: type[nn.Module]) -> type[nn.Module]:
    """The ``gate_up_proj`` replacement of MLP class ``original`` (``FusedGateUp<Original>``), built once."""
    with _CLASSES_LOCK:
        key = (original, "mlp")
        if key not in _CLASSES:
            _CLASSES[key] = _publish(
                f"FusedGateUp{original.__name__}",
                (FusedGateUpMLP, original),
                {"__doc__": f"``{original.__name__}`` with one fused ``gate_up_proj`` (hfpatch-pack-fused-dense)."},
            )
        return _CLASSES[key]


def fused_attention_class(original: type[nn.Module], flavor: AttentionFlavor) -> type[nn.Module]:
    """The ``qkv_proj`` replacement of attention class ``original`` (``FusedQKV<Original>``), built once.

    Raises:
        TypeError: see :func:`forward_for`.
    """
    with _CLASSES_LOCK:
        key = (original, f"attention/{flavor.name}")
        if key not in _CLASSES:
            _CLASSES[key] = _publish(
                f"FusedQKV{original.__name__}",
                (FusedQKVAttention, original),
                {
                    "__doc__": f"``{original.__name__}`` with one fused ``qkv_proj`` (hfpatch-pack-fused-dense).",
                    "flavor": flavor,
                    "family_module": sys.modules[original.__module__],
                    "forward": forward_for(original),
                },
            )
        return _CLASSES[key]


def __getattr__(name: str) -> type[nn.Module]:
    """``FusedQKV<Attention>`` / ``FusedGateUp<MLP>`` of a covered family, built on first access.

    Pickle finds classes by module and name; this lets a process that has not loaded a
    model of that family yet unpickle one (``torch.load`` of a whole model, a copy sent
    to a worker process).
    """
    if not name.startswith("Fused"):  # e.g. __path__, asked while the package itself imports
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import FAMILIES, _modeling

    for model_type, family in FAMILIES.items():
        if name == f"FusedQKV{family.attention}":
            return fused_attention_class(getattr(_modeling(model_type), family.attention), family.flavor)
        if name == f"FusedGateUp{family.mlp}":
            return fused_mlp_class(getattr(_modeling(model_type), family.mlp))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
