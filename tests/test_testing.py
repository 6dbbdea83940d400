from __future__ import annotations

import pytest
import torch

from hfpatch_core.testing import (
    EquivalenceError,
    TinyCheckpointError,
    assert_pack_equivalent,
    tiny_checkpoint,
    tiny_config,
)
from packs import DOUBLING_PACK, MLP_PACK, PackSpec, fused_qkv_pack

PLUGIN_TEST = """
from hfpatch_core.testing import assert_pack_equivalent

def test_pack(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama", num_hidden_layers=3)
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
    from hfpatch_core.testing import _tensors

    first, second = _tensors(path), _tensors(again)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)  # seeded


def test_a_shrunk_hybrid_model_keeps_a_full_attention_layer(tmp_path) -> None:
    # qwen3_next's default pattern is 3 linear-attention layers then 1 full: 2 layers of
    # it alone would be all linear attention, which transformers rejects
    config = tiny_config("qwen3_next")
    assert config.layer_types == ["linear_attention", "full_attention"]
    assert (tiny_checkpoint("qwen3_next", tmp_path) / "model.safetensors").exists()


def test_tiny_checkpoint_explains_what_to_do_when_it_cannot_shrink() -> None:
    with pytest.raises(TinyCheckpointError, match="not a model type"):
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


def test_bf16_is_compared_within_the_documented_tolerance(install, llama_checkpoint) -> None:
    install(PackSpec("mlp", MLP_PACK))
    report = assert_pack_equivalent("mlp", llama_checkpoint, dtype=torch.bfloat16, generate_tokens=0)
    assert report.max_abs_diff is not None and report.max_abs_diff <= 5e-2
