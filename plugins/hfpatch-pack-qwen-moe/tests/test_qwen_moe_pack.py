"""The qwen-moe pack on tiny random qwen2_moe / qwen3_moe checkpoints, loaded as a user would.

Every test compares the patched model with vanilla transformers on the same checkpoint:
the pack must change the module structure and nothing else.
"""

from __future__ import annotations

import json
import re
import textwrap
import warnings
from pathlib import Path
from typing import Any

import hfpatch_pack_qwen_moe
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hfpatch_pack_qwen_moe import BUILTIN_EXPERT_FUSION, FAMILIES, PerExpertExperts, qkv_sizes
from hfpatch_pack_qwen_moe.attention import FusedQKVAttention
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

import hfpatch_core
from conftest import CASES, PACK, PAD, VOCAB
from hfpatch_core import LoadContext
from hfpatch_core.authoring import SizedConcatenate, source_patterns_of
from hfpatch_core.testing import (
    BF16_ATOL,
    BF16_CALIBRATION,
    BF16_TOLERANCES,
    FP32_TOLERANCES,
    HeldRouting,
    check_training_equivalence,
    discover_from_wheel,
    load_model,
    logits_of,
    padded_batch,
    safetensors_of,
)

PACK_DIR = Path(__file__).resolve().parents[1]

ORIGINAL_CLASSES = {
    "Qwen2MoeExperts": modeling_qwen2_moe.Qwen2MoeExperts,
    "Qwen2MoeAttention": modeling_qwen2_moe.Qwen2MoeAttention,
    "Qwen3MoeExperts": modeling_qwen3_moe.Qwen3MoeExperts,
    "Qwen3MoeAttention": modeling_qwen3_moe.Qwen3MoeAttention,
}


# --- helpers ----------------------------------------------------------------------------


def assert_patched(model: Any) -> None:
    """Every layer's experts and attention are the pack's classes, under the plan's names."""
    family = FAMILIES[model.config.model_type]
    plan = hfpatch_core.plan_of(model)
    assert plan is not None
    assert {name: claim.pack for name, claim in plan.replaced.items()} == {
        family.experts: PACK,
        family.attention: PACK,
    }
    for layer in model.model.layers:
        assert type(layer.mlp.experts) is PerExpertExperts
        assert type(layer.self_attn) is family.fused_attention
        assert not hasattr(layer.self_attn, "q_proj")


# --- the pack's hooks -------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_builtin_expert_fusion_is_what_the_converter_removes(model_type: str) -> None:
    """The ``replaces`` patterns are source patterns, as written, of transformers' own list."""
    builtin = get_checkpoint_conversion_mapping(model_type)
    assert builtin
    for pattern in BUILTIN_EXPERT_FUSION:
        assert any(pattern in source_patterns_of(transform) for transform in builtin), pattern


def test_hooks_target_only_the_two_families_and_need_a_config_for_attention() -> None:
    for model_type in ("llama", "olmoe", "qwen3_next", "qwen2", None):
        context = LoadContext(model_type=model_type, model_class_name="AnyModel")
        assert hfpatch_pack_qwen_moe.provide_patches(context) == []
        assert hfpatch_pack_qwen_moe.provide_converters(context) == []
    for model_type, family in FAMILIES.items():
        bare = LoadContext(model_type=model_type, model_class_name="AnyModel", config=None)
        assert [(p.target, p.replacement) for p in hfpatch_pack_qwen_moe.provide_patches(bare)] == [
            (family.experts, PerExpertExperts)
        ]
        (converter,) = hfpatch_pack_qwen_moe.provide_converters(bare)
        # the stacked experts of transformers' own layout split at load, nothing else
        assert converter.key == model_type
        assert [type(t).__name__ for t in converter.transforms] == ["LoadOnlySplitConverter"] * 2
        assert converter.replaces == BUILTIN_EXPERT_FUSION


