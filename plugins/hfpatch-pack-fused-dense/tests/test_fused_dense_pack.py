"""The fused-dense pack on tiny random checkpoints of every covered family, loaded as a user would.

Every test compares the patched model with vanilla transformers on the same checkpoint:
the pack must change the module structure and nothing else.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import hfpatch_pack_fused_dense
import pytest
import torch
from hfpatch_pack_fused_dense import SAMPLE_MODEL_TYPES
from transformers import AutoConfig, AutoModelForCausalLM

import hfpatch_core
from conftest import CASES, MODELING, PACK, PAD, VOCAB, Case, expected_sites
from hfpatch_core import LoadContext
from hfpatch_core.authoring import SizedConcatenate, source_patterns_of
from hfpatch_core.authoring.views import FusedViewsMixin, ProjectionView, SharedProjection
from hfpatch_core.testing import (
    BF16_TOLERANCES,
    assert_pack_equivalent,
    check_training_equivalence,
    discover_from_wheel,
    install_pack,
    load_model,
    logits_of,
    padded_batch,
    safetensors_of,
)

PACK_DIR = Path(__file__).resolve().parents[1]

# --- helpers ----------------------------------------------------------------------------


def owners(model: Any) -> dict[str, str]:
    """Replaced class -> the pack whose class replaced it, from the model's plan."""
    plan = hfpatch_core.plan_of(model)
    assert plan is not None
    return {name: claim.pack for name, claim in plan.replaced.items()}


# --- the pack as a whole ----------------------------------------------------------------


def test_the_pack_is_installed_for_these_tests() -> None:
    """The other tests load through discovery: the pack must be installed (``pip install -e``)."""
    assert PACK in hfpatch_core.discover().packs, (
        "install the pack first: pip install --no-deps -e plugins/hfpatch-pack-fused-dense"
    )


def test_assert_pack_equivalent(checkpoints: dict[str, Path], case: Case) -> None:
    """hfpatch's own proof: replaced classes, no weight lost, padded-batch logits, 20 greedy
    tokens, the saved layout and a vanilla reload; and 5 AdamW steps, with gradient
    checkpointing off and on, give vanilla's losses, gradients and weights (checkpoint layout)."""
    report = assert_pack_equivalent(
        PACK, checkpoints[case.name], expected_replacements=list(case.replaced), train_steps=5
    )
    assert report.replaced == case.replaced
    assert report.max_abs_diff is not None and report.max_abs_diff <= 1e-5
    assert report.generation_match and report.round_trip
    assert [training.gradient_checkpointing for training in report.training] == [False, True]
    assert all(training.ok and len(training.losses) == 5 for training in report.training)


def test_bf16_training_matches_vanilla_within_the_bf16_tolerances(checkpoints: dict[str, Path]) -> None:
    report = check_training_equivalence(PACK, checkpoints["llama-bias"], dtype=torch.bfloat16)
    assert report.ok, report.failures
    # the bounds calibrated in the run (3x vanilla's own bf16 rounding), never below the floors
    assert report.tolerances.loss >= BF16_TOLERANCES.loss and report.forced_routes == 0
    assert report.max_loss_diff is not None and 0 < report.max_loss_diff <= report.tolerances.loss


def test_every_layer_is_fused_and_logits_match(checkpoints: dict[str, Path], case: Case) -> None:
    vanilla = load_model(checkpoints[case.name])
    patched = load_model(checkpoints[case.name], PACK)
    assert owners(patched) == dict.fromkeys(case.replaced, PACK)
    vanilla_types = {name: type(module).__name__ for name, module in vanilla.named_modules()}
    replaced = {name for name, cls in vanilla_types.items() if cls in case.replaced}
    assert replaced, "the case has modules to fuse"
    for name, module in patched.named_modules():
        if name in replaced:
            assert type(module).__name__ == case.replaced[vanilla_types[name]], name
            fused, parts = (
                ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
                if "qkv_proj" in module._modules
                else ("gate_up_proj", ("gate_proj", "up_proj"))
            )
            assert isinstance(module._modules[fused], SharedProjection), name
            assert all(type(module._modules[part]) is ProjectionView for part in parts), name
            # the original's forward, not a re-written one
            original = type(vanilla.get_submodule(name))
            assert type(module).forward is original.forward and isinstance(module, original)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    expected, actual = logits_of(vanilla, ids, mask), logits_of(patched, ids, mask)
    assert torch.isfinite(expected[mask.bool()]).all()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    # The mask matters here (so that the comparison above covers it).
    unmasked = logits_of(patched, ids, torch.ones_like(mask))
    assert (unmasked[2, -1] - actual[2, -1]).abs().max() > 1e-3


