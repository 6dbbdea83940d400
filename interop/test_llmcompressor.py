"""llm-compressor interop (issue 22 item 3, issue 30 item 4); run by `make interop` in `.venv-interop` only.

llmcompressor 0.14.0.1 pins transformers 5.17.0, outside the two releases the normal
suite tests (5.24.0, 5.3.0), so it gets a venv of its own. What these tests pin:

* transformers 5.17 registers alias modules (``transformers.models.*.image_processing_*_fast``)
  whose ``__dir__`` imports torchvision; a load with a non-empty patch registry then fails
  without torchvision in vanilla transformers' ``apply_patches`` (hfpatch lists those modules
  by their own names and loads), and the torchvision wheel the index serves needs a CUDA
  torch. llm-compressor's own calls still meet the aliases: the later tests give them an
  empty ``__dir__`` (what a user without torchvision does).
* hfpatch's save guard behaves as a bound method, which llm-compressor's
  ``modify_save_pretrained`` requires: ``oneshot`` wraps it, and the compressed save still
  runs hfpatch's layout check.
* With the first worked around, FP8_DYNAMIC (data-free) through ``oneshot`` quantizes every
  expert projection of a qwen-moe-patched Qwen2-MoE, and the compressed checkpoint it
  saves reloads, vanilla and patched.
* llm-compressor's ``load_quantizable_moe`` (its ``clear_patch_mapping()`` after the load)
  around a patched load leaves hfpatch's state as it was.
* linear-experts on ERNIE 4.5 MoE, a family llm-compressor's load table (``ARCH_TO_IMPORT_PATHS``)
  lacks: without the pack the load holds 3-D experts, which ``oneshot`` swaps for its own
  ``LinearExperts2D`` after the load; with it the load holds per-expert ``nn.Linear`` modules
  (no 3-D copy), which ``oneshot`` (FP8_DYNAMIC) quantizes in place to the logits and the
  compressed tensors llm-compressor's own linearization gives; the checkpoint reloads with the
  pack (every expert quantized, logits equal) and without it (3-D experts decompressed, no
  scheme). W8A16 saves its weights as ``weight_packed``, which the save guard reads as the weight.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, monkey_patching
from transformers.models.qwen2_moe import modeling_qwen2_moe

import hfpatch_core
from conftest import broken_alias_modules
from hfpatch_core import PackWarning
from hfpatch_core._runtime.snapshot import GlobalState
from hfpatch_core.testing import tiny_checkpoint

transformers.utils.logging.disable_progress_bar()
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("qwen2-moe"))


@pytest.fixture(autouse=True)
def _disable() -> None:
    yield
    hfpatch_core.disable()


def ids(config) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))


def logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def expert_linears(model) -> list[torch.nn.Module]:
    return [
        getattr(expert, name)
        for layer in model.model.layers
        for expert in layer.mlp.experts
        for name in ("gate_proj", "up_proj", "down_proj")
    ]


def test_versions() -> None:
    import compressed_tensors
    import llmcompressor

    print(
        f"llmcompressor {llmcompressor.__version__}, compressed-tensors {compressed_tensors.__version__}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}"
    )
    assert transformers.__version__ == "5.17.0"


@pytest.mark.skipif(HAS_TORCHVISION, reason="torchvision installed: the alias modules import")
def test_without_torchvision_a_registered_load_fails_on_transformers_517_but_not_through_hfpatch(
    checkpoint,
) -> None:
    assert broken_alias_modules()  # e.g. transformers.models.aria.image_processing_aria_fast

    class Experts(modeling_qwen2_moe.Qwen2MoeExperts):
        pass

    monkey_patching.register_patch_mapping({"Qwen2MoeExperts": Experts})
    try:
        with pytest.raises(ModuleNotFoundError, match="torchvision"):  # vanilla transformers
            AutoModelForCausalLM.from_pretrained(checkpoint)
    finally:
        monkey_patching.clear_patch_mapping()
    state = GlobalState.capture()
    hfpatch_core.enable("qwen-moe")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)  # hfpatch lists alias modules by their own names
    hfpatch_core.disable()
    assert set(hfpatch_core.plan_of(model).replaced) == {"Qwen2MoeExperts", "Qwen2MoeAttention"}
    assert state.changes() == []


def test_oneshot_rebinds_hfpatchs_save_guard(checkpoint, defused) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    hfpatch_core.enable("qwen-moe")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hfpatch_core.disable()
    guard = model.save_pretrained
    assert guard.__self__ is model
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    assert model.save_pretrained is not guard and getattr(model.save_pretrained, "_overridden", False)


def test_oneshot_fp8_dynamic_reaches_every_expert_and_the_checkpoint_reloads(checkpoint, defused, tmp_path) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    state = GlobalState.capture()
    hfpatch_core.enable("qwen-moe")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hfpatch_core.disable()
    assert set(hfpatch_core.plan_of(model).replaced) == {"Qwen2MoeExperts", "Qwen2MoeAttention"}
    assert state.changes() == []
    tokens = ids(model.config)
    reference = logits(model, tokens)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    linears = expert_linears(model)
    assert len(linears) == model.config.num_hidden_layers * model.config.num_experts * 3
    assert all(hasattr(linear, "quantization_scheme") and hasattr(linear, "weight_scale") for linear in linears)
    assert all(hasattr(layer.self_attn.qkv_proj, "weight_scale") for layer in model.model.layers)
    quantized = logits(model, tokens)
    assert 0 < (quantized - reference).abs().max() < 0.1 * reference.abs().max()
    out = tmp_path / "fp8"
    model.save_pretrained(out, save_compressed=True)
    assert monkey_patching.get_patch_mapping() == {}

    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as saved:
        keys = set(saved.keys())
        assert saved.get_tensor("model.layers.0.mlp.experts.0.down_proj.weight").dtype == torch.float8_e4m3fn
    assert "model.layers.0.self_attn.q_proj.weight" in keys and not any("qkv_proj" in key for key in keys)

    vanilla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(vanilla.model.layers[0].mlp.experts) is modeling_qwen2_moe.Qwen2MoeExperts
    torch.testing.assert_close(logits(vanilla, tokens), quantized, rtol=0, atol=0.05)
    hfpatch_core.enable("qwen-moe")
    patched = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hfpatch_core.disable()
    assert all(hasattr(linear, "weight_scale") for linear in expert_linears(patched))
    torch.testing.assert_close(logits(patched, tokens), quantized, rtol=0, atol=1e-5)
    assert monkey_patching.get_patch_mapping() == {}


def test_load_quantizable_moe_around_a_patched_load(checkpoint, defused) -> None:
    """llm-compressor registers its own experts class (a user registration for hfpatch,
    which the pack's claim does not overwrite), loads, then clears the whole registry."""
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe

    tokens = ids(AutoModelForCausalLM.from_pretrained(checkpoint).config)
    vanilla = logits(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32), tokens)
    hfpatch_core.enable("qwen-moe")
    # llm-compressor overwrites qwen2_moe's conversion list with its own: the pack's
    # experts converter (which removes transformers' built-in fusing ones) finds none
    with load_quantizable_moe(), pytest.warns(PackWarning) as caught:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    said = [str(warning.message) for warning in caught]
    assert any("which matches no transform registered" in message for message in said), said
    # its registration displaces the pack's experts: named, never silent (issue 52.1)
    displaced = [message for message in said if "pack 'qwen-moe' does not replace Qwen2MoeExperts" in message]
    assert len(displaced) == 1 and "llmcompressor.modeling.moe.linear_experts.LinearExperts2D" in displaced[0]
    plan = hfpatch_core.plan_of(model)
    assert [(found.name, found.source, found.displaced) for found in plan.foreign] == [
        ("Qwen2MoeExperts", "registry", "qwen-moe")
    ]
    assert set(plan.replaced) == {"Qwen2MoeAttention"}  # llm-compressor's registration keeps the experts
    assert [lost.claim.target for lost in plan.lost] == ["Qwen2MoeExperts"]
    assert "already registered with register_patch_mapping (llmcompressor." in plan.lost[0].reason
    assert monkey_patching.get_patch_mapping() == {}
    assert modeling_qwen2_moe.Qwen2MoeExperts.__name__ == "Qwen2MoeExperts"
    assert modeling_qwen2_moe.Qwen2MoeAttention.__name__ == "Qwen2MoeAttention"
    assert type(model.model.layers[0].mlp.experts).__name__ == "LinearExperts2D"
    assert type(model.model.layers[0].self_attn).__name__ == "Qwen2MoeFusedQKVAttention"
    torch.testing.assert_close(logits(model, tokens), vanilla, rtol=0, atol=1e-5)
    again = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    assert type(again.model.layers[0].mlp.experts).__name__ == "PerExpertExperts"
    torch.testing.assert_close(logits(again, tokens), vanilla, rtol=0, atol=1e-5)
    hfpatch_core.disable()
    assert monkey_patching.get_patch_mapping() == {}


