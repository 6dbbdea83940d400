from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import hfpatch_core
from hfpatch_core.authoring import class_keys_supported
from hfpatch_core.testing import (
    BF16_ATOL,
    EquivalenceError,
    HeldRouting,
    TinyCheckpointError,
    assert_pack_equivalent,
    check_pack_equivalence,
    check_training_equivalence,
    discover_from_wheel,
    load_model,
    logits_of,
    padded_batch,
    safetensors_of,
    tiny_checkpoint,
    tiny_config,
)
from packs import DOUBLING_PACK, MLP_PACK, PackSpec, fused_mlp_pack, fused_qkv_pack

PLUGIN_TEST = """
from hfpatch_core.testing import assert_pack_equivalent

def test_pack(tiny_checkpoint_factory):
    checkpoint = tiny_checkpoint_factory("llama", num_hidden_layers=3)
    assert_pack_equivalent({pack!r}, checkpoint{extra})
"""


def run_plugin(pytester: pytest.Pytester, pack: str, extra: str = "") -> pytest.RunResult:
    pytester.makepyfile(PLUGIN_TEST.format(pack=pack, extra=extra))
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_tiny_checkpoint_shrinks_each_family(model_type: str, tmp_path) -> None:
    path = tiny_checkpoint(model_type, tmp_path)
    config = tiny_config(model_type)
    assert (path / "model.safetensors").exists() and config.hidden_size <= 64 and config.num_hidden_layers == 2
    again = tiny_checkpoint(model_type, tmp_path / "again")
    first, second = safetensors_of(path), safetensors_of(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)  # seeded


def test_a_shrunk_hybrid_model_keeps_a_full_attention_layer(tmp_path) -> None:
    # qwen3_next's default pattern is 3 linear-attention layers then 1 full: 2 layers of
    # it alone would be all linear attention, which transformers rejects
    config = tiny_config("qwen3_next")
    assert config.layer_types == ["linear_attention", "full_attention"]
    assert (tiny_checkpoint("qwen3_next", tmp_path) / "model.safetensors").exists()


def test_tiny_checkpoint_explains_what_to_do_when_it_cannot_shrink() -> None:
    with pytest.raises(TinyCheckpointError, match=r"not a model type .*; did you mean 'llama'"):
        tiny_checkpoint("lama")
    with pytest.raises(TinyCheckpointError, match=r"pass an explicit config: tiny_checkpoint\(MyConfig\(...\)\)"):
        tiny_checkpoint("llama", hidden_act="no-such-activation")


def test_a_good_pack_passes(install, pytester) -> None:
    install(PackSpec("mlp", MLP_PACK))
    run_plugin(pytester, "mlp", ", expected_replacements=['LlamaMLP']").assert_outcomes(passed=1)


def test_a_pack_changing_the_math_fails_naming_the_first_diverging_layer(install, pytester) -> None:
    install(PackSpec("doubling", DOUBLING_PACK))
    result = run_plugin(pytester, "doubling")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*logits differ: max abs diff * > atol 1e-05; first divergence: layer 0, module model.layers.0.mlp*"]
    )
    result.stdout.fnmatch_lines(["*greedy generation of 20 tokens differs*"])


def test_expect_different_keeps_structural_and_round_trip_checks(install, llama_checkpoint) -> None:
    install(PackSpec("doubling", DOUBLING_PACK))
    report = assert_pack_equivalent("doubling", llama_checkpoint, expect="different")
    assert report.replaced == {"LlamaMLP": "DoubledMLP"} and report.round_trip and report.max_abs_diff > 1e-3


def test_a_pack_with_a_missing_converter_fails_on_weights(install, pytester) -> None:
    install(PackSpec("qkv", fused_qkv_pack(converter="none")))
    result = run_plugin(pytester, "qkv")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*loading with pack 'qkv' failed: WeightLayoutError*", "*qkv_proj.weight: missing from the checkpoint*"]
    )


def test_a_pack_breaking_the_round_trip_fails_on_saving(install, pytester) -> None:
    install(PackSpec("qkv", fused_qkv_pack(converter="chunk")))
    result = run_plugin(pytester, "qkv")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*save_pretrained failed: WeightLayoutError: refusing to save*"])


