"""The structural detection: it finds exactly the projections to fuse, on the meta device,
and rejects the modules whose layout a fused projection would get wrong."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn as nn
from hfpatch_pack_fused_dense import detection_for, refusals
from hfpatch_pack_fused_dense.detection import KINDS, Detection, fused_parts, inspect_model, relative
from hfpatch_pack_fused_dense.modules import fused_class
from transformers import AutoConfig, Qwen2Config

from conftest import CASES, Case, expected_sites
from hfpatch_core.authoring.calls import same_input
from hfpatch_core.authoring.packing import PackedPart
from hfpatch_core.authoring.views import fusable_parts


def detect_for(model_type: str, config: Any) -> Detection:
    return detection_for(config)


def test_finds_exactly_the_expected_sites(case: Case) -> None:
    config = case.config
    detection = detection_for(config, "AnyModel")
    found = sorted((site.class_name, site.path, site.sizes, site.bias) for site in detection.sites)
    assert found == expected_sites(config)
    # nothing else in these models looks like a projection to fuse: not the 3-D
    # experts, not the router's ``gate``, not ``shared_expert_gate``
    assert dict(detection.rejected) == {}


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


def test_a_model_that_cannot_be_built_is_one_refusal() -> None:
    config = CASES["llama"].config
    config.num_attention_heads = 5  # 32 is no whole number of heads of 5
    config.head_dim = None
    reasons = refusals(config)
    assert list(reasons) == ["LlamaConfig"] and reasons["LlamaConfig"].startswith("cannot build the model")


def test_patterns_are_relative_to_the_last_layer_number() -> None:
    assert relative("model.layers.3.mlp.shared_expert") == "mlp.shared_expert"
    assert relative("layers.0.self_attn") == "self_attn"
    assert relative("layers.0") == "layers.0" and relative("encoder.attn") == "encoder.attn"


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


def test_a_norm_over_all_heads_is_fused_too() -> None:
    """olmo2 normalises the whole q projection before it is split into heads; its own
    forward runs, so that is no reason to refuse (a re-written forward had to know it)."""
    detection = inspect_model(_meta_layer("olmo2", "Olmo2DecoderLayer"))
    assert sorted((site.class_name, site.kind) for site in detection.sites) == [
        ("Olmo2Attention", "attention"),
        ("Olmo2MLP", "mlp"),
    ]


def test_a_cross_attention_fuses_only_k_and_v() -> None:
    """bart's attention gives ``q_proj`` ``hidden_states`` and ``k_proj`` / ``v_proj`` ``current_states``
    (the encoder's output where it cross-attends): only k and v provably share an input, so
    they are fused into ``kv_proj`` and ``q_proj`` stays the module's own ``nn.Linear``."""
    layer = _meta_layer("bart", "BartDecoderLayer", d_model=32, decoder_attention_heads=4, encoder_attention_heads=4)
    detection = inspect_model(layer)
    assert dict(detection.rejected) == {}
    assert sorted((site.path, site.parts, site.fused, site.sizes) for site in detection.sites) == [
        ("encoder_attn", ("k_proj", "v_proj"), "kv_proj", (32, 32)),
        ("self_attn", ("k_proj", "v_proj"), "kv_proj", (32, 32)),
    ]
    assert detection.groups("BartAttention") == {"kv_proj": ("k_proj", "v_proj")}
    assert fused_parts(type(layer.self_attn), "attention") == (
        ("k_proj", "v_proj"),
        same_input(type(layer.self_attn), QKV),
    )
    fused = fused_class(type(layer.self_attn), detection.groups("BartAttention"))
    assert fused.__name__ == "FusedKVBartAttention"
    with torch.device("meta"):
        attention = fused(32, 4, is_decoder=True, config=layer.self_attn.config, layer_idx=0)
    assert type(attention.q_proj) is nn.Linear and isinstance(attention.k_proj, PackedPart)
    # vanilla's order, the fused projection just before its first part: PEFT's seeded draws match
    vanilla = [name for name, _ in layer.self_attn.named_children()]
    first = vanilla.index("k_proj")
    assert [name for name, _ in attention.named_children()] == [*vanilla[:first], "kv_proj", *vanilla[first:]]


def test_refuses_a_cross_attention_whose_shared_parts_differ_in_bias() -> None:
    """whisper's attention reads ``current_states`` for k/v like bart's, but only v has a bias:
    neither the whole fusion (different inputs) nor k/v's (one bias) can be made."""
    layer = _meta_layer("whisper", "WhisperDecoderLayer", d_model=32, decoder_attention_heads=4)
    detection = inspect_model(layer)
    assert detection.sites == ()
    reason = same_input(type(layer.self_attn), QKV)
    assert reason is not None
    assert "gives the parts different inputs: q_proj(hidden_states), k_proj(current_states)" in reason
    assert dict(detection.rejected) == {
        "WhisperAttention": f"self_attn: {reason}; and fusing only k_proj/v_proj: only ['v_proj'] of "
        "['k_proj', 'v_proj'] have a bias: the fused projection would add one to the others"
    }


def test_finds_nothing_in_an_already_fused_layer() -> None:
    """phi3 already has ``qkv_proj`` and ``gate_up_proj``: nothing to fuse, nothing rejected."""
    detection = inspect_model(_meta_layer("phi3", "Phi3DecoderLayer"))
    assert detection.sites == () and dict(detection.rejected) == {}


# --- hand-made layouts ------------------------------------------------------------------


class QuantLinear(nn.Linear):
    """What a quantizer or adapter puts in place of ``nn.Linear``."""


class Attention(nn.Module):
    def __init__(self, *, kv_input: int = 32, biases: tuple[bool, bool, bool] = (False, False, False)) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=biases[0])
        self.k_proj = nn.Linear(kv_input, 16, bias=biases[1])
        self.v_proj = nn.Linear(kv_input, 16, bias=biases[2])
        self.o_proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(q * torch.cat([k, v], -1))