# --- linear-experts: a family llm-compressor's load table lacks (issue 30 item 4) ----------------------

#: ERNIE 4.5 MoE: declared through ``use_experts_implementation`` in transformers 5.17, absent from
#: llm-compressor 0.14's ``ARCH_TO_IMPORT_PATHS`` (its load-time linearization), shared experts beside
#: the routed ones and a renamed correction bias. Dimensions are multiples of 128 so that the
#: group-128 integer schemes (W8A16) fit; 8 experts, 2 per token, ~1.1M parameters.
ERNIE = dict(moe_num_experts=8, moe_k=2, hidden_size=128, intermediate_size=128, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint("ernie4_5_moe", tmp_path_factory.mktemp("ernie4_5_moe"), **ERNIE)


def load_linear_experts(path: Path):
    hfpatch_core.enable("linear-experts")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hfpatch_core.disable()
    return model


def quantize(model, scheme: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))


def test_ernie_is_outside_llmcompressors_table_and_oneshot_linearizes_its_3d_experts_after_the_load(
    ernie, defused
) -> None:
    """The control: without the pack, the load stacks the per-expert checkpoint into 3-D experts,
    which ``oneshot`` only reaches by swapping them for its own ``LinearExperts2D`` afterwards
    (2-D -> 3-D -> 2-D, both copies held at once: llm-compressor's #3037)."""
    from llmcompressor.modeling.moe.conversion_mappings import ARCH_TO_IMPORT_PATHS, has_linearize_load_mappings
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

    assert "ernie4_5_moe" not in ARCH_TO_IMPORT_PATHS and not has_linearize_load_mappings("ernie4_5_moe")
    vanilla = AutoModelForCausalLM.from_pretrained(ernie, dtype=torch.float32)
    assert [name for name, _ in get_non_linearized_moes(vanilla)] == [
        f"model.layers.{i}.mlp.experts" for i in range(vanilla.config.num_hidden_layers)
    ]
    assert vanilla.model.layers[0].mlp.experts.gate_up_proj.dim() == 3
    quantize(vanilla, "FP8_DYNAMIC")
    assert all(isinstance(layer.mlp.experts, LinearExperts2D) for layer in vanilla.model.layers)

    model = load_linear_experts(ernie)
    assert set(hfpatch_core.plan_of(model).replaced) == {"Ernie4_5_MoeExperts"}
    assert get_non_linearized_moes(model) == []
    assert not any(parameter.dim() == 3 for parameter in model.parameters())  # no stacked copy at load
    experts = [layer.mlp.experts for layer in model.model.layers]
    quantize(model, "FP8_DYNAMIC")
    assert [layer.mlp.experts for layer in model.model.layers] == experts  # oneshot kept the pack's modules


