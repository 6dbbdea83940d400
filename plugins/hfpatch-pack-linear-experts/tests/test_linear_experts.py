"""The linear-experts pack on tiny random checkpoints of several MoE families, against vanilla transformers."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hfpatch_pack_linear_experts import (
    PRIORITY,
    ExpertLinears,
    ExpertsSlicing,
    LinearExperts,
    SplitExperts,
    provide_converters,
    provide_patches,
)
from hfpatch_pack_linear_experts.experts import eager_forward
from transformers import AutoModelForCausalLM

import hfpatch_core
from conftest import CASES, PACK, PAD, STORED_3D, VOCAB
from hfpatch_core import LoadContext
from hfpatch_core.testing import (
    FP32_TOLERANCES,
    assert_pack_equivalent,
    check_training_equivalence,
    load_model,
    logits_of,
    padded_batch,
)

#: Per family: the per-expert projection names its checkpoints use (gate, up, down).
EXPECTED = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
    "nemotron_h": (None, "up_proj", "down_proj"),
    "gpt_oss": (None, "gate_up_proj", "down_proj"),  # stored interleaved: one gate/up linear each, as stored
    "granitemoe": ("gate_proj", "up_proj", "down_proj"),
}


def vanilla_experts_class(checkpoint: Path) -> str:
    """The class of the experts modules of a vanilla load (its name changes between releases:
    deepseek_v3's is DeepseekV3NaiveMoe on 5.3, DeepseekV3Experts later)."""
    model = load_model(checkpoint)
    (name,) = {type(module).__name__ for path, module in model.named_modules() if path.endswith(".experts")}
    return name


def experts_of(model: nn.Module) -> list[tuple[str, LinearExperts]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LinearExperts)]


@pytest.mark.parametrize("name", list(CASES))
def test_equivalent_to_vanilla_with_the_apply_path(checkpoints: dict[str, Path], name: str) -> None:
    """fp32 logits within 1e-5 on a left-padded batch, 20 greedy tokens, the saved files equal to the
    source's, a vanilla reload, and apply()/revert() on a vanilla-built model."""
    original = vanilla_experts_class(checkpoints[name])
    report = assert_pack_equivalent(PACK, checkpoints[name], apply_path=True, expected_replacements=[original])
    assert report.replaced == {original: f"Linear{original}"}
    assert report.round_trip and report.apply_path and report.generation_match


@pytest.mark.parametrize("name", list(CASES))
def test_every_expert_is_an_nn_linear_named_as_the_checkpoint(checkpoints: dict[str, Path], name: str) -> None:
    names = EXPECTED[name]
    config = CASES[name]()
    model = load_model(checkpoints[name], PACK)
    found = experts_of(model)
    assert found, "no experts replaced"
    for path, experts in found:
        assert len(experts) == experts.num_experts == 4
        assert not [n for n, _ in experts.named_parameters(recurse=False)], "a 3-D parameter is left"
        for index, expert in enumerate(experts):
            assert type(expert) is ExpertLinears and expert is getattr(experts, str(index))
            for part in names:
                if part is not None:
                    assert type(getattr(expert, part)) is nn.Linear, (path, index, part)
    assert config.model_type == model.config.model_type


def test_mixtral_keeps_the_checkpoints_w1_w3_w2_names(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["mixtral"], PACK)
    keys = [key for key in model.state_dict() if ".experts." in key]
    assert "model.layers.1.mlp.experts.3.w2.weight" in keys
    assert all(re.search(r"\.experts\.\d\.w[123]\.weight$", key) for key in keys), keys