def test_every_failure_is_reported_at_once(install, llama_checkpoint) -> None:
    install(PackSpec("doubling", DOUBLING_PACK))
    with pytest.raises(EquivalenceError) as caught:
        assert_pack_equivalent("doubling", llama_checkpoint, expected_replacements=["LlamaAttention"])
    failures = caught.value.failures
    assert any(f.startswith("replaced classes ['LlamaMLP'], expected ['LlamaAttention']") for f in failures)
    assert any(
        f.startswith("logits differ") and "first divergence: layer 0, module model.layers.0.mlp" in f for f in failures
    )
    assert not any(f.startswith("save_pretrained") for f in failures)  # the layout itself is fine


def test_bf16_is_compared_within_the_calibrated_tolerance(install, llama_checkpoint, tmp_path: Path) -> None:
    install(PackSpec("mlp", MLP_PACK))
    report = assert_pack_equivalent("mlp", llama_checkpoint, dtype=torch.bfloat16, generate_tokens=0)
    assert report.max_abs_diff == 0.0  # a subclass that changes nothing: vanilla's logits, bit for bit
    # the bound: BF16_CALIBRATION times vanilla's own bf16 rounding (against fp32), at least BF16_ATOL
    assert report.atol is not None and report.atol >= BF16_ATOL and report.forced_routes == 0
    install(PackSpec("doubling", DOUBLING_PACK))
    sharp = tiny_checkpoint("llama", tmp_path, initializer_range=0.2)  # logits of a few units, not hundredths
    wrong = check_pack_equivalence("doubling", sharp, dtype=torch.bfloat16, generate_tokens=0)
    assert wrong.atol is not None and wrong.max_abs_diff is not None and wrong.max_abs_diff > 4 * wrong.atol
    assert any(f.startswith(f"logits differ: max abs diff {wrong.max_abs_diff:.3g} > atol ") for f in wrong.failures)


# --- helpers for a pack's own tests ------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_padded_batch_is_three_left_padded_prompts() -> None:
    ids, mask = padded_batch(160, pad_token_id=0, seed=4)
    assert ids.shape == mask.shape == (3, 12) and ids.dtype == mask.dtype == torch.int64
    assert mask.sum(dim=1).tolist() == [12, 8, 5]
    for row, length in zip(mask, (12, 8, 5), strict=True):
        assert row.tolist() == [0] * (12 - length) + [1] * length  # padded on the left
    assert ids[mask == 0].eq(0).all()
    assert ids[mask == 1].ge(3).all() and ids.lt(160).all()
    again, _ = padded_batch(160, pad_token_id=0, seed=4)
    other, _ = padded_batch(160, pad_token_id=0, seed=5)
    assert torch.equal(ids, again) and not torch.equal(ids, other)
    padded, _ = padded_batch(160, pad_token_id=159, seed=4)
    assert padded[mask == 0].eq(159).all() and torch.equal(padded[mask == 1], ids[mask == 1])
    with pytest.raises(ValueError, match="pad_token_id 160 is not a token of a vocabulary of 160"):
        padded_batch(160, pad_token_id=160)
    with pytest.raises(ValueError, match="vocab_size must be above 3"):
        padded_batch(3, pad_token_id=0)