@pytest.mark.parametrize("name", list(CASES))
def test_qkv_converter_sizes_follow_the_config(name: str) -> None:
    config = CASES[name].config
    context = LoadContext(model_type=config.model_type, model_class_name="AnyModel", config=config)
    patches = hfpatch_pack_qwen_moe.provide_patches(context)
    family = FAMILIES[config.model_type]
    assert [p.target for p in patches] == [family.experts, family.attention]
    fused = [
        t
        for c in hfpatch_pack_qwen_moe.provide_converters(context)
        for t in c.transforms
        if type(t).__name__ != "LoadOnlySplitConverter"
    ]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = (4 * head_dim, 2 * head_dim, 2 * head_dim)
    assert qkv_sizes(config) == expected
    # the weights (and a quantized checkpoint's weight_* tensors), the biases, the static activation parameters
    suffixes = ["weight", "bias", "input_"] if getattr(config, family.bias_attribute) else ["weight", "input_"]
    assert [t.operations[0].sizes for t in fused] == [expected] * len(suffixes)
    assert all(isinstance(t.operations[0], SizedConcatenate) for t in fused)
    assert [source_patterns_of(t) for t in fused] == [
        tuple(f"self_attn.{p}_proj.{suffix}" for p in "qkv") for suffix in suffixes
    ]


def test_plan_records_the_replaced_builtin_fusion(checkpoints: dict[str, Path], case: str) -> None:
    model = load_model(checkpoints[case], PACK)
    assert_patched(model)
    plan = hfpatch_core.plan_of(model)
    assert plan is not None and plan.conversions
    model_type = model.config.model_type
    assert sorted(removal.pattern for removal in plan.conversions.removed) == sorted(BUILTIN_EXPERT_FUSION)
    assert all(removal.key == model_type and removal.pack == PACK for removal in plan.conversions.removed)
    assert not plan.conversions.unmatched and not plan.conversions.lost
    left = [
        pattern
        for entry in plan.conversions.lists[model_type]
        if entry.origin != PACK
        for pattern in source_patterns_of(entry.transform)
    ]
    assert not [pattern for pattern in left if "mlp.experts" in pattern], "a built-in expert fusion is left"


# --- behaviour: logits, generation, bf16 ------------------------------------------------


def test_logits_match_vanilla_fp32_on_a_left_padded_batch(checkpoints: dict[str, Path], case: str) -> None:
    vanilla = load_model(checkpoints[case])
    patched = load_model(checkpoints[case], PACK)
    assert_patched(patched)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    expected, actual = logits_of(vanilla, ids, mask), logits_of(patched, ids, mask)
    real = mask.bool()
    assert torch.isfinite(expected[real]).all()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    # The mask matters here (so that the comparison above covers it): the padded prompt's
    # logits differ from those of the same tokens without a mask.
    unmasked = logits_of(patched, ids, torch.ones_like(mask))
    assert (unmasked[2, -1] - actual[2, -1]).abs().max() > 1e-3


def test_greedy_generation_with_kv_cache_matches_vanilla(checkpoints: dict[str, Path], case: str) -> None:
    vanilla = load_model(checkpoints[case])
    patched = load_model(checkpoints[case], PACK)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=1)
    settings: dict[str, Any] = dict(
        attention_mask=mask,
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        use_cache=True,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with torch.no_grad():
        expected = vanilla.generate(ids, **settings)
        actual = patched.generate(ids, **settings)
    assert actual.sequences.shape == (3, 12 + 20)
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(set(actual.sequences[:, 12:].flatten().tolist())) > 3, "degenerate generation: the test proves little"
    assert len(actual.logits) == len(expected.logits) == 20
    torch.testing.assert_close(torch.stack(actual.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)
    # The cache was filled by the pack's attention (transformers would silently recompute
    # the whole sequence at every step if it stayed empty): every layer holds the prompt
    # and all generated tokens but the last.
    cache = getattr(actual, "cache", None) or getattr(actual, "past_key_values", None)
    assert cache is not None
    assert [cache.get_seq_length(layer) for layer in range(patched.config.num_hidden_layers)] == [12 + 19] * 2


@pytest.mark.parametrize("name", ["qwen2_moe-sliding", "qwen3_moe-sliding"])
def test_the_sliding_window_cases_exercise_the_window(checkpoints: dict[str, Path], name: str) -> None:
    """On the patched model, widening the 4-token window changes the logits past it and only there."""
    path = checkpoints[name]
    windowed = load_model(path, PACK)
    config = AutoConfig.from_pretrained(path)
    assert config.sliding_window == 4
    config.sliding_window = 1000
    widened = load_model(path, PACK, config=config)
    ids, mask = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6)), torch.ones(1, 12)
    inside, outside = logits_of(windowed, ids, mask), logits_of(widened, ids, mask)
    torch.testing.assert_close(inside[:, :4], outside[:, :4], rtol=0, atol=1e-5)
    assert (inside[:, 4:] - outside[:, 4:]).abs().max() > 1e-2


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_training_matches_vanilla(checkpoints: dict[str, Path], case: str, checkpointing: bool) -> None:
    """5 AdamW steps on padded batches: vanilla's losses, gradients (per expert, in the
    checkpoint layout) and weights, within the fp32 training tolerances."""
    report = check_training_equivalence(PACK, checkpoints[case], gradient_checkpointing=checkpointing)
    assert report.ok, report.failures
    assert report.steps == 5 and report.max_loss_diff is not None and report.max_loss_diff <= FP32_TOLERANCES.loss


