"""PEFT LoRA on the per-expert linears: ``target_modules`` names them as per-expert checkpoints do.

On transformers 5 PEFT rewrites expert names (``w1``, ``gate_proj``, ...) into ``target_parameters``
on the 3-D experts; hfpatch keeps names that reach a linear-experts module's linears off that
rewrite, so the adapter lands on every expert's projection, saves and reloads under those names,
and merges into a checkpoint vanilla transformers loads.  gpt_oss's checkpoint stores gate and up
interleaved in one 3-D tensor: its experts are ``gate_up_proj`` / ``down_proj`` linears.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import torch.nn as nn
from hfpatch_pack_linear_experts import LinearExperts
from packaging.version import Version
from peft import LoraConfig, PeftModel, get_peft_model
from transformers.integrations.peft import MIN_PEFT_VERSION

from conftest import PACK, PAD, VOCAB
from hfpatch_core.testing import adapter_steps, load_model, logits_of, padded_batch, safetensors_of

#: Per family: the names of each expert's projections, as its checkpoints name them (the last is down).
NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
    "gpt_oss": ("gate_up_proj", "down_proj"),
}


def lora(targets: object, seed: int) -> LoraConfig:
    # init_lora_weights=False: B is random too, so the adapter changes the logits from the start
    torch.manual_seed(seed)
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)


def expert_linears(model: nn.Module) -> set[str]:
    """The path of every expert's projection (``model.layers.1.mlp.experts.3.w1``)."""
    return {
        f"{name}.{child}"
        for name, module in model.named_modules()
        if isinstance(module, LinearExperts)
        for child, linear in module.named_modules()
        if isinstance(linear, nn.Linear)
    }


def adapted(model: nn.Module) -> set[str]:
    """The path, in the transformers model, of every module holding a LoRA adapter."""
    return {
        name.removeprefix("base_model.model.") for name, module in model.named_modules() if hasattr(module, "lora_A")
    }


@pytest.mark.parametrize("name", list(NAMES))
def test_lora_on_every_expert_trains_saves_reloads_and_merges(
    checkpoints: dict[str, Path], tmp_path: Path, name: str
) -> None:
    path, names = checkpoints[name], NAMES[name]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    base = load_model(path, PACK)
    linears = expert_linears(base)
    moe_layers = {p.split(".mlp.")[0] for p in linears}
    assert len(linears) == len(moe_layers) * 4 * len(names) and moe_layers  # every MoE layer: 4 experts

    model = get_peft_model(base, lora(list(names), 0))
    reached = adapted(model)
    assert linears <= reached, sorted(linears - reached)[:5]
    assert all(p.rsplit(".", 1)[1] in names for p in reached)  # deepseek_v3: the shared and dense MLPs too
    before = {key: value.clone() for key, value in model.state_dict().items() if ".experts." in key and "lora_" in key}
    assert len(before) == 2 * len(linears)

    losses = adapter_steps(model, ids, mask)
    assert losses[-1] != losses[0]
    after = model.state_dict()
    assert any(not torch.equal(after[key], value) for key, value in before.items()), "no expert adapter trained"
    model.eval()
    expected = logits_of(model, ids, mask)

    model.save_pretrained(tmp_path / "adapter")
    saved = safetensors_of(tmp_path / "adapter")
    expert_keys = {key for key in saved if ".experts." in key}
    # the per-expert (transformers 4) names: one lora_A and one lora_B per expert linear
    assert {key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for key in expert_keys} == linears
    assert len(expert_keys) == 2 * len(linears)

    reloaded = PeftModel.from_pretrained(load_model(path, PACK), tmp_path / "adapter")
    assert adapted(reloaded) == reached
    assert torch.equal(logits_of(reloaded, ids, mask), expected)
    with_load_adapter = load_model(path, PACK)
    with_load_adapter.load_adapter(str(tmp_path / "adapter"))
    assert adapted(with_load_adapter) == reached
    assert torch.equal(logits_of(with_load_adapter, ids, mask), expected)

    merged = model.merge_and_unload()
    assert not adapted(merged)
    merged_logits = logits_of(merged, ids, mask)
    merged.save_pretrained(tmp_path / "merged")
    written, source = safetensors_of(tmp_path / "merged"), safetensors_of(path)
    assert sorted(written) == sorted(source)  # the original (vanilla) layout
    assert all(written[key].shape == value.shape for key, value in source.items())
    assert torch.equal(logits_of(load_model(tmp_path / "merged", PACK), ids, mask), merged_logits)
    # vanilla transformers, its experts run as the eager loop the pack's forward is: as close to the merge
    # as vanilla is to the pack on the checkpoint before training, measured here (bit for bit on mixtral;
    # deepseek_v3's sums differ in the last bits); 4x: the merged weights are other weights
    eager = {"experts_implementation": "eager"}
    drift = (logits_of(load_model(path, **eager), ids, mask) - logits_of(load_model(path, PACK), ids, mask)).abs().max()
    vanilla = load_model(tmp_path / "merged", **eager)
    assert not any(isinstance(module, LinearExperts) for module in vanilla.modules())
    torch.testing.assert_close(logits_of(vanilla, ids, mask), merged_logits, atol=4 * drift.item(), rtol=0)


@pytest.mark.parametrize("name", list(NAMES))
def test_a_subset_or_all_linear_reaches_the_experts_as_named(checkpoints: dict[str, Path], name: str) -> None:
    """One projection alone (PEFT refuses ``w1`` without ``w3`` on the 3-D experts, where they are fused),
    ``"all-linear"`` and a regular expression reach the per-expert linears as on a per-expert model."""
    path, gate, down = checkpoints[name], NAMES[name][0], NAMES[name][-1]
    linears = expert_linears(load_model(path, PACK))
    alone = get_peft_model(load_model(path, PACK), lora([gate], 0))
    assert {p for p in adapted(alone) if ".experts." in p} == {p for p in linears if p.endswith(f".{gate}")}
    everything = get_peft_model(load_model(path, PACK), lora("all-linear", 0))
    assert linears <= adapted(everything)
    regex = get_peft_model(load_model(path, PACK), lora(rf".*\.experts\.\d+\.{down}", 0))
    assert adapted(regex) == {p for p in linears if p.endswith(f".{down}")}


@pytest.mark.skipif(
    Version(peft.__version__) < Version(MIN_PEFT_VERSION),
    reason=f"this transformers' add_adapter needs peft >= {MIN_PEFT_VERSION} (installed: {peft.__version__})",
)
@pytest.mark.parametrize("name", list(NAMES))
def test_transformers_add_adapter_reaches_the_experts(checkpoints: dict[str, Path], name: str) -> None:
    path, up = checkpoints[name], NAMES[name][-2]
    model = load_model(path, PACK)
    linears = expert_linears(model)
    model.add_adapter(lora([up], 0))
    assert {p for p in adapted(model) if ".experts." in p} == {p for p in linears if p.endswith(f".{up}")}