@pytest.mark.parametrize("name", list(CASES))
def test_forward_is_the_eager_loop_at_one_token_and_many(checkpoints: dict[str, Path], name: str) -> None:
    """Each loaded experts module against the vanilla module's eager loop (``use_experts_implementation``'s
    reference) on the same weights: a decode step (one token, the fast path), one token routed twice to the
    same expert, and several tokens; the one-token path is bit for bit the general one, the sentinel id
    ``num_experts`` (expert parallelism's "not on this rank") is skipped by both."""
    vanilla = dict(
        (path, module) for path, module in load_model(checkpoints[name]).named_modules() if path.endswith(".experts")
    )
    patched = experts_of(load_model(checkpoints[name], PACK))
    assert patched and len(patched) == len(vanilla)
    generator = torch.Generator().manual_seed(0)
    for path, experts in patched:
        reference = vanilla[path]
        eager = eager_forward(type(reference))
        hidden = experts[0].projections()[1].in_features  # up's input: the hidden size
        count = experts.num_experts
        routings = {
            "decode": torch.tensor([[3, 1]]),
            "decode, reversed": torch.tensor([[0, 2]]),
            "one token, one expert twice": torch.tensor([[2, 2]]),
            "several tokens": torch.randint(0, count, (6, 2), generator=generator),
        }
        for what, index in routings.items():
            states = torch.randn(index.shape[0], hidden, generator=generator)
            weights = torch.rand(index.shape, generator=generator)
            with torch.no_grad():
                got, expected = experts(states, index, weights), eager(reference, states, index, weights)
                general = experts._tokens(states, index, weights)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f"{path}, {what}")
            assert torch.equal(got, general), (path, what)
        states = torch.randn(1, hidden, generator=generator)
        weights = torch.rand(1, 2, generator=generator)
        with torch.no_grad():
            skipped = experts(states, torch.tensor([[1, count]]), weights)
            assert torch.equal(skipped, experts._tokens(states, torch.tensor([[1, count]]), weights))
            alone = experts(states, torch.tensor([[1, 1]]), torch.stack([weights[0, 0], torch.tensor(0.0)])[None])
        torch.testing.assert_close(skipped, alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_training_matches_vanilla(checkpoints: dict[str, Path], name: str) -> None:
    report = check_training_equivalence(PACK, checkpoints[name])
    assert report.ok, report.failures
    assert report.steps == 5 and report.max_loss_diff is not None and report.max_loss_diff <= FP32_TOLERANCES.loss


def _dynamic_int8(model: nn.Module) -> None:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates torch.ao.quantization
        quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def _torchao_int8_weight_only(model: nn.Module) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())


def _is_quantized(module: nn.Module) -> bool:
    """torch.ao swaps the module for its dynamic int8 Linear; torchao keeps nn.Linear with a quantized weight."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    if type(module) is DynamicQuantizedLinear:
        return True
    weight = getattr(module, "weight", None)
    return type(module) is nn.Linear and type(weight).__module__.startswith("torchao")


QUANTIZERS = {"dynamic_int8": _dynamic_int8, "torchao_int8_weight_only": _torchao_int8_weight_only}
#: families of every shape: w1/w3/w2 names, shared experts and sigmoid routing, no gate, 3-D checkpoints
#: (transposed, interleaved, biased), a family qwen-moe also covers
QUANTIZED_FAMILIES = ["mixtral", "deepseek_v3", "nemotron_h", "gpt_oss", "qwen2_moe"]


@pytest.mark.parametrize("name", QUANTIZED_FAMILIES)
@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_quantizers_reach_every_expert_linear(checkpoints: dict[str, Path], name: str, quantizer: str) -> None:
    """Every projection of every expert of every MoE layer is quantized (none left in floating point),
    the forward runs the quantized experts, and the logits stay close to the unquantized model's."""
    if quantizer == "torchao_int8_weight_only":
        pytest.importorskip("torchao", reason="torchao is a pack-test library (.venv/pack-test-libraries)")
    reference = load_model(checkpoints[name], PACK)
    model = load_model(checkpoints[name], PACK)
    layers = experts_of(model)
    expected_count = sum(len(experts) * sum(n is not None for n in experts.layout.names) for _, experts in layers)
    QUANTIZERS[quantizer](model)
    layers = experts_of(model)
    calls: list[int] = []
    quantized = 0
    for path, experts in layers:
        left = [n for n, p in experts.named_parameters() if n.endswith("weight") and "norm" not in n]
        assert all(type(p).__module__.startswith("torchao") for n, p in experts.named_parameters() if n in left), (
            f"{path}: an expert weight is left in floating point"
        )
        for expert in experts:
            for projection in expert.projections():
                if projection is not None:
                    assert _is_quantized(projection), (path, type(projection), type(projection.weight))
                    quantized += 1
                    projection.register_forward_hook(lambda module, args, output: calls.append(output.shape[0]))
    assert quantized == expected_count > 0
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=4)
    expected, actual = logits_of(reference, ids, mask), logits_of(model, ids, mask)
    assert sum(calls) > 0, "the forward runs the quantized experts"
    assert not torch.equal(actual, expected)
    cosine = torch.nn.functional.cosine_similarity(actual[mask.bool()], expected[mask.bool()], dim=-1)
    assert cosine.mean() >= 0.95, cosine