def test_bf16_training_matches_vanilla_within_the_bf16_tolerances(checkpoints: dict[str, Path], case: str) -> None:
    """5 bf16 AdamW steps against vanilla's default experts, within ``BF16_TOLERANCES`` as
    calibrated in the run, routing held to vanilla's: a token whose top-k scores tie within
    bf16 rounding takes vanilla's experts (counted in ``forced_routes``; any other routing
    difference fails).  Not bit-identical, so the comparison did run."""
    report = check_training_equivalence(PACK, checkpoints[case], dtype=torch.bfloat16)
    assert report.ok, report.failures
    assert report.forced_routes is not None
    assert report.max_loss_diff is not None and 0 < report.max_loss_diff <= report.tolerances.loss
    assert report.max_gradient_diff is not None and 0 < report.max_gradient_diff <= report.tolerances.gradients
    assert report.tolerances.gradients >= BF16_TOLERANCES.gradients  # calibrated, never below the floor


def test_bf16_logits_match_vanilla_within_the_calibrated_tolerance(checkpoints: dict[str, Path], case: str) -> None:
    """bf16 against vanilla's eager experts; and against vanilla's default experts implementation
    no further than transformers' own eager-vs-default difference.  Routing is held to vanilla
    eager's (ties only, ``HeldRouting``), and the bound is calibrated in the run, as
    ``assert_pack_equivalent`` does: ``BF16_CALIBRATION`` times vanilla's bf16 difference from
    vanilla in fp32, at least ``BF16_ATOL``; a wrong head or expert moves these logits by about 1.

    transformers 5.3 runs bf16 experts with ``grouped_mm`` by default, which rounds
    differently from its eager loop; the pack's per-expert modules run the eager loop.
    """
    source = checkpoints[case]
    default = load_model(source, dtype=torch.bfloat16)
    eager = load_model(source, dtype=torch.bfloat16, experts_implementation="eager")
    patched = load_model(source, PACK, dtype=torch.bfloat16)
    assert patched.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert patched.model.layers[0].mlp.experts[0].gate_proj.weight.dtype == torch.bfloat16
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=2)
    real = mask.bool()
    routing = HeldRouting(torch.bfloat16)
    with routing.record():
        expected = logits_of(eager, ids, mask)[real]

    def held(model: Any) -> torch.Tensor:
        forced = routing.for_another_model()
        with forced.force():
            logits = logits_of(model, ids, mask)[real]
        assert forced.finish() == []
        return logits

    bound = max(BF16_ATOL, BF16_CALIBRATION * (held(load_model(source)) - expected).abs().max().item())
    actual = held(patched)
    from_eager = (actual - expected).abs().max().item()
    assert from_eager <= bound, f"bf16 max abs difference from vanilla (eager experts): {from_eager} > {bound}"
    by_default = held(default)
    from_default = (actual - by_default).abs().max().item()
    transformers_own = (expected - by_default).abs().max().item()
    assert from_default <= transformers_own + bound, (from_default, transformers_own, bound)


