"""PEFT LoRA on fused-dense models, both ways: adapters name q_proj / k_proj / v_proj / gate_proj / up_proj.

The pack declares what each fused projection stands for (``hfpatch_packed_modules``); when
PEFT wraps the model, hfpatch shows it the original projections as views of the fused
weight (``hfpatch_core.authoring.packing``).  Every test compares with the same adapter on vanilla
transformers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from conftest import PACK, PAD, VOCAB
from hfpatch_core import AdapterError
from hfpatch_core.authoring.packing import PackedPart
from hfpatch_core.testing import adapter_steps, load_model, logits_of, padded_batch, safetensors_of

ATOL = 1e-5


def lora(targets: Any, seed: int) -> LoraConfig:
    torch.manual_seed(seed)
    # init_lora_weights=False: non-zero B from the start, so that an adapter on the wrong rows shows
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return padded_batch(VOCAB, pad_token_id=PAD)


@pytest.mark.parametrize("name", ["llama", "qwen2-sliding"])
def test_lora_on_the_original_names_trains_and_loads_on_vanilla(
    name: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """(a) trains on the patched model; (b) the saved adapter has vanilla's names and outputs."""
    ids, mask = batch()
    model = get_peft_model(load_model(checkpoints[name], PACK), lora(["q_proj", "v_proj", "gate_proj"], 0))
    attention = model.base_model.model.model.layers[0].self_attn
    assert isinstance(attention.q_proj.base_layer, PackedPart)
    assert isinstance(attention.k_proj, PackedPart)  # shown, not wrapped
    frozen = {k: v.clone() for k, v in model.named_parameters() if not v.requires_grad}
    losses = adapter_steps(model, ids, mask)
    assert losses[-1] < losses[0]
    assert all(torch.equal(value, dict(model.named_parameters())[key]) for key, value in frozen.items())
    model.eval()
    trained = logits_of(model, ids, mask)
    model.save_pretrained(tmp_path / "adapter")

    saved = safetensors_of(tmp_path / "adapter")
    assert {key.split(".")[-3] for key in saved} == {"q_proj", "v_proj", "gate_proj"}
    assert len(saved) == 2 * 3 * 2  # lora_A and lora_B, three projections, two layers
    vanilla = PeftModel.from_pretrained(load_model(checkpoints[name]), tmp_path / "adapter")
    torch.testing.assert_close(logits_of(vanilla, ids, mask), trained, atol=ATOL, rtol=0)