def test_safetensors_of_reads_a_checkpoint_and_names_a_directory_without_one(llama_checkpoint, tmp_path) -> None:
    tensors = safetensors_of(llama_checkpoint)
    model = LlamaForCausalLM.from_pretrained(llama_checkpoint)
    state = model.state_dict()
    assert set(tensors) <= set(state) and "model.layers.1.mlp.down_proj.weight" in tensors
    assert all(torch.equal(tensor, state[name]) for name, tensor in tensors.items())
    with pytest.raises(FileNotFoundError, match=r"holds no \*\.safetensors file"):
        safetensors_of(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        safetensors_of(tmp_path / "missing")


def test_load_model_enables_the_pack_for_the_load_only(install, llama_checkpoint) -> None:
    install(PackSpec("mlp", MLP_PACK))
    patched = load_model(llama_checkpoint, "mlp")
    assert not hfpatch_core.is_enabled()
    assert type(patched.model.layers[0].mlp).__name__ == "PackMLP" and not patched.training
    plan = hfpatch_core.plan_of(patched)
    assert plan is not None and plan.replaced["LlamaMLP"].pack == "mlp"
    vanilla = load_model(llama_checkpoint)
    assert type(vanilla.model.layers[0].mlp).__name__ == "LlamaMLP" and hfpatch_core.plan_of(vanilla) is None
    ids, mask = padded_batch(vanilla.config.vocab_size, pad_token_id=0)
    logits = logits_of(patched, ids, mask)
    assert logits.shape == (3, 12, vanilla.config.vocab_size) and logits.dtype == torch.float32
    assert not logits.requires_grad
    torch.testing.assert_close(logits, logits_of(vanilla, ids, mask), rtol=0, atol=1e-5)


def test_load_model_leaves_hfpatch_as_it_found_it_when_the_load_raises(install, tmp_path) -> None:
    install(PackSpec("mlp", MLP_PACK))
    with pytest.raises(OSError):
        load_model(tmp_path / "no-checkpoint", "mlp")
    assert not hfpatch_core.is_enabled()
    with pytest.raises(hfpatch_core.SelectionError):
        load_model(tmp_path / "no-checkpoint", "no-such-pack")
    assert not hfpatch_core.is_enabled()


def test_load_model_is_vanilla_and_restores_a_session_that_was_enabled(install, llama_checkpoint) -> None:
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable("mlp", strict=False)
    vanilla = load_model(llama_checkpoint)
    assert type(vanilla.model.layers[0].mlp).__name__ == "LlamaMLP"
    patched = load_model(llama_checkpoint, "mlp")
    assert type(patched.model.layers[0].mlp).__name__ == "PackMLP"
    session = hfpatch_core._session.session.active_session()
    assert session is not None and session.selection.packs and not session.strict


def test_discover_from_wheel_lists_a_first_party_pack_from_its_wheel(tmp_path) -> None:
    project = ROOT / "plugins" / "hfpatch-pack-qwen-moe"
    with pytest.raises(ValueError, match="would shadow the installed wheel"):
        discover_from_wheel(project, "qwen-moe", project / "tests")
    installed = discover_from_wheel(project, "qwen-moe", tmp_path)
    assert installed.wheel.name.startswith("hfpatch_pack_qwen_moe-") and installed.site == tmp_path.resolve() / "site"
    assert installed.row["distribution"] == "hfpatch-pack-qwen-moe" and installed.row["enabled"] is True
    assert installed.env["PYTHONPATH"] == str(installed.site) and installed.env["HF_PATCH_PACKS"] == "qwen-moe"
    probe = "import json, hfpatch_core; print(json.dumps(hfpatch_core.discover().packs['qwen-moe'].load().__file__))"
    module_file = Path(json.loads(installed.run_python("-c", probe).stdout))
    assert module_file.resolve().is_relative_to(installed.site)
    with pytest.raises(AssertionError, match=r"python -c <code> exited with status 3\nstdout:\nout\n"):
        installed.run_python("-c", "print('out'); raise SystemExit(3)")
    with pytest.raises(FileExistsError, match="pass a fresh directory"):
        discover_from_wheel(project, "qwen-moe", tmp_path)


LEAVES_NOTHING = """
import os, sys
from hfpatch_core.testing import check_pack_equivalence, tiny_checkpoint
first, second = tiny_checkpoint("llama", num_hidden_layers=1), tiny_checkpoint("llama", num_hidden_layers=1)
assert first != second and (first / "model.safetensors").is_file() and (second / "config.json").is_file()
pid = os.fork()
if pid == 0:  # a forked child that exits normally must not remove its parent's checkpoints
    sys.exit(0)
os.waitpid(pid, 0)
assert (first / "model.safetensors").is_file()
report = check_pack_equivalence("mlp", "llama", generate_tokens=2)
assert report.ok, report.failures
print(len(os.listdir(os.environ["TMPDIR"])))
"""


def test_tiny_checkpoints_without_a_directory_leave_nothing_behind(install, tmp_path) -> None:
    site = install(PackSpec("mlp", MLP_PACK))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    checkout = str(Path(hfpatch_core.__file__).resolve().parents[1])
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_PATCH", "HFPATCH"))}
    environment.update(TMPDIR=str(scratch), PYTHONPATH=os.pathsep.join([str(site), checkout]))
    result = subprocess.run(
        [sys.executable, "-c", LEAVES_NOTHING], capture_output=True, text=True, env=environment, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"]  # while it runs: one folder, however many checkpoints
    assert list(scratch.iterdir()) == []  # after it exits: nothing


# --- composite models: the text model is loaded inside, with a plan of its own ---------------

QWEN2_FUSED_MLP_PACK = fused_mlp_pack("qwen2", "Qwen2MLP")
QWEN2_MLP_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

class PackQwen2MLP(Qwen2MLP):
    pass

@hookimpl
def provide_patches(context):
    return [Patch("Qwen2MLP", PackQwen2MLP)] if context.model_type == "qwen2" else []
"""


def _text_model_pack() -> tuple[str, str]:
    """A pack replacing qwen2's MLP, and its class: a fused one with a converter where transformers
    converts each sub-model with its own list; on 5.3, which converts with the root model type's list
    only (test_nested checks the error a converting pack gets there), one that keeps the weights' names."""
    if class_keys_supported():
        return QWEN2_FUSED_MLP_PACK, "FusedGateUpMLP"
    return QWEN2_MLP_PACK, "PackQwen2MLP"


def test_a_pack_patching_the_text_model_of_a_composite_model_verifies(install) -> None:
    # got_ocr2: an image-text model whose text model (qwen2) is built inside it by a load of its
    # own; its outer config has no vocab_size, and the pack's replacements are in the nested plan
    source, replacement = _text_model_pack()
    install(PackSpec("qwen2-mlp", source))
    report = assert_pack_equivalent("qwen2-mlp", "got_ocr2", apply_path=True, generate_tokens=3)
    assert report.replaced == {"Qwen2MLP": replacement} and report.max_abs_diff == 0.0
    assert report.apply_path and report.round_trip


def test_apply_reproduces_patches_inside_a_composite_models_text_model(install, tmp_path) -> None:
    source, replacement = _text_model_pack()
    install(PackSpec("qwen2-mlp", source))
    model = load_model(tiny_checkpoint("got_ocr2", tmp_path / "ckpt"))
    plan = hfpatch_core.apply(model, "qwen2-mlp")
    swapped = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith(".mlp") and "language" in n})
    assert swapped == [replacement] and any(inner.replaced for inner in plan.nested)
    hfpatch_core.revert(model)
    restored = {type(m).__name__ for n, m in model.named_modules() if n.endswith(".mlp") and "language" in n}
    assert restored == {"Qwen2MLP"}