def eager_loop(
    experts: PerExpertExperts, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager expert loop (``Qwen2MoeExperts.forward``), run over the pack's per-expert modules."""
    final = torch.zeros_like(hidden_states)
    mask = F.one_hot(index, num_classes=experts.num_experts + 1).permute(2, 1, 0)
    for hit in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        expert = int(hit[0])
        if expert == experts.num_experts:
            continue
        position, token = torch.where(mask[expert])
        output = experts[expert](hidden_states[token]) * weights[token, position, None]
        final.index_add_(0, token, output.to(final.dtype))
    return final


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_the_expert_loop_gives_the_eager_loops_bits(quantized: bool) -> None:
    """Decode steps (one token) and prompts, with idle experts, the expert-parallel sentinel
    and a router that picks one expert twice: the same bits as the eager loop, gradients too."""
    config = CASES["qwen2_moe"].config
    torch.manual_seed(0)
    experts = PerExpertExperts(config)
    for parameter in experts.parameters():
        nn.init.normal_(parameter, std=0.2)
    if quantized:
        experts = dynamic_int8(experts)
    generator = torch.Generator().manual_seed(1)
    for tokens in [1] * 40 + [2, 5, 9, 17]:
        hidden = torch.randn(tokens, config.hidden_size, generator=generator)
        index = torch.randint(0, config.num_experts + 1, (tokens, 3), generator=generator)  # num_experts: sentinel
        weights = torch.rand(tokens, 3, generator=generator)
        with torch.no_grad():
            assert torch.equal(experts(hidden, index, weights), eager_loop(experts, hidden, index, weights)), index
    if quantized:
        return
    hidden = torch.randn(6, config.hidden_size, generator=generator)
    index = torch.tensor([[0, 1], [1, 0], [3, 3], [4, 2], [0, 4], [2, 1]])
    for rows in (slice(0, 6), slice(2, 3), slice(4, 5)):
        grads = []
        for forward in (experts, lambda *args: eager_loop(experts, *args)):
            weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(2))[rows].requires_grad_()
            experts.zero_grad()
            forward(hidden[rows], index[rows], weights).square().sum().backward()
            grads.append([weights.grad, *(p.grad for p in experts.parameters())])
        for got, want in zip(*grads, strict=True):
            assert (got is None and want is None) or torch.equal(got, want)


# --- saving -----------------------------------------------------------------------------


