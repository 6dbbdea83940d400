"""hfpatch_core.authoring.fusion: the fused-QKV attention computes exactly what the attention it replaces computes.

The weights and inputs are multiples of 1/8 in [-1/2, 1/2], so every projection output is
exact in float32 whatever the summation order: one fused matmul and three separate ones
give the same bits, and everything after the projections must then match bit for bit.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import torch
import torch.nn as nn
from transformers.cache_utils import DynamicCache
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from conftest import tiny_llama_config
from hfpatch_core.authoring.fusion import (
    QKV_PROJECTIONS,
    FusedQKVAttentionBase,
    forward_for,
    fuse_projections,
    linear_like,
)
from hfpatch_core.testing import tiny_config

PACK = "hfpatch-pack-test"


class FusedLlamaAttention(FusedQKVAttentionBase, LlamaAttention):
    family_module = modeling_llama
    forward = forward_for(LlamaAttention, pack=PACK)


class FusedQwen3Attention(FusedQKVAttentionBase, Qwen3Attention):
    family_module = modeling_qwen3
    qk_norm = True
    forward = forward_for(Qwen3Attention, pack=PACK)

    def _attention_kwargs(self) -> dict[str, Any]:
        return {"sliding_window": self.sliding_window}


#: The installed release's name of the attention's cache argument (``cache`` after 5.3).
CACHE = "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"


def llama_config(**overrides: Any) -> Any:
    return tiny_llama_config(**{"attn_implementation": "eager", **overrides})


def qwen3_config(**overrides: Any) -> Any:
    # layer 0 slides, so that the sliding_window= the forward passes is a number
    window = {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    return tiny_config("qwen3", **{**window, "attn_implementation": "eager", **overrides})


FAMILIES = {
    "llama": (LlamaAttention, FusedLlamaAttention, llama_config),
    "qwen3": (Qwen3Attention, FusedQwen3Attention, qwen3_config),
}


def exact(shape: tuple[int, ...] | torch.Size, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-4, 5, tuple(shape), generator=generator).float() / 8


def pair(family: str, **overrides: Any) -> tuple[nn.Module, nn.Module, Any]:
    """An original attention with exact random weights, and the fused one holding the same weights."""
    original_class, fused_class, make_config = FAMILIES[family]
    config = make_config(**overrides)
    original = original_class(config, 0).eval()
    generator = torch.Generator().manual_seed(0)
    state = {name: exact(value.shape, generator) for name, value in original.state_dict().items()}
    original.load_state_dict(state)
    fused = fused_class(config, 0).eval()
    for suffix in ("weight", "bias") if config.attention_bias else ("weight",):
        state[f"qkv_proj.{suffix}"] = torch.cat([state.pop(f"{name}.{suffix}") for name in QKV_PROJECTIONS])
    fused.load_state_dict(state)
    return original, fused, config


def inputs(config: Any, length: int, start: int = 0, seed: int = 1) -> dict[str, Any]:
    hidden = exact((2, length, config.hidden_size), torch.Generator().manual_seed(seed))
    positions = torch.arange(start, start + length).expand(2, length)
    return {"hidden_states": hidden, "position_embeddings": LlamaRotaryEmbedding(config)(hidden, positions)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fused_attention_computes_the_originals_output_bit_for_bit(
    family: str, implementation: str, bias: bool
) -> None:
    original, fused, config = pair(family, attn_implementation=implementation, attention_bias=bias)
    batch = inputs(config, 7)
    mask = torch.zeros(2, 1, 7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        expected, expected_weights = original(**batch, attention_mask=mask)
        actual, actual_weights = fused(**batch, attention_mask=mask)
    assert expected.abs().max() > 0.1, "the outputs are not trivially zero"
    assert torch.equal(actual, expected)
    if implementation == "eager":
        assert expected_weights is not None and actual_weights is not None
        assert torch.equal(actual_weights, expected_weights)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fused_attention_fills_the_cache_as_the_original_does(family: str) -> None:
    """A 5-token prompt, then one token attending to the cached keys and values."""
    original, fused, config = pair(family)
    outputs, caches = [], []
    for module in (original, fused):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            module(**inputs(config, 5), attention_mask=None, **{CACHE: cache})
            step, _ = module(**inputs(config, 1, start=5, seed=2), attention_mask=None, **{CACHE: cache})
        outputs.append(step)
        caches.append(cache)
    assert caches[0].get_seq_length(0) == caches[1].get_seq_length(0) == 6
    assert torch.equal(outputs[1], outputs[0])


@pytest.mark.parametrize(
    ("overrides", "sizes"),
    [
        ({}, (32, 16, 16)),  # 4 heads and 2 kv heads of hidden_size / heads = 8
        ({"head_dim": 16}, (64, 32, 32)),  # head_dim apart from hidden_size / heads
        ({"num_key_value_heads": 4, "attention_bias": True}, (32, 32, 32)),  # multi-head
    ],
)
def test_qkv_proj_has_the_summed_sizes_of_the_three_projections(
    overrides: dict[str, Any], sizes: tuple[int, int, int]
) -> None:
    config = llama_config(**overrides)
    with torch.device("meta"):
        fused = FusedLlamaAttention(config, 0)
    assert fused.qkv_sizes == sizes
    assert fused.qkv_proj.weight.shape == (sum(sizes), config.hidden_size)
    assert fused.qkv_proj.weight.is_meta
    assert (fused.qkv_proj.bias is not None) == config.attention_bias
    assert not any(hasattr(fused, name) for name in QKV_PROJECTIONS)
    assert [name for name, _ in fused.named_children()] == ["o_proj", "qkv_proj"]


def test_the_forward_requires_position_embeddings() -> None:
    _, fused, config = pair("llama")
    with pytest.raises(TypeError, match=r"FusedLlamaAttention\.forward\(\) needs position_embeddings"):
        fused(inputs(config, 3)["hidden_states"], None, None)


def test_a_subclass_sets_the_arguments_the_attention_function_gets() -> None:
    """The family's functions are looked up on ``family_module`` at call time, and the
    subclass's ``_attention_kwargs`` come after the original's arguments."""
    calls: list[dict[str, Any]] = []

    def attention(module: nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        calls.append(kwargs)
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    family = types.ModuleType("family")
    family.apply_rotary_pos_emb = modeling_llama.apply_rotary_pos_emb  # type: ignore[attr-defined]
    family.eager_attention_forward = attention  # type: ignore[attr-defined]
    family.ALL_ATTENTION_FUNCTIONS = modeling_llama.ALL_ATTENTION_FUNCTIONS  # type: ignore[attr-defined]

    class Windowed(FusedLlamaAttention):
        family_module = family

        def _attention_kwargs(self) -> dict[str, Any]:
            return {"sliding_window": 4}

    config = llama_config(attention_dropout=0.5)
    module = Windowed(config, 0).eval()
    output, _ = module(**inputs(config, 3), attention_mask=None)
    module.train()
    module(**inputs(config, 3), attention_mask=None)
    assert output.shape == (2, 3, config.hidden_size)
    assert calls == [
        {"dropout": 0.0, "scaling": module.scaling, "sliding_window": 4},
        {"dropout": 0.5, "scaling": module.scaling, "sliding_window": 4},
    ]


def test_forward_for_names_the_pack_when_the_installed_forward_is_unknown() -> None:
    class Unknown(nn.Module):
        def forward(self, hidden_states: torch.Tensor, memory: Any = None) -> torch.Tensor:
            return hidden_states

    message = (
        r"Unknown\.forward takes neither 'cache' nor 'past_key_values' \(\['self', 'hidden_states', 'memory'\]\); "
    )
    with pytest.raises(TypeError, match=message + "hfpatch-pack-test does not support this transformers release"):
        forward_for(Unknown, pack=PACK)
    with pytest.raises(ImportError, match="hfpatch-pack-test does not support"):
        forward_for(Unknown, pack=PACK, error=ImportError)


class Parts(nn.Module):
    def __init__(self, **parts: nn.Module) -> None:
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)


def test_fuse_projections_replaces_the_parts_by_one_linear_like_the_first() -> None:
    module = Parts(
        gate_proj=nn.Linear(8, 12, dtype=torch.bfloat16), up_proj=nn.Linear(8, 4, dtype=torch.bfloat16), other=nn.ReLU()
    )
    assert fuse_projections(module, ("gate_proj", "up_proj"), "gate_up_proj") == (12, 4)
    assert [name for name, _ in module.named_children()] == ["other", "gate_up_proj"]
    fused = module.get_submodule("gate_up_proj")
    assert isinstance(fused, nn.Linear)
    assert (fused.in_features, fused.out_features, fused.weight.dtype) == (8, 16, torch.bfloat16)
    assert fused.bias is not None


def test_fuse_projections_refuses_parts_one_linear_cannot_stand_for() -> None:
    mismatched = Parts(a=nn.Linear(8, 4), b=nn.Linear(6, 4, bias=False))
    with pytest.raises(
        ValueError,
        match=r"Parts: cannot fuse a \(in_features=8, bias=True, torch\.float32, cpu\), "
        r"b \(in_features=6, bias=False, torch\.float32, cpu\) into one ab",
    ):
        fuse_projections(mismatched, ("a", "b"), "ab")
    assert hasattr(mismatched, "a") and not hasattr(mismatched, "ab"), "nothing changed"
    with pytest.raises(TypeError, match=r"Parts\.b is a ReLU, not an nn\.Linear"):
        fuse_projections(Parts(a=nn.Linear(8, 4), b=nn.ReLU()), ("a", "b"), "ab")
    with pytest.raises(ValueError, match="Parts: no projections to fuse into ab"):
        fuse_projections(Parts(), (), "ab")


def test_linear_like_takes_the_references_settings() -> None:
    with torch.device("meta"):
        reference = nn.Linear(6, 3, bias=False, dtype=torch.float16)
    built = linear_like(reference, 9)
    assert (built.in_features, built.out_features, built.bias) == (6, 9, None)
    assert built.weight.is_meta and built.weight.dtype == torch.float16