def test_an_adapter_trained_on_vanilla_loads_onto_the_patched_model(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """(c) with PeftModel.from_pretrained and with transformers' load_adapter; (d) merge_and_unload."""
    ids, mask = batch()
    path = checkpoints["llama-bias"]
    vanilla = get_peft_model(load_model(path), lora(["q_proj", "k_proj", "v_proj", "up_proj"], 1))
    expected = logits_of(vanilla, ids, mask)
    vanilla.save_pretrained(tmp_path / "adapter")

    patched = PeftModel.from_pretrained(load_model(path, PACK), tmp_path / "adapter")
    torch.testing.assert_close(logits_of(patched, ids, mask), expected, atol=ATOL, rtol=0)
    with_load_adapter = load_model(path, PACK)
    with_load_adapter.load_adapter(str(tmp_path / "adapter"))
    torch.testing.assert_close(logits_of(with_load_adapter, ids, mask), expected, atol=ATOL, rtol=0)

    # PEFT's safe merge (a copy checked for NaNs, then rebound) merges on the fused rows too
    safely = PeftModel.from_pretrained(load_model(path, PACK), tmp_path / "adapter").merge_and_unload(safe_merge=True)
    merged, vanilla_merged = patched.merge_and_unload(), vanilla.merge_and_unload()
    torch.testing.assert_close(logits_of(safely, ids, mask), logits_of(vanilla_merged, ids, mask), atol=ATOL, rtol=0)
    assert type(merged.model.layers[0].self_attn).__name__ == "FusedQKVLlamaAttention"
    torch.testing.assert_close(logits_of(merged, ids, mask), logits_of(vanilla_merged, ids, mask), atol=ATOL, rtol=0)
    merged.save_pretrained(tmp_path / "merged")
    vanilla_merged.save_pretrained(tmp_path / "vanilla-merged")
    written, reference = safetensors_of(tmp_path / "merged"), safetensors_of(tmp_path / "vanilla-merged")
    assert sorted(written) == sorted(reference)  # the original layout: q/k/v, gate/up
    for key, value in reference.items():
        torch.testing.assert_close(written[key], value, atol=ATOL, rtol=0, msg=key)


def test_a_safe_merge_of_a_broken_adapter_leaves_the_fused_weight_as_it_was(checkpoints: dict[str, Path]) -> None:
    model = get_peft_model(load_model(checkpoints["llama"], PACK), lora(["q_proj", "v_proj"], 1))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    fused = model.base_model.model.model.layers[0].self_attn.qkv_proj.weight
    before = fused.detach().clone()
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaNs detected in the merged weights"):
        layer.merge(safe_merge=True)
    assert torch.equal(fused, before) and layer.merged_adapters == []


def test_targeting_a_fused_name_is_one_clear_error_and_all_linear_gets_the_originals(
    checkpoints: dict[str, Path],
) -> None:
    model = load_model(checkpoints["llama"], PACK)
    refused = r"qkv_proj, which pack 'fused-dense' fused .*HF_PATCH_PACKS=all,-fused-dense"
    with pytest.raises(AdapterError, match=refused):
        get_peft_model(model, lora(["qkv_proj", "o_proj"], 0))
    assert not any("lora_" in name for name, _ in model.named_modules())  # refused before PEFT changed anything

    wrapped = get_peft_model(load_model(checkpoints["llama"], PACK), lora("all-linear", 0))
    targeted = {name.rsplit(".", 1)[-1] for name, module in wrapped.named_modules() if hasattr(module, "lora_A")}
    assert targeted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_peft_imported_after_the_load_is_hooked_when_it_imports(checkpoints: dict[str, Path]) -> None:
    """The usual script order puts ``import peft`` anywhere: hfpatch hooks PEFT when it is imported."""
    script = f"""
import sys
from hfpatch_core.testing import load_model
model = load_model({str(checkpoints["llama"])!r}, {PACK!r})
assert "peft" not in sys.modules, "hfpatch imported peft"
from peft import LoraConfig, get_peft_model
wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["k_proj", "gate_proj"]))
print(sorted({{name.rsplit(".", 1)[-1] for name, module in wrapped.named_modules() if hasattr(module, "lora_A")}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['gate_proj', 'k_proj']"


def test_a_part_is_a_view_of_the_fused_rows() -> None:
    from hfpatch_core.authoring.packing import PackedLinear

    fused = PackedLinear(torch.nn.Linear(4, 5))
    part = PackedPart(fused, 2, 5)
    assert part.weight.data_ptr() == fused.weight[2].data_ptr() and part.bias is not None
    part.weight = torch.ones(3, 4)  # what PEFT's unwrapping assigns: copied into the rows
    assert torch.equal(fused.weight[2:], torch.ones(3, 4)) and not list(part.parameters())
    with pytest.raises(ValueError, match=r"got a \[2, 4\] tensor for rows \[2, 5\)"):
        part.weight = torch.ones(2, 4)
    x = torch.randn(2, 4)
    torch.testing.assert_close(part(x), fused(x)[:, 2:], atol=1e-6, rtol=0)


def test_dynamic_quantization_leaves_the_fused_projections_whole_and_adapters_still_apply(
    checkpoints: dict[str, Path],
) -> None:
    """``quantize_dynamic`` swaps exact ``nn.Linear`` modules: the views (a subclass) and the
    shared projection (not a linear) stay in floating point, so an adapter on v_proj applies."""
    from torch.ao.quantization import quantize_dynamic

    model = quantize_dynamic(load_model(checkpoints["llama"], PACK), {torch.nn.Linear}, dtype=torch.qint8)
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj.weight.dtype == torch.float32
    assert type(attention.o_proj).__module__.startswith("torch.ao.nn.quantized")
    wrapped = get_peft_model(model, lora(["v_proj"], 0))
    assert isinstance(wrapped.base_model.model.model.layers[0].self_attn.v_proj.base_layer, PackedPart)


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_a_seeded_adapter_on_all_linear_starts_from_vanilla_adapter(name: str, checkpoints: dict[str, Path]) -> None:
    """PEFT draws LoRA's random initialisation in ``named_modules()`` order: the patched model
    lists q/k/v/o and gate/up/down in vanilla's order, so a fixed seed gives vanilla's adapter."""
    adapters = []
    for packs in (None, PACK):
        model = load_model(checkpoints[name], packs)
        torch.manual_seed(1234)
        wrapped = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        adapters.append({key: value.clone() for key, value in wrapped.state_dict().items() if "lora_" in key})
    vanilla, patched = adapters
    assert list(patched) == list(vanilla) and len(vanilla) > 0
    for key, value in vanilla.items():
        assert torch.equal(patched[key], value), key