def test_save_pretrained_writes_the_original_layout(checkpoints: dict[str, Path], case: str, tmp_path: Path) -> None:
    source = checkpoints[case]
    patched = load_model(source, PACK)
    patched.save_pretrained(tmp_path)
    written, original = safetensors_of(tmp_path), safetensors_of(source)
    assert sorted(written) == sorted(original)
    assert not any("qkv_proj" in key for key in written)
    assert any(re.search(r"mlp\.experts\.3\.down_proj\.weight$", key) for key in written)
    for key, tensor in original.items():
        assert written[key].shape == tensor.shape and written[key].dtype == tensor.dtype, key
        assert torch.equal(written[key], tensor), key

    reloaded = load_model(tmp_path)
    assert hfpatch_core.plan_of(reloaded) is None
    assert type(reloaded.model.layers[0].mlp.experts) is ORIGINAL_CLASSES[FAMILIES[reloaded.config.model_type].experts]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=3)
    torch.testing.assert_close(
        logits_of(reloaded, ids, mask), logits_of(load_model(source), ids, mask), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_from_config_initialises_and_saves_the_original_layout(
    checkpoints: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """A model built from a config (no checkpoint) is patched, initialised and saves like vanilla."""
    config = CASES[name].config
    hfpatch_core.enable(PACK)
    model = AutoModelForCausalLM.from_config(config)
    hfpatch_core.disable()
    assert_patched(model)
    experts = model.model.layers[0].mlp.experts
    weights = torch.stack([expert.gate_proj.weight for expert in experts])
    assert torch.isfinite(weights).all() and weights.std() > config.initializer_range / 2
    model.save_pretrained(tmp_path)
    # The layout vanilla transformers saves for this config: the session's checkpoint.
    expected = {key: tuple(value.shape) for key, value in safetensors_of(checkpoints[name]).items()}
    assert {key: tuple(value.shape) for key, value in safetensors_of(tmp_path).items()} == expected


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_a_model_built_inside_patched_saves_the_original_layout(
    checkpoints: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """What the README says of ``patched()``: the original layout, holding the fused modules' values,
    written through hfpatch's save-time check."""
    config = CASES[name].config
    hfpatch_core.enable(PACK)
    with hfpatch_core.patched(config):
        model = AutoModelForCausalLM._model_mapping[type(config)](config)
    hfpatch_core.disable()
    assert type(model.model.layers[0].self_attn) is FAMILIES[name].fused_attention
    assert type(model.save_pretrained).__name__ == "SaveGuard" and model.save_pretrained.__self__ is model
    model.save_pretrained(tmp_path)
    written = safetensors_of(tmp_path)
    expected = {key: tuple(value.shape) for key, value in safetensors_of(checkpoints[name]).items()}
    assert {key: tuple(value.shape) for key, value in written.items()} == expected
    parts = [written[f"model.layers.0.self_attn.{part}_proj.weight"] for part in ("q", "k", "v")]
    assert torch.equal(torch.cat(parts), model.model.layers[0].self_attn.qkv_proj.weight)


# --- the reason the pack exists ---------------------------------------------------------


class FakeQuantLinear(nn.Linear):
    """What a weight-only int8 quantizer puts in place of ``nn.Linear`` (quantise-dequantise per row)."""

    calls: int = 0

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FakeQuantLinear:
        quantized = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        with torch.no_grad():
            scale = linear.weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
            quantized.weight.copy_((linear.weight / scale).round().clamp(-127, 127) * scale)
            if linear.bias is not None:
                quantized.bias.copy_(linear.bias)
        return quantized

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.linear(input, self.weight, self.bias)


def quantize(model: nn.Module) -> list[str]:
    """Replace every plain ``nn.Linear`` by :class:`FakeQuantLinear`; the converted module names."""
    converted = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, child_name, FakeQuantLinear.from_linear(child))
                converted.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return converted


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_a_linear_swapping_quantizer_reaches_every_expert(checkpoints: dict[str, Path], name: str) -> None:
    config = CASES[name].config
    expert_linear = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj$")
    fused_qkv = re.compile(r"\.self_attn\.qkv_proj$")

    vanilla = load_model(checkpoints[name])
    vanilla_converted = quantize(vanilla)
    assert not [n for n in vanilla_converted if expert_linear.search(n)], "vanilla experts are 3-D parameters"

    patched = load_model(checkpoints[name], PACK)
    converted = quantize(patched)
    experts = [n for n in converted if expert_linear.search(n)]
    assert len(experts) == config.num_hidden_layers * config.num_experts * 3
    assert len([n for n in converted if fused_qkv.search(n)]) == config.num_hidden_layers
    assert not [n for n in converted if re.search(r"\.[qkv]_proj$", n)]
    leftovers = [n for n, m in patched.named_modules() if type(m) is nn.Linear]
    assert leftovers == []

    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=4)
    logits_of(patched, ids, mask)
    modules = dict(patched.named_modules())
    assert all(modules[n].calls == 1 for n in converted if fused_qkv.search(n))
    expert_calls = [modules[n].calls for n in experts]
    assert sum(expert_calls) > 0, "the quantized experts are the ones the forward runs"
    for layer in range(config.num_hidden_layers):
        for expert in range(config.num_experts):
            prefix = f"model.layers.{layer}.mlp.experts.{expert}."
            assert len({modules[prefix + p].calls for p in ("gate_proj", "up_proj", "down_proj")}) == 1


#: Dynamic int8 (``quantize_dynamic``) against the same model in fp32, on the tiny
#: checkpoints' left-padded batch (|logits| <= ~5; ``initializer_range`` 0.2 makes the
#: routing sharp, so a token whose top-k flips moves a lot).  Measured on CPU, torch 2.13,
#: 20 random checkpoints per family: max abs difference <= 1.12, cosine similarity of a
#: position's logits >= 0.954, its mean over positions >= 0.9956.  Swapping two experts
#: in every layer (no quantization; 6 checkpoints per family) gives a mean cosine of
#: 0.79..0.97 and differences of 1.5..4.  The same on any x86 CPU: int8 products sum
#: exactly in int32 on every kernel path (AVX2, AVX-512, VNNI), and what an fp32 kernel
#: rounds otherwise (~1e-6) is far below int8's steps, so the routes int8 error flips are
#: the same routes everywhere.
INT8_MAX_ABS = 1.5
INT8_MIN_COSINE = 0.9
INT8_MEAN_COSINE = 0.99


def dynamic_int8(model: nn.Module) -> nn.Module:
    """``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, qint8)``, as users call it."""
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch 2.13 deprecates torch.ao.quantization, per call
        warnings.simplefilter("ignore", DeprecationWarning)
        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_dynamic_int8_quantizes_every_expert_within_the_measured_tolerance(
    checkpoints: dict[str, Path], name: str
) -> None:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    config = CASES[name].config
    vanilla = dynamic_int8(load_model(checkpoints[name]))
    left = [n for n, p in vanilla.named_parameters() if ".mlp.experts." in n and p.dtype == torch.float32]
    assert len(left) == 2 * config.num_hidden_layers, "vanilla keeps its experts as fp32 3-D parameters"

    reference = load_model(checkpoints[name], PACK)
    quantized = dynamic_int8(load_model(checkpoints[name], PACK))
    assert_patched(quantized)
    for layer in quantized.model.layers:
        assert len(layer.mlp.experts) == config.num_experts
        for expert in layer.mlp.experts:
            for projection in (expert.gate_proj, expert.up_proj, expert.down_proj):
                assert type(projection) is DynamicQuantizedLinear
                assert projection.weight().dtype == torch.qint8
        assert list(layer.mlp.experts.parameters()) == [], "an expert weight is left in floating point"
        assert type(layer.self_attn.qkv_proj) is DynamicQuantizedLinear
    assert not [n for n, m in quantized.named_modules() if type(m) is nn.Linear]
    assert not [n for n, p in quantized.named_parameters() if ".mlp.experts." in n]

    calls = []
    for layer in quantized.model.layers:
        for expert in layer.mlp.experts:
            expert.down_proj.register_forward_hook(lambda module, args, output: calls.append(output.shape[0]))
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=4)
    real = mask.bool()
    expected, actual = logits_of(reference, ids, mask)[real], logits_of(quantized, ids, mask)[real]
    # Every token of the batch (padding included) goes to its top-k experts, through the int8 experts.
    assert sum(calls) == ids.numel() * config.num_hidden_layers * config.num_experts_per_tok
    assert not torch.equal(actual, expected)
    difference = (actual - expected).abs().max().item()
    cosine = F.cosine_similarity(actual, expected, dim=-1)
    assert difference <= INT8_MAX_ABS, difference
    assert cosine.min() >= INT8_MIN_COSINE and cosine.mean() >= INT8_MEAN_COSINE, cosine


