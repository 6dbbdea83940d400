"""Attention with one fused ``qkv_proj`` instead of ``q_proj`` / ``k_proj`` / ``v_proj``.

One matmul instead of three for the input projections, and one ``nn.Linear`` for a
quantizer or adapter to handle.  The checkpoint keeps its three tensors: the pack's
converter concatenates them on load with an exactly reversible operation
(:class:`hfpatch_core.conversion.SizedConcatenate`) and ``save_pretrained`` splits them
back (grouped-query attention makes the three parts of different sizes).

The forward is the original one with the three projections replaced by one projection
and a split.  transformers changed the attention's cache arguments between 5.3
(``past_key_values``, ``cache_position``, ``update(k, v, layer, cache_kwargs)``) and the
newer releases (``cache``, ``update(k, v, layer, kwargs=kwargs)``); each replacement
class takes whichever convention the installed class it replaces has, read from that
class's signature, so both behave exactly like the original.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn as nn
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

AttentionOutput = tuple[torch.Tensor, torch.Tensor | None]


class FusedQKVAttention(nn.Module):
    """Mixin for a family's attention class: fuses its q/k/v projections into ``qkv_proj``.

    Put it first among the bases, before the family's attention class: ``__init__``
    builds the original module (so that every other attribute — norms, sliding window,
    scaling — is exactly what the installed transformers builds), then replaces the three
    projections by one ``nn.Linear`` of the same input size, their summed output sizes
    and the same bias setting.  Under ``from_pretrained`` this runs on the meta device,
    so building the three projections first costs nothing.

    Class attributes a family sets:
        family_module: the family's modeling module; the forward looks up
            ``apply_rotary_pos_emb``, ``eager_attention_forward`` and
            ``ALL_ATTENTION_FUNCTIONS`` there at call time, as the original does.
        qk_norm: apply ``q_norm`` / ``k_norm`` per head before rotary (qwen3_moe).
        passes_sliding_window: pass ``sliding_window=`` to the attention function
            (qwen3_moe; qwen2_moe's sliding window lives in its attention mask only).
    """

    family_module: ClassVar[ModuleType]
    qk_norm: ClassVar[bool] = False
    passes_sliding_window: ClassVar[bool] = False

    # Set by the family's __init__; declared for the type checker (``Any`` where the
    # families declare their own types).
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
        #: Output sizes of the three parts, in qkv_proj's order.
        self.qkv_sizes: tuple[int, int, int] = (query.out_features, key.out_features, value.out_features)
        self.qkv_proj = nn.Linear(query.in_features, sum(self.qkv_sizes), bias=query.bias is not None)
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value states, ``[batch, heads, seq, head_dim]``, from the fused projection."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
        query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    def _rotate(
        self, query: torch.Tensor, key: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        extra = {"sliding_window": self.sliding_window} if self.passes_sliding_window else {}
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
    assert position_embeddings is not None, "position_embeddings are required"
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
    assert position_embeddings is not None, "position_embeddings are required"
    query, key = self._rotate(query, key, position_embeddings)
    if past_key_values is not None:
        # sin and cos are specific to RoPE models; cache_position is needed for the static cache
        cos, sin = position_embeddings
        cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
        key, value = past_key_values.update(key, value, self.layer_idx, cache_kwargs)
    return self._attend(hidden_states, query, key, value, attention_mask, kwargs)


def forward_for(original: type[nn.Module]) -> Callable[..., AttentionOutput]:
    """The forward matching ``original``'s cache convention.

    Raises:
        ImportError: the installed class takes neither convention; the pack cannot
            reproduce its forward (hfpatch then reports the pack as failed and loads
            the model unpatched, or raises in strict mode).
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
    raise ImportError(
        f"{original.__module__}.{original.__qualname__}.forward takes neither 'cache' nor 'past_key_values' "
        f"({list(parameters)}); hfpatch-pack-qwen-moe does not support this transformers release."
    )


class Qwen2MoeFusedQKVAttention(FusedQKVAttention, Qwen2MoeAttention):
    """``Qwen2MoeAttention`` with a fused ``qkv_proj`` (bias as ``config.qkv_bias``)."""

    family_module = sys.modules[Qwen2MoeAttention.__module__]
    forward = forward_for(Qwen2MoeAttention)


class Qwen3MoeFusedQKVAttention(FusedQKVAttention, Qwen3MoeAttention):
    """``Qwen3MoeAttention`` with a fused ``qkv_proj`` (bias as ``config.attention_bias``), q/k norms kept."""

    family_module = sys.modules[Qwen3MoeAttention.__module__]
    qk_norm = True
    passes_sliding_window = True
    forward = forward_for(Qwen3MoeAttention)
