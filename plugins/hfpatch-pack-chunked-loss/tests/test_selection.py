"""The pack selected like any other (``HF_PATCH_PACKS=chunked-loss``): installed on the loaded model as a
model step, alone and with the other first-party packs, refused with the reason, and gone when reverted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM, MixtralConfig, Qwen3MoeConfig

import hfpatch_core
from conftest import _COMMON, VOCAB, load

TOKENS = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(11))

_MOE = {**_COMMON, "num_experts_per_tok": 2}
MOE_CASES = {
    "mixtral": lambda: MixtralConfig(**_MOE, num_local_experts=4),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_MOE, num_experts=4, moe_intermediate_size=16, head_dim=16),
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    hfpatch_core.disable()
    paths = {}
    for seed, (name, build) in enumerate(MOE_CASES.items()):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(build()).save_pretrained(path)
        paths[name] = path
    return paths


def _loaded(path: Path, packs: str | None) -> Any:
    """The checkpoint loaded with ``packs`` (``None``: vanilla), in training mode."""
    if packs is None:
        return load(path)
    with hfpatch_core.enabled(strict=True):  # packs=None: HF_PATCH_PACKS, as a user selects them
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    model.train()
    return model


def _step(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=TOKENS, labels=TOKENS).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(a: Any, b: Any) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = _step(a), _step(b)
    # fp32: the same per-token terms summed in another order (see test_exactness)
    assert abs(float(loss_a - loss_b)) <= 1e-6 * abs(float(loss_b))
    assert grads_a.keys() == grads_b.keys()
    assert max(float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a) <= 1e-5


@pytest.mark.parametrize("name", ["llama", "gemma2", "cohere"])
def test_selected_by_hf_patch_packs_it_is_the_chunked_loss(
    name: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_PATCH_PACKS", "chunked-loss")
    model = _loaded(checkpoints[name], "chunked-loss")
    plan = hfpatch_core.plan_of(model)
    assert plan is not None
    assert [(claim.pack, claim.target) for claim in plan.installed_steps] == [("chunked-loss", chunked.TARGET)]
    assert chunked.installed(model) is not None
    _assert_same_step(model, load(checkpoints[name]))
    # a training step returns the last position's logits only (docs/chunked-loss.md)
    assert model(input_ids=TOKENS, labels=TOKENS).logits.shape == (2, 1, VOCAB)


def test_the_scope_leaves_no_trace_and_revert_gives_vanillas_forward(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_PATCH_PACKS", "chunked-loss")
    class_forward = LlamaForCausalLM.__dict__["forward"]
    model = _loaded(checkpoints["llama"], "chunked-loss")
    assert "forward" in model.__dict__
    later = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])  # outside the block
    assert chunked.installed(later) is None and "forward" not in later.__dict__
    assert LlamaForCausalLM.__dict__["forward"] is class_forward
    hfpatch_core.revert(model)
    assert chunked.installed(model) is None and "forward" not in model.__dict__
    assert model(input_ids=TOKENS, labels=TOKENS).logits.shape == (2, 20, VOCAB)


def test_apply_installs_it_and_a_refusal_is_on_the_plan(checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints["llama"])
    plan = hfpatch_core.apply(model, packs="chunked-loss", strict=True)
    assert [claim.target for claim in plan.installed_steps] == [chunked.TARGET]
    _assert_same_step(model, load(checkpoints["llama"]))
    hfpatch_core.revert(model)
    assert chunked.installed(model) is None and hfpatch_core.plan_of(model) is None

    wrapped = load(checkpoints["llama"])
    wrapped.lm_head = nn.Sequential(wrapped.lm_head)
    plan = hfpatch_core.apply(wrapped, packs="chunked-loss", strict=True)
    assert plan.installed_steps == ()
    [refused] = plan.refused
    assert (refused.pack, refused.target) == ("chunked-loss", chunked.TARGET)
    assert "the LM head is a Sequential, not a plain nn.Linear" in refused.reason
    assert "refused by chunked-loss" in plan.summary()


def test_a_load_sharded_by_transformers_is_refused_with_the_reason(checkpoints: dict[str, Path]) -> None:
    config = load(checkpoints["llama"]).config
    for parallel in [("ep",), ("pp",), ("tp", "fsdp"), ("tp", "ep")]:
        context = hfpatch_core.LoadContext.for_model(LlamaForCausalLM, config, parallel=parallel)
        [refusal] = chunked.provide_model_steps(context)
        assert isinstance(refusal, hfpatch_core.Refusal) and refusal.target == chunked.TARGET
        assert ", ".join(parallel) in refusal.reason
        assert "the chunked loss runs under FSDP2 or tensor parallelism alone" in refusal.reason
    # FSDP2 gathers the head whole in the forward, tensor parallelism splits its rows for the step (the
    # vocabulary-parallel loss): the step is installed and its probe decides (under torchrun:
    # tests/test_distributed.py)
    for parallel in [("fsdp",), ("tp",)]:
        context = hfpatch_core.LoadContext.for_model(LlamaForCausalLM, config, parallel=parallel)
        [step] = chunked.provide_model_steps(context)
        assert isinstance(step, hfpatch_core.ModelStep) and step.target == chunked.TARGET
    # a model without a causal-LM loss path is not a candidate
    base = hfpatch_core.LoadContext("llama", "LlamaModel", config=config)
    assert chunked.provide_model_steps(base) == []


def test_with_fused_dense(checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """fused-dense replaces the attention and MLP; the chunked loss on top is fused-dense's own step."""
    monkeypatch.setenv("HF_PATCH_PACKS", "fused-dense")
    alone = _loaded(checkpoints["qwen2"], "fused-dense")
    monkeypatch.setenv("HF_PATCH_PACKS", "fused-dense,chunked-loss")
    both = _loaded(checkpoints["qwen2"], "fused-dense,chunked-loss")
    assert set(hfpatch_core.plan_of(both).replaced) == {"Qwen2Attention", "Qwen2MLP"}
    assert chunked.installed(both) is not None
    _assert_same_step(both, alone)


@pytest.mark.parametrize("name", list(MOE_CASES))
@pytest.mark.parametrize("other", ["linear-experts", "moe-replay"])
def test_with_an_experts_pack(
    name: str, other: str, moe_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunked loss on top of another pack's model is that model's own vanilla-loss step."""
    monkeypatch.setenv("HF_PATCH_PACKS", other)
    alone = _loaded(moe_checkpoints[name], other)
    monkeypatch.setenv("HF_PATCH_PACKS", f"{other},chunked-loss")
    both = _loaded(moe_checkpoints[name], f"{other},chunked-loss")
    plan = hfpatch_core.plan_of(both)
    assert chunked.installed(both) is not None and {p for p, _ in plan.packs} == {other, "chunked-loss"}
    assert set(plan.replaced) == set(hfpatch_core.plan_of(alone).replaced)
    _assert_same_step(both, alone)