def test_composes_with_qwen_moe_which_wins_its_families(checkpoints: dict[str, Path]) -> None:
    """With both packs, qwen2_moe's experts are qwen-moe's (priority 0 over PRIORITY), without a conflict."""
    from hfpatch_pack_qwen_moe import PerExpertExperts

    assert PRIORITY < 0
    model = load_model(checkpoints["qwen2_moe"], "qwen-moe,linear-experts")
    plan = hfpatch_core.plan_of(model)
    assert plan is not None and plan.replaced["Qwen2MoeExperts"].pack == "qwen-moe"
    assert type(model.model.layers[0].mlp.experts) is PerExpertExperts
    assert any(lost.claim.pack == PACK for lost in plan.lost)
    vanilla = load_model(checkpoints["qwen2_moe"])
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    torch.testing.assert_close(logits_of(model, ids, mask), logits_of(vanilla, ids, mask), rtol=0, atol=1e-5)
    # and the other families still get this pack's experts in the same selection
    mixtral = load_model(checkpoints["mixtral"], "qwen-moe,linear-experts")
    assert experts_of(mixtral)


@pytest.mark.parametrize("name", [name for name in STORED_3D if name in CASES])
def test_3d_checkpoints_are_split_at_load_and_saved_3d(checkpoints: dict[str, Path], name: str, tmp_path: Path) -> None:
    """A checkpoint storing the experts 3-D loads into the per-expert linears (nothing missing or unexpected)
    and saves back the source's tensors, names and bytes (gpt_oss: transposed, interleaved, biased;
    granitemoe: under the checkpoint's own name, renamed by transformers)."""
    from safetensors.torch import load_file

    source = load_file(str(checkpoints[name] / "model.safetensors"))
    assert any(value.dim() == 3 for value in source.values()), "the source stores its experts 3-D"
    with hfpatch_core.enabled(packs=PACK):
        model, info = AutoModelForCausalLM.from_pretrained(checkpoints[name], output_loading_info=True)
    assert experts_of(model) and not any(info.values()), info
    assert all(parameter.dim() <= 2 for parameter in model.parameters()), "a 3-D parameter is left"
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == sorted(source)
    for key, value in source.items():
        assert torch.equal(saved[key], value), key


