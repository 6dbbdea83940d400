"""fused-dense applied in place to models that are already built (``hfpatch_core.apply`` / ``revert``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hfpatch_core
from conftest import CASES, PACK, PAD, VOCAB, Case
from hfpatch_core._runtime.snapshot import GlobalState
from hfpatch_core.testing import assert_pack_equivalent, load_model, logits_of, padded_batch, safetensors_of


def test_the_apply_path_equals_the_load_on_every_family(case: Case, checkpoints: dict[str, Path]) -> None:
    report = assert_pack_equivalent(PACK, checkpoints[case.name], apply_path=True, generate_tokens=0)
    assert report.apply_path is True


def test_a_model_built_by_hand_is_patched_in_place_and_given_back(tmp_path: Path) -> None:
    """llama with grouped-query attention, tied embeddings; trained after apply, reverted with the trained values."""
    config = CASES["llama-bias"].config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "source")
    loaded = load_model(tmp_path / "source", PACK)
    state = GlobalState.capture()
    embed, layer = model.model.embed_tokens, model.model.layers[0]
    before = {key: value.clone() for key, value in model.state_dict().items()}

    plan = hfpatch_core.apply(model, packs=PACK, strict=True)

    assert plan.fingerprint == hfpatch_core.plan_of(loaded).fingerprint == hfpatch_core.plan_of(model).fingerprint
    assert state.changes() == []
    assert model.model.embed_tokens is embed and model.model.layers[0] is layer  # only the replaced modules moved
    assert type(layer.self_attn).__name__ == "FusedQKVLlamaAttention"
    assert type(layer.mlp).__name__ == "FusedGateUpLlamaMLP"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = loaded.state_dict()
    assert sorted(model.state_dict()) == sorted(expected)
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    model.eval()
    torch.testing.assert_close(logits_of(model, ids, mask), logits_of(loaded, ids, mask), rtol=0, atol=1e-5)
    assert type(AutoModelForCausalLM.from_config(config).model.layers[0].mlp).__name__ == "LlamaMLP"

    model.save_pretrained(tmp_path / "saved")
    source, saved = safetensors_of(tmp_path / "source"), safetensors_of(tmp_path / "saved")
    assert sorted(saved) == sorted(source) and all(torch.equal(saved[key], source[key]) for key in source)

    # a training step on the patched model, then back: the original layout with the trained values
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()
    trained = {key: value.clone() for key, value in model.state_dict().items()}
    model.eval()
    trained_logits = logits_of(model, ids, mask)
    hfpatch_core.revert(model)
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    q = config.num_attention_heads * config.head_dim
    fused = trained["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(after["model.layers.0.self_attn.q_proj.weight"], fused[:q])
    assert not torch.equal(
        after["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"]
    )
    torch.testing.assert_close(logits_of(model, ids, mask), trained_logits, rtol=0, atol=1e-5)
    assert hfpatch_core.plan_of(model) is None and "save_pretrained" not in vars(model)
    assert state.changes() == []


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_dtype_and_frozen_parameters_are_kept_both_ways(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CASES["qwen3"].config).to(dtype)
    for parameter in model.model.layers[0].parameters():
        parameter.requires_grad_(False)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        hfpatch_core.apply(model, packs=PACK, strict=True)
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj.weight.dtype == dtype and not attention.qkv_proj.weight.requires_grad
    assert not attention.o_proj.weight.requires_grad and not attention.q_norm.weight.requires_grad
    assert model.model.layers[1].self_attn.qkv_proj.weight.requires_grad
    hfpatch_core.revert(model)
    after = model.state_dict()
    assert all(after[key].dtype == dtype and torch.equal(after[key], before[key]) for key in before)
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad
    assert model.model.layers[1].self_attn.q_proj.weight.requires_grad


def test_lora_on_the_projections_the_pack_fuses_is_refused_and_nothing_changes() -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(CASES["qwen3"].config)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    modules, before = dict(model.named_modules()), {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(hfpatch_core.ApplyError) as caught:
        hfpatch_core.apply(model, packs=PACK, strict=True)
    message = str(caught.value)
    assert message.startswith(
        "pack 'fused-dense' cannot replace Qwen3Attention at model.layers.0.self_attn: it holds PEFT adapter layers "
        "(q_proj (lora.Linear), v_proj (lora.Linear))"
    )
    assert 'packs="all,-fused-dense"' in message and "Apply the packs before adding adapters" in message
    assert all(module is modules[name] for name, module in model.named_modules())
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[key], before[key]) for key in before)
    assert hfpatch_core.plan_of(base) is None

    # the remedy: the packs first, then the adapters (LoRA on the fused projection: issue 20)
    torch.manual_seed(0)
    patched = AutoModelForCausalLM.from_config(CASES["qwen3"].config)
    hfpatch_core.apply(patched, packs=PACK, strict=True)
    lora = get_peft_model(patched, LoraConfig(r=4, target_modules=["o_proj"]))
    assert type(lora.get_base_model().model.layers[0].self_attn).__name__ == "FusedQKVQwen3Attention"