@pytest.mark.parametrize(
    "scheme",
    [
        "FP8_DYNAMIC",
        "W8A16",  # integer weights saved as `weight_packed` (the save guard reads them as the weight)
    ],
)
def test_oneshot_quantizes_every_ernie_expert_linear_and_the_compressed_checkpoint_reloads(
    ernie, defused, tmp_path, scheme
) -> None:
    """With linear-experts, ``oneshot`` (data-free) quantizes every routed expert projection in place,
    and computes what llm-compressor's own post-load linearization computes with the same scheme;
    the compressed save writes the same tensors under the same per-expert names, and reloads."""
    from safetensors.torch import load_file

    tokens = ids(AutoModelForCausalLM.from_pretrained(ernie).config)
    reference = logits(AutoModelForCausalLM.from_pretrained(ernie, dtype=torch.float32), tokens)

    # llm-compressor alone: the 3-D experts, linearized by oneshot after the load
    vanilla = AutoModelForCausalLM.from_pretrained(ernie, dtype=torch.float32)
    quantize(vanilla, scheme)
    expected = logits(vanilla, tokens)
    vanilla.save_pretrained(tmp_path / "vanilla", save_compressed=True)

    model = load_linear_experts(ernie)
    torch.testing.assert_close(logits(model, tokens), reference, rtol=0, atol=1e-5)
    quantize(model, scheme)
    linears = expert_linears(model)
    config = model.config
    assert len(linears) == config.num_hidden_layers * config.moe_num_experts * 3
    assert all(type(linear) is torch.nn.Linear for linear in linears)
    assert all(hasattr(linear, "quantization_scheme") and hasattr(linear, "weight_scale") for linear in linears)
    quantized = logits(model, tokens)
    assert not torch.equal(quantized, reference)  # the quantized experts ran
    # the same weights and scheme on both sides: only the summing order of the experts' loop may differ
    torch.testing.assert_close(quantized, expected, rtol=0, atol=1e-5)

    out = tmp_path / "linear-experts"
    model.save_pretrained(out, save_compressed=True)
    assert monkey_patching.get_patch_mapping() == {}
    saved, theirs = load_file(out / "model.safetensors"), load_file(tmp_path / "vanilla" / "model.safetensors")
    assert saved.keys() == theirs.keys()
    assert "model.layers.0.mlp.experts.7.down_proj.weight_scale" in saved
    assert not any("gate_up_proj" in key for key in saved)
    for key in saved:
        torch.testing.assert_close(saved[key], theirs[key], rtol=0, atol=0, msg=key)

    reloaded = load_linear_experts(out)
    assert all(hasattr(linear, "quantization_scheme") for linear in expert_linears(reloaded))
    torch.testing.assert_close(logits(reloaded, tokens), quantized, rtol=0, atol=1e-5)
    # vanilla transformers reloads it too, but compressed-tensors cannot reach its 3-D experts:
    # they come back decompressed (in the checkpoint's bfloat16, whatever dtype is asked for) in a
    # module with no quantization scheme
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    experts = plain.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dim() == 3 and experts.gate_up_proj.dtype not in (torch.float8_e4m3fn, torch.int8)
    assert not hasattr(experts, "quantization_scheme")
    assert hasattr(plain.model.layers[0].self_attn.q_proj, "quantization_scheme")
    # its experts run without the scheme's activation quantization: it moves the logits by less
    # than the quantization itself moved them from the fp32 model's
    plain_logits = logits(plain, tokens)
    assert (plain_logits - quantized).abs().max() <= (quantized - reference).abs().max()