@pytest.mark.parametrize("halves", [None, "concatenated"])
@pytest.mark.parametrize("transposed", [False, True])
def test_split_and_stack_are_exact_inverses(halves: str | None, transposed: bool) -> None:
    """Each expert's slice (rows = out) is cut as the layout says, as a view of the tensor (no copy), and
    stacking gives the tensor back."""
    tensor = torch.randn(3, 6, 10)  # 3 experts; gate/up rows 2 x 3, or [in, out] when transposed
    parts = ["experts.*.gate_proj.weight", "experts.*.up_proj.weight"][: 2 if halves else 1]
    split = SplitExperts(ExpertsSlicing(transposed, halves))
    pieces = split.convert({"experts.gate_up_proj": [tensor]}, ["experts.gate_up_proj"], parts)
    assert len(pieces) == 3 * len(parts)
    for expert in range(3):
        rows = tensor[expert].t() if transposed else tensor[expert]
        first = pieces[parts[0].replace("*", str(expert))]
        expected = rows if halves is None else rows[: rows.shape[0] // 2]
        assert torch.equal(first, expected)
    start = tensor.untyped_storage().data_ptr()
    for key, piece in pieces.items():
        assert start <= piece.untyped_storage().data_ptr() < start + tensor.untyped_storage().nbytes(), key
    stacked_parts = {pattern: [pieces[pattern.replace("*", str(e))] for e in range(3)] for pattern in parts}
    back = split.reverse_op.convert(stacked_parts, parts, ["experts.gate_up_proj"])
    assert torch.equal(back["experts.gate_up_proj"], tensor)
    assert isinstance(split.reverse_op.reverse_op, SplitExperts)


@pytest.mark.parametrize("name", list(CASES))
def test_the_small_probe_decides_as_one_of_the_models_sizes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs experts of intermediate size ``PROBE_INTERMEDIATE`` (three experts of a real
    model's sizes would cost hundreds of MiB at every load); its verdict, down to the summing dtype,
    is the one a probe at the model's own sizes gives."""
    from hfpatch_pack_linear_experts import discovery

    config = CASES[name]()
    verdicts = []
    for intermediate in (discovery.PROBE_INTERMEDIATE, None):
        monkeypatch.setattr(discovery, "PROBE_INTERMEDIATE", intermediate)
        monkeypatch.setattr(discovery, "_cache", {})
        found = discovery.discover(config, config.model_type)
        verdicts.append(({c.original.__name__: c.layout for c in found.candidates}, found.refused))
    assert verdicts[0][0], f"{name}: nothing claimed"
    assert verdicts[0] == verdicts[1]
    layout = next(iter(verdicts[0][0].values()))
    shapes = {
        parameter: discovery._probe_shape(parameter, (4, 6, 10) if parameter != "down_proj" else (4, 10, 3), layout, 8)
        for parameter in layout.parameters
        if not parameter.endswith("_bias")
    }
    first = "gate_up_proj" if layout.has_gate else "up_proj"
    rows = 16 if layout.has_gate else 8
    assert shapes[first] == ((3, 6, rows) if layout.is_transposed else (3, rows, 10)), shapes
    assert shapes["down_proj"] == ((3, 8, 3) if layout.is_transposed else (3, 10, 8)), shapes


def test_interleaved_halves_are_one_part() -> None:
    """Interleaved gate/up is kept whole per expert (no GEMM reads every other column in place)."""
    with pytest.raises(ValueError, match="interleaved gate/up is split as one part"):
        ExpertsSlicing(True, "interleaved")


def test_no_config_no_patch() -> None:
    assert provide_patches(LoadContext("mixtral", "MixtralForCausalLM")) == []


def test_a_config_with_a_text_encoder_and_a_decoder_is_answered() -> None:
    # musicgen's config has both: get_text_config() raises "Multiple valid text configs"
    # (hfpatch check of the pack exited 1 on it); the decoder's config is the one to read
    from transformers import EncodecConfig, MusicgenConfig, MusicgenDecoderConfig, T5Config

    config = MusicgenConfig(text_encoder=T5Config(), audio_encoder=EncodecConfig(), decoder=MusicgenDecoderConfig())
    with pytest.raises(ValueError, match="Multiple valid text configs"):
        config.get_text_config()
    context = LoadContext("musicgen", "MusicgenForConditionalGeneration", config=config)
    assert provide_patches(context) == []
    assert provide_converters(context) == []


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_a_whole_patched_model_reloads_in_a_fresh_process(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The per-expert classes are built at runtime: ``torch.save`` of the whole model loads back
    with ``torch.load`` in a process that has built none of them (they pickle as their builder)."""
    from hfpatch_core.testing import reloaded_in_a_fresh_process

    model = load_model(checkpoints[family], PACK)
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    assert any(isinstance(module, LinearExperts) for module in model.modules())
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    reloaded, logits = reloaded_in_a_fresh_process(model, ids, mask, tmp_path / "reloaded")
    assert reloaded == classes
    assert torch.equal(logits, logits_of(model, ids, mask))