# --- HeldRouting: top-k decisions held equal on both sides --------------------------------

# a router's scores: row 0's second and third expert within 1% of each other (a bf16 tie),
# row 1 far apart
VANILLA_LOGITS = [[2.0, 1.0, 0.99, 0.0], [2.0, 1.0, 0.0, -1.0]]
TIED_LOGITS = [[2.0, 0.99, 1.0, 0.0], [2.0, 1.0, 0.0, -1.0]]  # row 0's tie falls the other way
MOVED_LOGITS = [[2.0, 0.99, 1.0, 0.0], [0.0, 1.0, 2.0, -1.0]]  # and row 1 routed otherwise


def _route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(logits.softmax(-1), 2, dim=-1)
    return values, indices


def _recorded(dtype: torch.dtype = torch.bfloat16) -> HeldRouting:
    held = HeldRouting(dtype)
    with held.record():
        _route(torch.tensor(VANILLA_LOGITS))
    return held


def test_a_tie_routed_otherwise_takes_vanilla_s_route_with_its_own_scores_and_gradient() -> None:
    held = _recorded()
    logits = torch.tensor(TIED_LOGITS, requires_grad=True)
    with held.force():
        values, indices = logits.softmax(-1).topk(2, dim=-1)  # the method form is held too
    assert indices.tolist() == [[0, 1], [0, 1]] and torch.topk(logits.softmax(-1), 2).indices[0].tolist() == [0, 2]
    assert torch.equal(values, logits.softmax(-1).gather(-1, indices))
    values.sum().backward()
    expected = torch.tensor(TIED_LOGITS, requires_grad=True)
    expected.softmax(-1).gather(-1, indices).sum().backward()
    assert logits.grad is not None and torch.equal(logits.grad, expected.grad)
    assert (held.forced, held.decisions) == (1, 2) and held.finish() == []