# --- nothing is left behind -------------------------------------------------------------


def test_a_patched_load_leaves_transformers_unpatched(checkpoints: dict[str, Path]) -> None:
    for name in ("qwen2_moe", "qwen3_moe"):
        load_model(checkpoints[name], PACK)
    assert modeling_qwen2_moe.Qwen2MoeExperts is ORIGINAL_CLASSES["Qwen2MoeExperts"]
    assert modeling_qwen2_moe.Qwen2MoeAttention is ORIGINAL_CLASSES["Qwen2MoeAttention"]
    assert modeling_qwen3_moe.Qwen3MoeExperts is ORIGINAL_CLASSES["Qwen3MoeExperts"]
    assert modeling_qwen3_moe.Qwen3MoeAttention is ORIGINAL_CLASSES["Qwen3MoeAttention"]
    for name in ("qwen2_moe", "qwen3_moe"):
        vanilla = load_model(checkpoints[name])
        family = FAMILIES[vanilla.config.model_type]
        assert type(vanilla.model.layers[0].mlp.experts) is ORIGINAL_CLASSES[family.experts]
        assert type(vanilla.model.layers[0].self_attn) is ORIGINAL_CLASSES[family.attention]
    assert issubclass(FAMILIES["qwen3_moe"].fused_attention, FusedQKVAttention)