def test_greedy_generation_with_kv_cache_matches_vanilla(checkpoints: dict[str, Path], case: Case) -> None:
    vanilla = load_model(checkpoints[case.name])
    patched = load_model(checkpoints[case.name], PACK)
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
    assert torch.equal(actual.sequences, expected.sequences)
    assert len(set(actual.sequences[:, 12:].flatten().tolist())) > 3, "degenerate generation: the test proves little"
    torch.testing.assert_close(torch.stack(actual.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)
    # The pack's attention filled the cache (transformers would silently recompute the
    # whole sequence at every step if it stayed empty).
    cache = getattr(actual, "cache", None) or getattr(actual, "past_key_values", None)
    assert cache is not None
    layers = patched.config.num_hidden_layers
    assert [cache.get_seq_length(layer) for layer in range(layers)] == [12 + 19] * layers


def test_save_pretrained_writes_the_original_layout(checkpoints: dict[str, Path], case: Case, tmp_path: Path) -> None:
    source = checkpoints[case.name]
    patched = load_model(source, PACK)
    patched.save_pretrained(tmp_path)
    written, original = safetensors_of(tmp_path), safetensors_of(source)
    assert sorted(written) == sorted(original)
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in written)
    for key, tensor in original.items():
        assert written[key].shape == tensor.shape and written[key].dtype == tensor.dtype, key
        assert torch.equal(written[key], tensor), key


@pytest.mark.parametrize("name", list(CASES))
def test_from_config_initialises_and_saves_the_original_layout(
    checkpoints: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """A model built from a config (no checkpoint) is patched, initialised, and saves what
    vanilla would save for that config; a vanilla reload of it computes the same logits."""
    config = CASES[name].config
    hfpatch_core.enable(PACK, strict=True)
    try:
        model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        hfpatch_core.disable()
    assert owners(model) == dict.fromkeys(CASES[name].replaced, PACK)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.isfinite(qkv).all() and qkv.std() > config.initializer_range / 2
    model.save_pretrained(tmp_path)
    expected = {key: tuple(value.shape) for key, value in safetensors_of(checkpoints[name]).items()}
    assert {key: tuple(value.shape) for key, value in safetensors_of(tmp_path).items()} == expected
    reloaded = load_model(tmp_path)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=3)
    torch.testing.assert_close(logits_of(reloaded, ids, mask), logits_of(model, ids, mask), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-bias", "qwen2_moe", "olmo2"])
def test_from_config_with_a_seed_draws_vanilla_weights(name: str) -> None:
    """Building the fused projection draws no random numbers, and transformers initialises
    the views' rows in vanilla's module order: the same seed gives vanilla's weights."""
    config = CASES[name].config
    torch.manual_seed(0)
    vanilla = hfpatch_core.original_state_dict(AutoModelForCausalLM.from_config(config))
    hfpatch_core.enable(PACK, strict=True)
    try:
        torch.manual_seed(0)
        patched = AutoModelForCausalLM.from_config(config)
    finally:
        hfpatch_core.disable()
    assert owners(patched) == dict.fromkeys(CASES[name].replaced, PACK)
    original = hfpatch_core.original_state_dict(patched)
    assert sorted(original) == sorted(vanilla)
    assert all(torch.equal(original[key], value) for key, value in vanilla.items())


@pytest.mark.parametrize("name", ["mistral-sliding", "qwen2-sliding"])
def test_the_sliding_window_cases_exercise_the_window(checkpoints: dict[str, Path], name: str) -> None:
    """On the patched model, widening the 4-token window changes the logits past it and only there."""
    path = checkpoints[name]
    config = AutoConfig.from_pretrained(path)
    assert config.sliding_window == 4
    windowed = load_model(path, PACK)
    config.sliding_window = 1000
    widened = load_model(path, PACK, config=config)
    ids, mask = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6)), torch.ones(1, 12)
    inside, outside = logits_of(windowed, ids, mask), logits_of(widened, ids, mask)
    torch.testing.assert_close(inside[:, :4], outside[:, :4], rtol=0, atol=1e-5)
    assert (inside[:, 4:] - outside[:, 4:]).abs().max() > 1e-2


