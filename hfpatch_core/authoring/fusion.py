"""Fused projections: one ``nn.Linear`` standing for several that read the same input.

A pack that fuses ``q_proj`` / ``k_proj`` / ``v_proj`` into one ``qkv_proj`` (one matmul
instead of three, one ``nn.Linear`` for a quantizer or adapter to handle) subclasses the
installed attention class with ``FusedQKVAttentionBase`` first among the bases and
sets its forward with ``forward_for``; the checkpoint keeps its three tensors, which
the pack's converter concatenates with ``SizedConcatenate``.

The fused forward is the llama-style attention forward (as in llama, mistral, qwen2,
qwen3 and their MoE variants) with the three projections replaced by one projection and
a split; what differs between families (the q/k norms, what ``sliding_window=`` the
attention function gets) is set by the subclass.  transformers changed the attention's
cache arguments after 5.3 (``past_key_values`` + ``cache_position`` -> ``cache``), so
``forward_for`` picks the convention of the class being replaced.

Imported by its full name (``hfpatch_core.authoring.fusion``): it imports torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn as nn

from .packing import local_sizes, packed_outputs, record_sizes
from .peft import watch_peft

__all__ = [
    "QKV_PROJECTIONS",
    "AttentionOutput",
    "FusedQKVAttentionBase",
    "forward_for",
    "fuse_projections",
    "linear_like",
    "local_sizes",
]

#: What an attention forward returns: the output and the attention weights (or None).
AttentionOutput = tuple[torch.Tensor, torch.Tensor | None]

#: The projections ``qkv_proj`` stands for, in the order of its rows.
QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def linear_like(reference: nn.Linear, out_features: int) -> nn.Linear:
    """A new ``nn.Linear`` with ``reference``'s input size, bias setting, device and dtype.

    Args:
        reference: the linear whose settings the new one takes.
        out_features: the new linear's output size.

    Returns:
        The new linear, initialised as ``nn.Linear`` initialises.
    """
    return nn.Linear(
        reference.in_features,
        out_features,
        bias=reference.bias is not None,
        device=reference.weight.device,
        dtype=reference.weight.dtype,
    )


def fuse_projections(module: nn.Module, parts: Sequence[str], fused: str) -> tuple[int, ...]:
    """Replace ``module``'s linear children ``parts`` by one child ``fused`` of their summed output size.

    The rows of ``fused``'s weight (and bias) are meant to hold the parts' rows in the
    order given; this builds the module only, and loading the concatenated weights is
    the converter's job.  The sizes are recorded on ``module``
    (``hfpatch_core.authoring.packing.record_sizes``): with the class's ``hfpatch_packed_modules``
    declaration, PEFT adapters then target the original names.

    Args:
        module: the module holding the parts (an attention or MLP, once its own
            ``__init__`` has run).
        parts: the names of the child ``nn.Linear`` modules to fuse, in row order.
        fused: the name of the fused child.

    Returns:
        The parts' output sizes, in order: the split sizes of the fused output.

    Raises:
        TypeError: a part is not an ``nn.Linear``.
        ValueError: ``parts`` is empty, or the parts differ in input size, bias
            setting, dtype or device, so that no single ``nn.Linear`` can stand for them.
    """
    if not parts:
        raise ValueError(f"{type(module).__name__}: no projections to fuse into {fused}")
    linears: list[nn.Linear] = []
    for name in parts:
        linear = module.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{type(module).__name__}.{name} is a {type(linear).__name__}, not an nn.Linear")
        linears.append(linear)
    settings = [(p.in_features, p.bias is not None, p.weight.dtype, p.weight.device) for p in linears]
    if len(set(settings)) > 1:
        described = ", ".join(
            f"{name} (in_features={size}, bias={bias}, {dtype}, {device})"
            for name, (size, bias, dtype, device) in zip(parts, settings, strict=True)
        )
        raise ValueError(f"{type(module).__name__}: cannot fuse {described} into one {fused}")
    sizes = tuple(linear.out_features for linear in linears)
    setattr(module, fused, linear_like(linears[0], sum(sizes)))
    for name in parts:
        delattr(module, name)
    record_sizes(module, fused, sizes)
    watch_peft()  # also for a model patched in place (hfpatch_core.apply), which secure() does not see
    return sizes


class FusedQKVAttentionBase(nn.Module):
    """Mixin for a llama-style attention class: fuses ``q_proj`` / ``k_proj`` / ``v_proj`` into ``qkv_proj``.

    Put it (or a pack's subclass of it) first among the bases, before the installed
    attention class, and set ``forward`` with ``forward_for``.  ``__init__`` builds
    the original module, so that every other attribute (norms, sliding window, scaling,
    sizes from the config) is exactly what the installed transformers builds, then
    replaces the three projections by one ``nn.Linear``.  Under ``from_pretrained`` this
    runs on the meta device, so building the three projections first costs nothing.
    The rows of ``qkv_proj.weight`` are ``q_proj``'s, then ``k_proj``'s, then
    ``v_proj``'s (sizes ``heads * head_dim``, ``kv_heads * head_dim``,
    ``kv_heads * head_dim``).

    Attributes:
        family_module: the original class's modeling module (class attribute);
            ``apply_rotary_pos_emb``, ``eager_attention_forward`` and
            ``ALL_ATTENTION_FUNCTIONS`` are looked up there at call time, as the
            original does.
        qk_norm: apply ``q_norm`` / ``k_norm`` per head before rotary, as qwen3 does
            (class attribute, default False).
        qkv_sizes: the output sizes of the three parts, in ``qkv_proj``'s order.
    """

    family_module: ClassVar[ModuleType]
    qk_norm: ClassVar[bool] = False
    #: What ``qkv_proj`` stands for (``hfpatch_core.authoring.packing``): adapters name these.
    hfpatch_packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_proj": QKV_PROJECTIONS}

    # Set by the original's __init__; declared for the type checker (``Any`` where the
    # families declare types of their own).
    config: Any
    layer_idx: int
    head_dim: int
    scaling: float
    attention_dropout: float
    sliding_window: int | None
    q_norm: Any
    k_norm: Any
    o_proj: Any
    # Set by name (fuse_projections), which the type checker cannot follow.
    qkv_proj: nn.Linear

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        query, key, value = fuse_projections(self, QKV_PROJECTIONS, "qkv_proj")
        self.qkv_sizes: tuple[int, int, int] = (query, key, value)

    def _attention_kwargs(self) -> dict[str, Any]:
        """The family-specific keyword arguments of the attention function (``sliding_window=``); none here."""
        return {}

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value states, ``[batch, heads, seq, head_dim]``, from the fused projection."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = packed_outputs(self, "qkv_proj", self.qkv_sizes, hidden_states)
        query, key, value = query.view(hidden_shape), key.view(hidden_shape), value.view(hidden_shape)
        if self.qk_norm:
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
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **self._attention_kwargs(),
            **kwargs,
        )
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


def _forward_with_cache(
    self: FusedQKVAttentionBase,
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
    self: FusedQKVAttentionBase,
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


def forward_for(
    original: type[nn.Module], *, pack: str, error: type[Exception] = TypeError
) -> Callable[..., AttentionOutput]:
    """The fused forward matching the cache convention of ``original``'s forward.

    Where ``original`` takes ``cache``, the fused forward also accepts the old name
    ``past_key_values`` with a deprecation warning, as the original does.

    Args:
        original: the installed attention class the fused class replaces.
        pack: the distribution named in the error message (``"hfpatch-pack-..."``).
        error: the exception class raised for an unsupported ``original``: a pack
            that builds its classes when it is imported raises ``ImportError``, so
            that the failure reads as the pack not importing on this release.

    Returns:
        The function to set as the fused class's ``forward``.

    Raises:
        Exception: ``error``, when ``original.forward`` takes neither ``cache`` nor
            ``past_key_values``: the fused forward cannot reproduce it (hfpatch then
            reports the pack as failed for the load and the model loads unpatched, or
            raises in strict mode).
    """
    parameters = inspect.signature(original.forward).parameters
    if "cache" in parameters:
        from transformers.utils.deprecation import deprecate_kwarg

        wrapped: Callable[..., AttentionOutput] = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(
            _forward_with_cache
        )
        return wrapped
    if "past_key_values" in parameters:
        return _forward_with_past_key_values
    raise error(
        f"{original.__module__}.{original.__qualname__}.forward takes neither 'cache' nor 'past_key_values' "
        f"({list(parameters)}); {pack} does not support this transformers release."
    )
