"""qwen-moe applied in place to models that are already built (``hfpatch_core.apply`` / ``revert``).

The experts go from two 3-D parameters to one ``nn.Linear`` per expert (transformers'
built-in fusion reversed, then left out of the pack's load), the attention's q/k/v are
fused: both through the same conversions as a load, and back.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hfpatch_pack_qwen_moe import FAMILIES, PerExpertExperts
from transformers import AutoModelForCausalLM

import hfpatch_core
from conftest import CASES, PACK, PAD, VOCAB
from hfpatch_core._runtime.snapshot import GlobalState
from hfpatch_core.testing import assert_pack_equivalent, load_model, logits_of, padded_batch, safetensors_of


def test_the_apply_path_equals_the_load(checkpoints: dict[str, Path], case: str) -> None:
    report = assert_pack_equivalent(PACK, checkpoints[case], apply_path=True, generate_tokens=0)
    assert report.apply_path is True


def test_3d_experts_become_per_expert_linears_and_come_back_trained(tmp_path: Path) -> None:
    config = CASES["qwen2_moe"].config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "source")
    loaded = load_model(tmp_path / "source", PACK)
    state = GlobalState.capture()
    gate, shared = model.model.layers[0].mlp.gate, model.model.layers[0].mlp.shared_expert
    experts = model.model.layers[0].mlp.experts
    gate_up = experts.gate_up_proj.detach().clone()  # [E, 2 * I, H]
    before = {key: value.clone() for key, value in model.state_dict().items()}

    plan = hfpatch_core.apply(model, packs=PACK, strict=True)

    assert plan.fingerprint == hfpatch_core.plan_of(loaded).fingerprint
    assert state.changes() == []
    mlp = model.model.layers[0].mlp
    assert mlp.gate is gate and mlp.shared_expert is shared
    assert (
        type(mlp.experts) is PerExpertExperts
        and type(model.model.layers[0].self_attn) is FAMILIES["qwen2_moe"].fused_attention
    )
    size = config.moe_intermediate_size
    assert torch.equal(mlp.experts[2].gate_proj.weight, gate_up[2, :size])
    assert torch.equal(mlp.experts[2].up_proj.weight, gate_up[2, size:])
    # the experts' tensors are their own, not views of the 3-D parameter they came from
    assert (
        mlp.experts[2].gate_proj.weight.untyped_storage().data_ptr()
        != experts.gate_up_proj.untyped_storage().data_ptr()
    )
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    model.eval()
    torch.testing.assert_close(logits_of(model, ids, mask), logits_of(loaded, ids, mask), rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    source, saved = safetensors_of(tmp_path / "source"), safetensors_of(tmp_path / "saved")
    assert sorted(saved) == sorted(source) and all(torch.equal(saved[key], source[key]) for key in source)

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    optimizer.step()
    trained_expert = model.model.layers[0].mlp.experts[1].down_proj.weight.detach().clone()
    model.eval()
    trained_logits = logits_of(model, ids, mask)

    hfpatch_core.revert(model)
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Qwen2MoeExperts"
    assert sorted(model.state_dict()) == sorted(before)
    assert all(model.state_dict()[key].shape == before[key].shape for key in before)
    assert torch.equal(experts.down_proj[1], trained_expert)
    torch.testing.assert_close(logits_of(model, ids, mask), trained_logits, rtol=0, atol=1e-5)
    assert state.changes() == []


def test_apply_then_revert_is_bit_exact_in_bf16() -> None:
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(CASES["qwen3_moe"].config).to(torch.bfloat16)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    hfpatch_core.apply(model, packs=PACK, strict=True)
    assert model.model.layers[1].mlp.experts[0].gate_proj.weight.dtype == torch.bfloat16
    hfpatch_core.revert(model)
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]) for key in before)
