"""PEFT LoRA and Trainer checkpoints on qwen-moe models (fused qkv_proj, per-expert experts).

Adapters name ``q_proj`` / ``k_proj`` / ``v_proj`` (hfpatch shows them to PEFT as views of
``qkv_proj``), and a list of names reaches the same modules as on vanilla transformers,
whose routed experts are 3-D parameters: the shared expert, not the routed ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from conftest import PACK, PAD, VOCAB
from hfpatch_core import AdapterError
from hfpatch_core.testing import adapter_steps, load_model, logits_of, padded_batch, safetensors_of, trainer_losses

ATOL = 1e-5
NAMES = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def lora(targets: object, seed: int) -> LoraConfig:
    torch.manual_seed(seed)
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)


def peft_moves_experts(model_type: str) -> bool:
    """Whether PEFT rewrites expert names to the 3-D expert parameters for ``model_type`` on this release
    (qwen3_moe always; qwen2_moe where transformers lists its conversion under that name, as 5.3 does)."""
    from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN

    return _MODEL_TO_CONVERSION_PATTERN.get(model_type) is not None


def adapted(model: torch.nn.Module) -> set[str]:
    return {name.split("model.layers.", 1)[1] for name, module in model.named_modules() if hasattr(module, "lora_A")}


def test_lora_both_ways_and_merge(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    path = checkpoints["qwen2_moe"]
    # with the experts' names where they mean the shared expert only (no PEFT rewrite); else see the next test
    names = ["q_proj", "k_proj", "v_proj"] if peft_moves_experts("qwen2_moe") else NAMES
    patched = get_peft_model(load_model(path, PACK), lora(names, 0))
    adapter_steps(patched, ids, mask, steps=2)
    patched.eval()
    patched.save_pretrained(tmp_path / "patched-adapter")
    vanilla = PeftModel.from_pretrained(load_model(path), tmp_path / "patched-adapter")
    assert adapted(patched) == adapted(vanilla)
    assert not any(".experts." in name for name in adapted(patched))  # as on vanilla: 3-D experts, no module
    torch.testing.assert_close(logits_of(vanilla, ids, mask), logits_of(patched, ids, mask), atol=ATOL, rtol=0)

    trained_on_vanilla = get_peft_model(load_model(path), lora(names, 1))
    expected = logits_of(trained_on_vanilla, ids, mask)
    trained_on_vanilla.save_pretrained(tmp_path / "vanilla-adapter")
    loaded = PeftModel.from_pretrained(load_model(path, PACK), tmp_path / "vanilla-adapter")
    torch.testing.assert_close(logits_of(loaded, ids, mask), expected, atol=ATOL, rtol=0)
    with_load_adapter = load_model(path, PACK)
    with_load_adapter.load_adapter(str(tmp_path / "vanilla-adapter"))
    torch.testing.assert_close(logits_of(with_load_adapter, ids, mask), expected, atol=ATOL, rtol=0)

    merged, vanilla_merged = loaded.merge_and_unload(), trained_on_vanilla.merge_and_unload()
    torch.testing.assert_close(logits_of(merged, ids, mask), logits_of(vanilla_merged, ids, mask), atol=ATOL, rtol=0)
    merged.save_pretrained(tmp_path / "merged")
    vanilla_merged.save_pretrained(tmp_path / "vanilla-merged")
    written, reference = safetensors_of(tmp_path / "merged"), safetensors_of(tmp_path / "vanilla-merged")
    assert sorted(written) == sorted(reference)
    for key, value in reference.items():
        torch.testing.assert_close(written[key], value, atol=ATOL, rtol=0, msg=key)


def test_expert_targets_peft_moves_to_3d_parameters_are_one_clear_error(checkpoints: dict[str, Path]) -> None:
    """qwen3_moe: PEFT rewrites ``gate_proj`` / ``up_proj`` / ``down_proj`` to the 3-D expert parameters
    vanilla has; on per-expert experts the adapter would leave them out, so hfpatch refuses it."""
    assert peft_moves_experts("qwen3_moe")
    path = checkpoints["qwen3_moe"]
    vanilla = get_peft_model(load_model(path), lora(NAMES, 0))
    assert any(name.endswith("mlp.experts") for name in adapted(vanilla))  # vanilla adapts the routed experts
    model = load_model(path, PACK)
    with pytest.raises(AdapterError, match=r"pack 'qwen-moe'.*HF_PATCH_PACKS=all,-qwen-moe"):
        get_peft_model(model, lora(NAMES, 0))
    assert not adapted(model)
    attention_only = get_peft_model(load_model(path, PACK), lora(["q_proj", "v_proj"], 0))
    expected = {f"{layer}.self_attn.{name}" for layer in range(2) for name in ("q_proj", "v_proj")}
    assert adapted(attention_only) == expected


def train(checkpoint: Path, packs: str | None, output: Path, resume: str | None = None) -> list[float]:
    """The losses of 4 AdamW steps (a checkpoint every 2), from ``resume`` if given."""
    return trainer_losses(load_model(checkpoint, packs), output, resume=resume)


def test_trainer_resume_gives_the_uninterrupted_losses_experts_included(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints["qwen3_moe"]
    uninterrupted = train(path, PACK, tmp_path / "run")
    resumed = train(path, PACK, tmp_path / "run", resume="checkpoint-2")
    assert len(uninterrupted) == len(resumed) == 4  # the resumed history starts with checkpoint-2's
    torch.testing.assert_close(resumed[2:], uninterrupted[2:], atol=1e-4, rtol=0)
    torch.testing.assert_close(uninterrupted, train(path, None, tmp_path / "vanilla"), atol=1e-4, rtol=0)