class CrossAttention(Attention):
    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        states = x if memory is None else memory
        return self.o_proj(self.q_proj(x) * torch.cat([self.k_proj(states), self.v_proj(states)], -1))


class Reassigned(Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x)
        x = x * 2
        return self.o_proj(q * torch.cat([self.k_proj(x), self.v_proj(x)], -1))


class Looped(Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [projection(x) for projection in (self.q_proj, self.k_proj, self.v_proj)]
        return self.o_proj(outputs[0] * torch.cat(outputs[1:], -1))


class Helper(Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._attend(x)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


QKV = KINDS["attention"][1]


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (Attention, None),
        (CrossAttention, "gives the parts different inputs: q_proj(x), k_proj(states), v_proj(states)"),
        (Reassigned, "assigns x between the calls of q_proj, k_proj, v_proj"),
        (Looped, "uses self.q_proj other than by calling it"),
        (Helper, "never calls it itself (self.q_proj)"),
    ],
    ids=["plain", "cross-attention", "reassigned", "looped", "through-a-helper"],
)
def test_the_same_input_is_proven_from_the_source(cls: type, reason: str | None) -> None:
    found = same_input(cls, QKV)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found, found


def _quantized_q() -> nn.Module:
    attention = Attention()
    attention.q_proj = QuantLinear(32, 32, bias=False)
    return attention


@pytest.mark.parametrize(
    ("factory", "reason"),
    [
        (Attention, None),
        (lambda: Attention(biases=(True, True, True)), None),
        (lambda: Attention(kv_input=48), "q_proj/k_proj/v_proj read different input sizes [32, 48, 48]"),
        (
            lambda: Attention(biases=(True, False, False)),
            "only ['q_proj'] of ['q_proj', 'k_proj', 'v_proj'] have a bias",
        ),
        (_quantized_q, "QuantLinear, not an nn.Linear"),
    ],
    ids=["plain", "bias", "other-input-size", "q-only-bias", "wrapped-q"],
)
def test_parts_must_be_plain_linears_of_one_input(factory: Any, reason: str | None) -> None:
    with torch.device("meta"):
        module = factory()
    found = fusable_parts(module, QKV)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found, found


def test_a_class_is_refused_when_one_instance_is() -> None:
    """One bad instance refuses the whole class (the patch replaces the class)."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Attention(), Attention(kv_input=48)])

    with torch.device("meta"):
        detection = inspect_model(Model())
    assert detection.sites == ()
    assert detection.rejected["Attention"].startswith("layers.1: q_proj/k_proj/v_proj read different input sizes")


def test_sizes_that_differ_between_layers_get_one_pattern_per_layer() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Attention(), Attention()])
            self.layers[1].q_proj = nn.Linear(32, 48, bias=False)

    with torch.device("meta"):
        detection = inspect_model(Model())
    assert [(site.path, site.sizes) for site in detection.sites] == [
        ("layers.0", (32, 16, 16)),
        ("layers.1", (48, 16, 16)),
    ]


def test_a_pattern_that_would_convert_another_module_takes_the_whole_paths() -> None:
    """A converter pattern matches anywhere in a key: ``attn`` would also match ``cross_attn``,
    so the patterns name each layer's whole path (``layers.0.attn``), which match nothing else."""

    class Memory(Attention):  # reads the same input; its name does not contain another's
        pass

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()
            self.cross_attn = Memory(kv_input=48)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

    with torch.device("meta"):
        detection = inspect_model(Model())
    assert [(site.class_name, site.path) for site in detection.sites] == [
        ("Attention", "layers.0.attn"),
        ("Attention", "layers.1.attn"),
    ]
    assert list(detection.rejected) == ["Memory"]
    assert "read different input sizes" in detection.rejected["Memory"]
    from hfpatch_pack_fused_dense.detection import _pattern_problem

    short = detection.sites[0].__class__("attn", "attention", "Attention", (32, 16, 16), False)
    keys = ["layers.0.attn.q_proj.weight", "layers.0.cross_attn.q_proj.weight"]
    assert _pattern_problem(short, keys, {"layers.0.attn"}) == (
        "the converter pattern 'attn.q_proj.weight' would also convert 'layers.0.cross_attn.q_proj.weight'"
    )


def test_a_shared_projection_is_not_fused() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Attention(), Attention()])
            self.layers[1].v_proj = self.layers[0].v_proj

    with torch.device("meta"):
        detection = inspect_model(Tied())
    assert "shared with another module" in detection.rejected["Attention"]


_TABLE = {"attention": Attention}


def test_a_class_built_from_a_table_is_refused() -> None:
    """transformers' registry rebinds class names in the modeling modules: a module built
    from a table (nemotron_h's ``MIXER_TYPES[kind](...)``) would keep the original class."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = _TABLE["attention"]()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])

    with torch.device("meta"):
        detection = inspect_model(Model())
    assert detection.rejected == {
        "Attention": "layers.0.mixer: Layer.__init__ does not build Attention by its name (a table or a factory): "
        "the patch registry could not replace it"
    }


def test_a_class_whose_name_is_part_of_another_is_refused() -> None:
    """transformers' registry matches a plain name with re.search: a patch of ``Attention``
    would also replace ``AttentionBlock`` (olmo_hybrid: OlmoHybridAttention, OlmoHybridAttentionDecoderLayer)."""

    class AttentionBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([AttentionBlock(), AttentionBlock()])

    with torch.device("meta"):
        detection = inspect_model(Model())
    assert detection.sites == ()
    assert "would also replace AttentionBlock (its name contains 'Attention')" in detection.rejected["Attention"]
