"""The structural detection: it finds exactly the projections to fuse, on the meta device,
and rejects the modules whose layout a fused projection would get wrong."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn as nn
from hfpatch_pack_fused_dense import FAMILIES, detect_for
from hfpatch_pack_fused_dense.detection import (
    Site,
    attention_layout,
    consolidate,
    detect,
    inspect_layer,
    mlp_layout,
)
from transformers import AutoConfig, Qwen2Config, activations

from conftest import CASES, Case, expected_sites


def test_finds_exactly_the_expected_sites(case: Case) -> None:
    config = case.config
    detection = detect_for(config.model_type, config)
    found = sorted((site.class_name, site.path, site.sizes, site.bias) for site in detection.sites)
    assert found == expected_sites(config)
    # nothing else in these decoder layers looks like a projection to fuse: not the 3-D
    # experts, not the router's ``gate``, not ``shared_expert_gate``
    assert dict(detection.rejected) == {}
    qk_norm = config.model_type in ("qwen3", "qwen3_moe")
    assert [site.qk_norm for site in detection.sites if site.kind == "attention"] == [qk_norm]


def test_runs_on_the_meta_device_and_is_cached() -> None:
    """A 72B-size config (80 layers, hidden 8192) is inspected without allocating its
    ~290 GB of fp32 weights, and the second call is served from the cache."""
    config = Qwen2Config(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
    )
    start = time.perf_counter()
    first = detect_for("qwen2", config)
    cold = time.perf_counter() - start
    assert sorted((s.path, s.sizes, s.bias) for s in first.sites) == [
        ("mlp", (29568, 29568), False),
        ("self_attn", (8192, 1024, 1024), True),
    ]
    assert cold < 30, f"detection took {cold:.1f} s: it is not running on the meta device"
    assert detect_for("qwen2", config) is first
    config.intermediate_size = 1024  # a changed shape is detected anew
    second = detect_for("qwen2", config)
    assert second is not first and ("mlp", (1024, 1024), False) in [(s.path, s.sizes, s.bias) for s in second.sites]


def test_needs_a_layer_count() -> None:
    config = CASES["llama"].config
    config.num_hidden_layers = 0
    with pytest.raises(ValueError, match="num_hidden_layers is 0"):
        detect_for("llama", config)


# --- real transformers layers that must not be fused ------------------------------------


def _meta_layer(model_type: str, layer: str, **overrides: Any) -> nn.Module:
    import importlib

    config = AutoConfig.for_model(
        model_type, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, **overrides
    )
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    with torch.device("meta"):
        built: nn.Module = getattr(modeling, layer)(config, 0)
    return built


def test_rejects_a_norm_over_all_heads() -> None:
    """olmo2 normalises the whole q projection, before it is split into heads: its q/k
    norms are [heads * head_dim], not [head_dim] (a qwen3-style forward would be wrong)."""
    sites, rejected = inspect_layer(_meta_layer("olmo2", "Olmo2DecoderLayer"))
    assert [(site.class_name, site.kind) for site in sites] == [("Olmo2MLP", "mlp")]
    assert rejected == {"Olmo2Attention": "self_attn: q_norm normalises a [32] weight, not one head ([8])"}


def test_rejects_an_attention_with_another_output_projection() -> None:
    """whisper's attention writes through ``out_proj`` (and has no k bias): not the layout the
    fused forwards know, so its class is rejected, with the reason."""
    layer = _meta_layer("whisper", "WhisperDecoderLayer", d_model=32, decoder_attention_heads=4)
    sites, rejected = inspect_layer(layer)
    assert sites == []
    assert rejected == {"WhisperAttention": "self_attn: has ['k_proj', 'q_proj', 'v_proj'] but no ['o_proj']"}


def test_finds_nothing_in_an_already_fused_layer() -> None:
    """phi3 already has ``qkv_proj`` and ``gate_up_proj``: nothing to fuse, nothing rejected."""
    assert inspect_layer(_meta_layer("phi3", "Phi3DecoderLayer")) == ([], {})


# --- hand-made layouts ------------------------------------------------------------------


class QuantLinear(nn.Linear):
    """What a quantizer or adapter puts in place of ``nn.Linear``."""


class Attention(nn.Module):
    def __init__(
        self, *, kv_input: int = 32, biases: tuple[bool, bool, bool] = (False, False, False), head_dim: int = 8
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(32, 32, bias=biases[0])
        self.k_proj = nn.Linear(kv_input, 16, bias=biases[1])
        self.v_proj = nn.Linear(kv_input, 16, bias=biases[2])
        self.o_proj = nn.Linear(32, 32)


class MLP(nn.Module):
    def __init__(self, *, up: int = 64, down_input: int = 64, act: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(32, 64, bias=False)
        self.up_proj = nn.Linear(32, up, bias=False)
        self.down_proj = nn.Linear(down_input, 32, bias=False)
        if act:
            self.act_fn = activations.ACT2FN["silu"]


def _build(factory: Any) -> nn.Module:
    with torch.device("meta"):
        module: nn.Module = factory()
    return module


def test_accepts_the_plain_layouts() -> None:
    assert attention_layout(_build(Attention)) == Site("", "attention", "Attention", (32, 16, 16), False)
    assert attention_layout(_build(lambda: Attention(biases=(True, True, True)))) == Site(
        "", "attention", "Attention", (32, 16, 16), True
    )
    assert mlp_layout(_build(MLP)) == Site("", "mlp", "MLP", (64, 64), False)


def _quantized_q() -> nn.Module:
    attention = Attention()
    attention.q_proj = QuantLinear(32, 32, bias=False)
    return attention


def _without_o() -> nn.Module:
    attention = Attention()
    del attention.o_proj
    return attention


def _fused() -> nn.Module:
    attention = Attention()
    del attention.q_proj, attention.k_proj, attention.v_proj
    attention.qkv_proj = nn.Linear(32, 64)
    return attention


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        (lambda: Attention(kv_input=48), "q/k/v read different input sizes (32, 48, 48)"),
        (lambda: Attention(biases=(True, False, False)), "only ['q_proj'] of q/k/v have a bias"),
        (_quantized_q, "q_proj is QuantLinear, not nn.Linear"),
        (_without_o, "has ['k_proj', 'q_proj', 'v_proj'] but no ['o_proj']"),
        (lambda: Attention(head_dim=12), "q/k/v sizes (32, 16) are not whole heads of 12"),
        (_fused, None),
    ],
    ids=["cross-attention", "q-only-bias", "wrapped-q", "no-o_proj", "partial-heads", "already-fused"],
)
def test_rejects_other_attention_layouts(factory: Any, reason: str | None) -> None:
    result = attention_layout(_build(factory))
    if reason is None:
        assert result is None
    else:
        assert isinstance(result, str) and result.startswith(reason), result


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        (lambda: MLP(act=False), "no act_fn"),
        (lambda: MLP(up=48, down_input=48), "gate_proj is 32->64, up_proj 32->48"),
        (lambda: MLP(down_input=48), "down_proj reads 48, gate/up write 64"),
    ],
    ids=["no-act_fn", "gate-up-differ", "down-reads-other"],
)
def test_rejects_other_mlp_layouts(factory: Any, reason: str) -> None:
    result = mlp_layout(_build(factory))
    assert isinstance(result, str) and result.startswith(reason), result


def test_a_class_is_rejected_when_one_layer_differs() -> None:
    """Sizes that change from layer to layer at one path cannot share a converter pattern,
    and one bad instance rejects the whole class (the patch replaces the class)."""

    class Layer(nn.Module):
        def __init__(self, up: int) -> None:
            super().__init__()
            self.mlp = MLP(up=up, down_input=up)

    with torch.device("meta"):
        same = consolidate(inspect_layer(Layer(64)) for _ in range(3))
        varying = consolidate([inspect_layer(Layer(64)), inspect_layer(Layer(64)), inspect_layer(_Pair())])
    assert [site.path for site in same.sites] == ["mlp"] and not same.rejected
    assert varying.sites == ()
    assert varying.rejected["MLP"].startswith("layer 2, mlp: gate_proj is 32->64, up_proj 32->48")

    class Wider(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.mlp = MLP()
            self.mlp.gate_proj = nn.Linear(32, width, bias=False)
            self.mlp.up_proj = nn.Linear(32, width, bias=False)
            self.mlp.down_proj = nn.Linear(width, 32, bias=False)

    with torch.device("meta"):
        per_layer = consolidate([inspect_layer(Wider(64)), inspect_layer(Wider(96))])
    assert per_layer.sites == ()
    assert "differ from [64, 64]" in per_layer.rejected["MLP"]


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(up=48, down_input=48)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_family_table_names_the_classes_detection_finds(model_type: str) -> None:
    """Every family's named attention and MLP classes are what its decoder layers build."""
    config = next(case.config for case in CASES.values() if case.config.model_type == model_type)
    found = {site.class_name for site in detect(config, _layer_class(model_type)).sites}
    assert found == {FAMILIES[model_type].attention, FAMILIES[model_type].mlp}


def _layer_class(model_type: str) -> type[nn.Module]:
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    layer: type[nn.Module] = getattr(modeling, FAMILIES[model_type].decoder_layer)
    return layer