def test_the_attention_function_gets_what_the_original_passes(
    checkpoints: dict[str, Path], case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every keyword argument the original attention hands the attention function
    (``sliding_window`` from the layer or the config, scaling, dropout, the cache and mask
    arguments) reaches it from the fused attention too, with the same value.  On CPU the
    window lives in the mask, so logits alone would not show a lost ``sliding_window``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls: list[dict[str, Any]] = []

    def capture(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(
            {"layer": module.layer_idx, "shape": tuple(query.shape), **{k: repr(v)[:40] for k, v in kwargs.items()}}
        )
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", capture)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=9)
    seen = []
    for packs in (None, PACK):
        model = load_model(checkpoints[case.name], packs, attn_implementation="sdpa")
        calls.clear()
        logits_of(model, ids, mask)
        seen.append(list(calls))
    vanilla, patched = seen
    assert len(vanilla) == case.config.num_hidden_layers
    assert patched == vanilla
    windows = {call.get("sliding_window") for call in vanilla}
    if case.name in ("mistral-sliding", "qwen2-sliding"):
        assert "4" in windows, windows


def test_attention_outputs_are_recorded(checkpoints: dict[str, Path]) -> None:
    """``output_attentions`` works on the patched model (its attention subclasses the
    original, which the output recorders look for) and gives vanilla's weights."""
    path = checkpoints["qwen3"]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=5)
    patched = load_model(path, PACK, attn_implementation="eager")
    vanilla = load_model(path, attn_implementation="eager")
    with torch.no_grad():
        expected = vanilla(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        actual = patched(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert expected is not None and actual is not None and len(actual) == len(expected) == 2
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_patched_load_leaves_transformers_unpatched(checkpoints: dict[str, Path]) -> None:
    originals = {
        (case.config.model_type, name): getattr(MODELING[case.config.model_type], name)
        for case in CASES.values()
        for name in case.replaced
    }
    for name in ("llama", "qwen3", "qwen2_moe", "olmo2"):
        load_model(checkpoints[name], PACK)
    for (model_type, name), cls in originals.items():
        assert getattr(MODELING[model_type], name) is cls
        assert not issubclass(cls, FusedViewsMixin)
    vanilla = load_model(checkpoints["llama"])
    assert type(vanilla.model.layers[0].self_attn) is MODELING["llama"].LlamaAttention
    assert type(vanilla.model.layers[0].mlp) is MODELING["llama"].LlamaMLP


def test_the_fused_classes_unpickle_in_a_fresh_process(checkpoints: dict[str, Path]) -> None:
    """Pickle names a class by module and name; the runtime-built classes are found again
    in a process that has not built them yet (``torch.load`` of a whole model, a worker)."""
    import pickle

    model = load_model(checkpoints["qwen2_moe"], PACK)
    classes = sorted({type(m) for m in model.modules() if isinstance(m, FusedViewsMixin)}, key=str)
    assert len(classes) == 2
    # each class with the transformers class it derives from (the first in its MRO)
    probe = (
        "import pickle, sys; "
        "print([(c.__name__, next(b.__name__ for b in c.__mro__ if b.__module__.startswith('transformers.'))) "
        "for c in pickle.loads(bytes.fromhex(sys.argv[1]))])"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe, pickle.dumps(classes).hex()], capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == str(
        [("FusedGateUpQwen2MoeMLP", "Qwen2MoeMLP"), ("FusedQKVQwen2MoeAttention", "Qwen2MoeAttention")]
    )


def test_a_whole_patched_model_round_trips_through_torch_save(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """``torch.save(model)`` in this process, ``torch.load`` + ``save_pretrained`` in a fresh
    one: the fused classes and the save guard unpickle, and the original layout is written."""
    source = checkpoints["llama"]
    torch.save(load_model(source, PACK), tmp_path / "model.pt")
    probe = (
        "import sys, torch; "
        "model = torch.load(sys.argv[1], weights_only=False); "
        "model.save_pretrained(sys.argv[2]); "
        "print(type(model.model.layers[0].self_attn).__name__)"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "model.pt"), str(tmp_path / "saved")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip().splitlines()[-1] == "FusedQKVLlamaAttention"
    written, original = safetensors_of(tmp_path / "saved"), safetensors_of(source)
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[key], tensor) for key, tensor in original.items())


# --- the hooks --------------------------------------------------------------------------


def test_hooks_return_nothing_without_a_config_or_where_nothing_is_separate() -> None:
    for model_type in ("gemma", "phi3", "mixtral", "olmo2", None):
        context = LoadContext(model_type=model_type, model_class_name="AnyModel", config=None)
        assert hfpatch_pack_fused_dense.provide_patches(context) == []
        assert hfpatch_pack_fused_dense.provide_converters(context) == []
    # phi3 already has qkv_proj and gate_up_proj: nothing to fuse, nothing refused
    phi3 = AutoConfig.for_model("phi3", num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    phi3.num_attention_heads = phi3.num_key_value_heads = 4
    assert hfpatch_pack_fused_dense.provide_patches(LoadContext("phi3", "Phi3ForCausalLM", phi3)) == []
    assert hfpatch_pack_fused_dense.refusals(phi3, "Phi3ForCausalLM") == {}


def test_a_model_type_no_table_names_is_claimed_by_structure(tmp_path: Path) -> None:
    """exaone builds llama's classes itself: the classes come from its modules, not its name.
    Its checkpoints keep exaone's own names (``mlp.c_fc_0``), which transformers renames to
    ``gate_proj`` before this pack's converter fuses them, and saves back."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "exaone" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers release has no exaone (added after 5.3)")
    config = AutoConfig.for_model(
        "exaone",
        num_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        eos_token_id=2,
        initializer_range=0.2,
    )
    patches = hfpatch_pack_fused_dense.provide_patches(LoadContext("exaone", "ExaoneForCausalLM", config))
    assert sorted((p.target, p.replacement.__name__) for p in patches) == [
        ("LlamaAttention", "FusedQKVLlamaAttention"),
        ("LlamaMLP", "FusedGateUpLlamaMLP"),
    ]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert any(".mlp.c_fc_0." in key for key in safetensors_of(tmp_path))
    report = assert_pack_equivalent(PACK, tmp_path, expected_replacements=["LlamaAttention", "LlamaMLP"])
    assert report.round_trip and report.max_abs_diff is not None and report.max_abs_diff <= 1e-5


def test_converters_follow_the_detected_sizes(case: Case) -> None:
    config = case.config
    context = LoadContext(model_type=config.model_type, model_class_name="AnyModel", config=config)
    patches = hfpatch_pack_fused_dense.provide_patches(context)
    converters = hfpatch_pack_fused_dense.provide_converters(context)
    assert [(p.target, p.replacement.__name__) for p in patches] == sorted(case.replaced.items())
    # every claim yields to a pack written for the family (qwen-moe on the MoE attention)
    assert {p.priority for p in patches} == {hfpatch_pack_fused_dense.PRIORITY} == {-1}
    # one converter per replaced class, with that class's priority
    assert [c.key for c in converters] == [config.model_type] * len(patches)
    assert [c.patch_targets for c in converters] == [(p.target,) for p in patches]
    assert [c.priority for c in converters] == [p.priority for p in patches]
    transforms = {
        (source_patterns_of(t), t.operations[0].sizes)
        for c in converters
        for t in c.transforms
        if isinstance(t.operations[0], SizedConcatenate)
    }
    assert len(transforms) == sum(len(c.transforms) for c in converters)
    expected = set()
    for _, path, sizes, bias in expected_sites(config):
        parts = ("q_proj", "k_proj", "v_proj") if path == "self_attn" else ("gate_proj", "up_proj")
        # the weights (and a quantized checkpoint's weight_* tensors), the biases, the static activation parameters
        for suffix in ("weight", "bias", "input_") if bias else ("weight", "input_"):
            expected.add((tuple(f"{path}.{part}.{suffix}" for part in parts), sizes))
    assert transforms == expected


def test_the_fused_projections_declare_their_sharding() -> None:
    """Column-parallel fused projections; FSDP2 and expert parallelism as the model's plan says."""
    config = CASES["qwen2_moe"].config
    context = LoadContext("qwen2_moe", "Qwen2MoeForCausalLM", config, parallel=("tp", "ep"))
    plans = {
        p.target: (p.replacement.hfpatch_tp_plan, p.replacement.hfpatch_fsdp_plan, p.replacement.hfpatch_ep_plan)
        for p in hfpatch_pack_fused_dense.provide_patches(context)
    }
    assert plans == {
        "Qwen2MoeAttention": ({"qkv_proj": "colwise"}, {}, {}),
        "Qwen2MoeMLP": ({"gate_up_proj": "colwise"}, {}, {}),
    }


# --- the family's own forward, once per input ---------------------------------------------


@pytest.mark.parametrize("name", ["llama", "olmo2"])
def test_the_fused_matmul_runs_once_per_input(checkpoints: dict[str, Path], name: str) -> None:
    """The original forward calls q_proj, k_proj and v_proj (gate_proj and up_proj); the
    shared projection computes one matmul per layer for them, and keeps nothing after."""
    model = load_model(checkpoints[name], PACK)
    shared = [module for module in model.modules() if isinstance(module, SharedProjection)]
    calls: list[int] = []
    for module in shared:
        module.register_forward_hook(lambda m, args, out: calls.append(id(m)))
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    logits_of(model, ids, mask)
    assert sorted(calls) == sorted(id(module) for module in shared)  # each once
    assert all(module._computed is None for module in shared)


def test_a_view_called_on_another_input_still_gives_the_original_output() -> None:
    """A view given another tensor than its siblings (what a cross-attention would do) gets
    that tensor's projection: fusion saves matmuls, it never changes an output."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CASES["llama-bias"].config)
    attention = model.model.layers[0].self_attn
    q, k, v = (attention.q_proj.weight.clone(), attention.k_proj.weight.clone(), attention.v_proj.weight.clone())
    hfpatch_core.apply(model, packs=PACK, strict=True)
    fused = model.model.layers[0].self_attn
    x, y = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    bias = fused.qkv_proj.bias
    torch.testing.assert_close(fused.q_proj(x), x @ q.T + bias[:32], atol=1e-6, rtol=0)
    torch.testing.assert_close(fused.k_proj(y), y @ k.T + bias[32:64], atol=1e-6, rtol=0)
    torch.testing.assert_close(fused.v_proj(x), x @ v.T + bias[64:], atol=1e-6, rtol=0)
    x.mul_(2)  # changed in place: not the input the cached output was computed for
    torch.testing.assert_close(fused.q_proj(x), x @ q.T + bias[:32], atol=1e-6, rtol=0)


# --- composing with qwen-moe ------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_composes_with_qwen_moe(checkpoints: dict[str, Path], name: str, tmp_path: Path) -> None:
    """Both packs on the model types both touch: qwen-moe wins the attention (fused-dense
    claims it, and its converter, at priority -1), fused-dense fuses the MLPs qwen-moe
    leaves alone, and the result still matches vanilla and saves the original layout."""
    assert "qwen-moe" in hfpatch_core.discover().packs, "install plugins/hfpatch-pack-qwen-moe too"
    attention, mlp = sorted(CASES[name].replaced)
    source = checkpoints[name]
    both = load_model(source, "qwen-moe,fused-dense")
    experts = "Qwen2MoeExperts" if name == "qwen2_moe" else "Qwen3MoeExperts"
    assert owners(both) == {attention: "qwen-moe", experts: "qwen-moe", mlp: PACK}
    plan = hfpatch_core.plan_of(both)
    assert plan is not None
    (lost,) = [lost for lost in plan.lost if lost.claim.pack == PACK]
    assert lost.claim.target == attention and lost.winner is not None and lost.winner.pack == "qwen-moe"
    assert "priority -1 < 0" in lost.reason
    (lost_converter,) = plan.conversions.lost
    assert lost_converter[0].pack == PACK and lost_converter[0].priority == -1
    assert {c.pack for c in plan.conversions.claims} == {"qwen-moe", PACK}

    vanilla = load_model(source)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=7)
    torch.testing.assert_close(logits_of(both, ids, mask), logits_of(vanilla, ids, mask), rtol=0, atol=1e-5)
    both.save_pretrained(tmp_path)
    written, original = safetensors_of(tmp_path), safetensors_of(source)
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[key], tensor) for key, tensor in original.items())


def test_raising_fused_dense_priority_makes_it_win_the_attention(checkpoints: dict[str, Path]) -> None:
    """The conflict is resolved by priority only: ``fused-dense@+2`` takes the attention
    (patch and converter together) and the model is still correct; ``@+1`` ties, which
    hfpatch refuses with an error naming both packs."""
    source = checkpoints["qwen2_moe"]
    with pytest.raises(hfpatch_core.PatchConflictError, match="'fused-dense' and 'qwen-moe' both replace"):
        load_model(source, "qwen-moe,fused-dense@+1")
    flipped = load_model(source, "qwen-moe,fused-dense@+2")
    assert owners(flipped) == {"Qwen2MoeAttention": PACK, "Qwen2MoeExperts": "qwen-moe", "Qwen2MoeMLP": PACK}
    assert type(flipped.model.layers[0].self_attn).__module__ == "hfpatch_pack_fused_dense.modules"
    plan = hfpatch_core.plan_of(flipped)
    assert plan is not None
    assert [lost.claim.pack for lost in plan.lost] == ["qwen-moe"]
    assert [claim.pack for claim, _ in plan.conversions.lost] == ["qwen-moe"]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=8)
    vanilla = load_model(source)
    torch.testing.assert_close(logits_of(flipped, ids, mask), logits_of(vanilla, ids, mask), rtol=0, atol=1e-5)


_RIVAL_ATTENTION = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaAttention

class RivalAttention(LlamaAttention):
    pass

@hookimpl
def provide_patches(context):
    return [Patch("LlamaAttention", RivalAttention, priority=1)] if context.model_type == "llama" else []
"""


def test_a_pack_winning_one_class_without_a_converter_leaves_that_class_unconverted(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another pack takes LlamaAttention (priority 1) and keeps q/k/v as they are: only
    this pack's MLP converter applies, so the checkpoint's q/k/v load unfused into the
    rival's attention and gate/up fused into this pack's MLP."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the rival is installed for this test only
    install_pack(tmp_path / "site", "rival-attention", _RIVAL_ATTENTION)
    source = checkpoints["llama"]
    model = load_model(source, f"{PACK},rival-attention")
    assert owners(model) == {"LlamaAttention": "rival-attention", "LlamaMLP": PACK}
    plan = hfpatch_core.plan_of(model)
    assert plan is not None
    [(lost, reason)] = plan.conversions.lost
    assert (lost.pack, lost.converter.patch_targets) == (PACK, ("LlamaAttention",))
    assert reason.startswith("its patch 'LlamaAttention' is not applied: priority -1 < 1 of pack 'rival-attention'")
    assert {origin for entries in plan.conversions.lists.values() for origin in (e.origin for e in entries)} == {PACK}

    vanilla = load_model(source)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=9)
    torch.testing.assert_close(logits_of(model, ids, mask), logits_of(vanilla, ids, mask), rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    written, original = safetensors_of(tmp_path / "saved"), safetensors_of(source)
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[key], tensor) for key, tensor in original.items())


# --- discovery from a real wheel --------------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json, sys
    import importlib_metadata
    import hfpatch_core
    from transformers import AutoModelForCausalLM

    hfpatch_core.enable()  # HF_PATCH_PACKS=fused-dense
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    plan = hfpatch_core.plan_of(model)
    pack = hfpatch_core.discover().packs["fused-dense"]
    print(json.dumps({
        "distribution_files": str(importlib_metadata.distribution("hfpatch-pack-fused-dense").locate_file("")),
        "module_file": pack.load().__file__,
        "replaced": {name: claim.pack for name, claim in plan.replaced.items()},
        "attention": type(model.model.layers[0].self_attn).__module__,
    }))
    """
)


def test_the_pack_is_discovered_from_an_installed_wheel(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # The wheel's copy is alone on the path, ahead of any other install of the pack.
    installed = discover_from_wheel(PACK_DIR, PACK, tmp_path)
    assert installed.wheel.name.startswith("hfpatch_pack_fused_dense-0.1.0-"), installed.wheel
    row = installed.row
    assert (row["distribution"], row["version"], row["enabled"]) == ("hfpatch-pack-fused-dense", "0.1.0", True)
    assert row["transformers"] == "<6,>=5.3" and row["description"]

    probe = installed.run_python("-c", _PROBE, checkpoints["qwen2-sliding"])
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(found["distribution_files"]).resolve() == installed.site.resolve()
    assert Path(found["module_file"]).resolve().is_relative_to(installed.site.resolve())
    assert found["replaced"] == {"Qwen2Attention": PACK, "Qwen2MLP": PACK}
    assert found["attention"] == "hfpatch_pack_fused_dense.modules"


def test_hfpatch_check_covers_the_sample_model_types(capsys: pytest.CaptureFixture[str]) -> None:
    """The pack decides from the config; ``provide_model_types`` tells ``check`` and ``verify`` where to look."""
    from hfpatch_core.cli import main

    assert hfpatch_pack_fused_dense.provide_model_types() == list(SAMPLE_MODEL_TYPES)
    assert main(["check", PACK]) == 0
    version = hfpatch_pack_fused_dense.__version__
    assert capsys.readouterr().out == f"ok    {PACK} {version}: targets {', '.join(SAMPLE_MODEL_TYPES)}\n"


def test_a_candidate_the_pack_leaves_alone_is_a_refusal_with_its_reason() -> None:
    """whisper's attention serves as a cross-attention too: q reads another input than k/v, and
    of k/v only v has a bias, so neither the whole fusion nor k/v's can be made exactly; the
    pack refuses it, and says why in the plan, explain and check."""
    from hfpatch_core import Refusal
    from hfpatch_core.testing import tiny_config

    config = tiny_config("whisper")
    context = LoadContext("whisper", "WhisperForCausalLM", config)
    offered = hfpatch_pack_fused_dense.provide_patches(context)
    refused = {item.target: item.reason for item in offered if isinstance(item, Refusal)}
    assert refused and refused == hfpatch_pack_fused_dense.refusals(config, "WhisperForCausalLM")
    assert "different inputs" in refused["WhisperAttention"] and "have a bias" in refused["WhisperAttention"]
    assert all(reason.strip() for reason in refused.values())
    claimed = {item.target for item in offered if not isinstance(item, Refusal)}
    assert not claimed & set(refused)


# --- quantized checkpoints (with llm-compressor itself: interop/test_schemes.py) ------------------


def quantized_config(quantization: dict[str, Any]) -> Any:
    from hfpatch_core.testing import tiny_config

    config = tiny_config("llama")
    config.quantization_config = quantization
    return config


def test_a_compressed_tensors_checkpoint_gets_the_classes_its_quantizer_takes_for_one_linear() -> None:
    config = quantized_config(
        {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"]}}, "ignore": ["lm_head"]}
    )
    fusions = hfpatch_pack_fused_dense.fusions_for(LoadContext("llama", "LlamaForCausalLM", config))
    assert [fusion.replacement.__name__ for fusion in fusions] == [
        "QuantizableFusedQKVLlamaAttention",
        "QuantizableFusedGateUpLlamaMLP",
    ]
    assert all(fusion.replacement.hfpatch_quantizable_views for fusion in fusions)
    assert not hfpatch_pack_fused_dense.refusals(config, "LlamaForCausalLM")


@pytest.mark.parametrize(
    ("quantization", "reason"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quantized by gptq"),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["re:.*q_proj$"]}}},
            "quantizes the parts differently",
        ),
    ],
)
def test_a_quantized_checkpoint_the_fused_projection_cannot_hold_is_refused_and_said(quantization, reason) -> None:
    from hfpatch_core import PackWarning, Refusal

    config = quantized_config(quantization)
    context = LoadContext("llama", "LlamaForCausalLM", config)
    with pytest.warns(PackWarning) as record:
        offered = hfpatch_pack_fused_dense.provide_patches(context)
    assert any(re.search(f"'fused-dense' leaves LlamaAttention unfused: .*{reason}", str(w.message)) for w in record)
    refused = {item.target: item.reason for item in offered if isinstance(item, Refusal)}
    assert reason in refused["LlamaAttention"]
    fused = {fusion.original.__name__ for fusion in hfpatch_pack_fused_dense.fusions_for(context)}
    assert "LlamaAttention" not in fused