def test_a_route_changed_beyond_a_tie_is_reported() -> None:
    held = _recorded()
    with held.force():
        _route(torch.tensor(MOVED_LOGITS))
    problems = held.finish()
    assert held.forced == 2 and len(problems) == 2, problems
    assert problems[0].startswith("routing: at top-k call 1, row 1, vanilla chose [0, 1] and the patched model [2, 1]")
    assert problems[1] == (
        "routing: 1 of 2 top-k decisions of the patched model differ from vanilla's beyond a tie (first ones "
        "above); 2 differed in all"
    )


def test_in_float32_a_one_percent_difference_is_not_a_tie() -> None:
    held = _recorded(torch.float32)
    with held.force():
        _route(torch.tensor(TIED_LOGITS))
    assert held.forced == 1 and "beyond a tie in float32" in held.finish()[0]


def test_a_different_number_of_top_k_calls_is_reported() -> None:
    held = _recorded()
    with held.record():
        _route(torch.tensor(VANILLA_LOGITS))
    with held.force():
        _route(torch.tensor(VANILLA_LOGITS))
    assert held.finish() == [
        "routing: vanilla made 2 top-k calls (MoE routing decisions), the patched model 1: the pack routes "
        "differently or computes top-k another way"
    ]
    more = _recorded()
    with more.force():
        _route(torch.tensor(VANILLA_LOGITS))
        _route(torch.tensor(VANILLA_LOGITS))
    assert more.finish() == [
        "routing: the patched model makes more top-k calls than vanilla's 1 (first extra: top-k call 2); "
        "it ran unforced"
    ]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_block_recomputes_with_the_routes_its_forward_took(reentrant: bool) -> None:
    """Recomputation in backward calls top-k again: it must get the forced route, not its own."""
    from torch.utils.checkpoint import checkpoint

    def block(logits: torch.Tensor) -> torch.Tensor:
        values, indices = _route(logits)
        return (values * (indices + 1)).sum()  # the gradient depends on the route

    def gradient(held: HeldRouting | None, checkpointed: bool) -> torch.Tensor:
        logits = torch.tensor(TIED_LOGITS, requires_grad=True)
        with held.force() if held is not None else contextlib.nullcontext():
            out = checkpoint(block, logits, use_reentrant=reentrant) if checkpointed else block(logits)
            out.backward()
        assert logits.grad is not None
        return logits.grad

    held = _recorded()
    forced = gradient(held.for_another_model(), checkpointed=False)
    assert not torch.equal(forced, gradient(None, checkpointed=False))  # the tie does change the gradient
    again = held.for_another_model()
    assert torch.equal(gradient(again, checkpointed=True), forced)
    assert again.finish() == [] and again.forced == 1


def test_a_pack_patching_the_text_model_of_a_composite_model_trains_like_vanilla(install, tmp_path) -> None:
    # the training batches come from the text model's vocabulary (the outer config has none)
    install(PackSpec("qwen2-mlp", _text_model_pack()[0]))
    report = check_training_equivalence("qwen2-mlp", tiny_checkpoint("got_ocr2", tmp_path / "ckpt"), steps=2)
    assert report.ok, report.failures
    assert report.max_loss_diff is not None and report.max_loss_diff <= 1e-4


def test_assert_pack_equivalent_takes_exactly_check_pack_equivalences_options() -> None:
    # the one raises what the other reports: their options must not drift apart
    import inspect

    from hfpatch_core.testing import check_pack_equivalence

    assert inspect.signature(assert_pack_equivalent).parameters == inspect.signature(check_pack_equivalence).parameters