def test_attention_outputs_are_recorded_and_nothing_leaks_into_later_vanilla_loads(
    checkpoints: dict[str, Path],
) -> None:
    """``output_attentions`` works on the patched model (its attention subclasses the original,
    which the output recorders look for), gives vanilla's weights, and a vanilla model loaded
    afterwards still records its own attentions (transformers' ``patch_output_recorders``
    rewrites class-level recorders during a patched load; hfpatch must put them back)."""
    path = checkpoints["qwen3_moe"]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=5)
    patched = load_model(path, PACK, attn_implementation="eager")
    vanilla = load_model(path, attn_implementation="eager")
    with torch.no_grad():
        expected = vanilla(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        actual = patched(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert expected is not None and len(expected) == vanilla.config.num_hidden_layers
    assert actual is not None and len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# --- discovery from a real wheel --------------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json, sys
    import importlib_metadata
    import hfpatch_core
    from transformers import AutoConfig, AutoModelForCausalLM

    hfpatch_core.enable()  # HF_PATCH_PACKS=qwen-moe
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    plan = hfpatch_core.plan_of(model)
    pack = hfpatch_core.discover().packs["qwen-moe"]
    print(json.dumps({
        "distribution_files": str(importlib_metadata.distribution("hfpatch-pack-qwen-moe").locate_file("")),
        "module_file": pack.load().__file__,
        "replaced": {name: claim.pack for name, claim in plan.replaced.items()},
        "experts": type(model.model.layers[0].mlp.experts).__module__,
    }))
    """
)


def test_the_pack_is_discovered_from_an_installed_wheel(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # The wheel's copy is alone on the path, ahead of any other install of the pack.
    installed = discover_from_wheel(PACK_DIR, PACK, tmp_path)
    assert installed.wheel.name.startswith("hfpatch_pack_qwen_moe-0.1.0-"), installed.wheel
    row = installed.row
    assert (row["distribution"], row["version"], row["enabled"]) == ("hfpatch-pack-qwen-moe", "0.1.0", True)
    assert row["transformers"] == "<6,>=5.3" and row["description"]

    probe = installed.run_python("-c", _PROBE, checkpoints["qwen3_moe"])
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(found["distribution_files"]).resolve() == installed.site.resolve()
    assert Path(found["module_file"]).resolve().is_relative_to(installed.site.resolve())
    assert found["replaced"] == {"Qwen3MoeExperts": PACK, "Qwen3MoeAttention": PACK}
    assert found["experts"] == "hfpatch_pack_qwen_moe.experts"


def test_the_pack_is_installed_for_these_tests() -> None:
    """The other tests load through discovery: the pack must be installed (``pip install -e``)."""
    assert PACK in hfpatch_core.discover().packs, (
        "install the pack first: pip install --no-deps -e plugins/hfpatch-pack-qwen-moe"
    )


def test_hfpatch_demo_with_this_pack_passes_every_check() -> None:
    """``make demo`` (``hfpatch demo``) runs this pack on a tiny Qwen2-MoE checkpoint."""
    import io

    from hfpatch_core.cli.demo import run_demo

    out = io.StringIO()
    report = run_demo(packs=PACK, out=out)
    text = out.getvalue()
    assert report.ok, text
    assert report.model_type == "qwen2_moe" and set(report.replaced) == {"Qwen2MoeExperts", "Qwen2MoeAttention"}
    for check in ("classes replaced", "logits match", "greedy generation matches", "save round trip"):
        assert f"PASS  {check}" in text
    assert "PASS  nothing left behind" in text
    assert "Converters applied:" in text and "SizedConcatenate" in text and "removed WeightConverter" in text
    assert not hfpatch_core.is_enabled()


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_torchao_int8_weight_only_quantizes_every_expert_within_the_measured_tolerance(
    checkpoints: dict[str, Path], name: str
) -> None:
    """torchao's ``quantize_`` reaches nn.Linear modules only: with the pack, every expert."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    config = CASES[name].config
    vanilla = load_model(checkpoints[name])
    quantize_(vanilla, Int8WeightOnlyConfig())
    left = [n for n, p in vanilla.named_parameters() if ".mlp.experts." in n and type(p) is nn.Parameter]
    assert len(left) == 2 * config.num_hidden_layers, "vanilla keeps its experts as fp32 3-D parameters"

    reference = load_model(checkpoints[name], PACK)
    quantized = load_model(checkpoints[name], PACK)
    quantize_(quantized, Int8WeightOnlyConfig())
    assert_patched(quantized)
    for layer in quantized.model.layers:
        for expert in layer.mlp.experts:
            for projection in (expert.gate_proj, expert.up_proj, expert.down_proj):
                weight = projection.weight
                assert type(weight).__module__.startswith("torchao"), type(weight)
        plain = [p for p in layer.mlp.experts.parameters() if type(p) in (torch.Tensor, nn.Parameter)]
        assert plain == [], "an expert weight is left in floating point"
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=4)
    real = mask.bool()
    expected, actual = logits_of(reference, ids, mask)[real], logits_of(quantized, ids, mask)[real]
    assert not torch.equal(actual, expected)
    assert (actual - expected).abs().max().item() <= INT8_MAX_ABS
    cosine = F.cosine_similarity(actual, expected, dim=-1)
    assert cosine.min() >= INT8_MIN_COSINE and cosine.mean() >= INT8_MEAN_COSINE, cosine
