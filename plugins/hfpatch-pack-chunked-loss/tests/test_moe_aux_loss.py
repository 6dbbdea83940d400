"""MoE families add ``router_aux_loss_coef * aux_loss`` to the loss when asked for router logits (at call time
or in the config, before or after the load): the chunked loss adds it too, and the routers' gradients are vanilla's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

import hfpatch_core
from conftest import _COMMON, VOCAB

TOKENS = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(12))

_MOE = {**_COMMON, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.25}
CASES = {
    "mixtral": lambda: MixtralConfig(**_MOE, num_local_experts=4),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_MOE, num_experts=4, moe_intermediate_size=16, head_dim=16),
}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for seed, (name, build) in enumerate(CASES.items()):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(build()).save_pretrained(path)
        paths[name] = path
    return paths


def _load(path: Path, **config: Any) -> Any:
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **config)
    model.train()
    return model


def _step(model: Any, **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    out = model(input_ids=TOKENS, labels=TOKENS, **inputs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out


def _assert_vanillas(vanilla: Any, model: Any, **inputs: Any) -> None:
    vanilla_loss, vanilla_grads, vanilla_out = _step(vanilla, **inputs)
    loss, grads, out = _step(model, **inputs)
    assert out.logits.shape == (2, 1, VOCAB)  # the chunked loss ran
    assert vanilla_out.aux_loss is not None and torch.equal(out.aux_loss, vanilla_out.aux_loss)
    # fp32 bounds of test_exactness: the same per-token terms summed in another order
    assert abs(float(loss - vanilla_loss)) <= 1e-6 * abs(float(vanilla_loss))
    assert grads.keys() == vanilla_grads.keys()
    gates = [name for name in grads if "gate" in name and "proj" not in name]
    assert gates, sorted(grads)
    for name in grads:
        assert float((grads[name] - vanilla_grads[name]).abs().max()) <= 1e-5, name


@pytest.mark.parametrize("name", list(CASES))
def test_asked_at_call_time(name: str, moe: dict[str, Path]) -> None:
    model = _load(moe[name])
    found = chunked.install(model, chunk=7)
    _assert_vanillas(_load(moe[name]), model, output_router_logits=True)
    assert found.aux_loss_coefficient == "router_aux_loss_coef"


@pytest.mark.parametrize("name", list(CASES))
def test_set_in_the_config_before_the_load(name: str, moe: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_PATCH_PACKS", "chunked-loss")
    with hfpatch_core.enabled(strict=True):
        model = _load(moe[name], output_router_logits=True)
    assert [claim.target for claim in hfpatch_core.plan_of(model).installed_steps] == [chunked.TARGET]
    _assert_vanillas(_load(moe[name], output_router_logits=True), model)


@pytest.mark.parametrize("name", list(CASES))
def test_set_in_the_config_after_the_load(name: str, moe: dict[str, Path]) -> None:
    model, vanilla = _load(moe[name]), _load(moe[name])
    chunked.install(model, chunk=7)
    model.config.output_router_logits = vanilla.config.output_router_logits = True
    _assert_vanillas(vanilla, model)


def test_the_coefficient_is_read_at_each_step(moe: dict[str, Path]) -> None:
    model, vanilla = _load(moe["mixtral"]), _load(moe["mixtral"])
    chunked.install(model, chunk=7)
    model.router_aux_loss_coef = vanilla.router_aux_loss_coef = 0.5
    _assert_vanillas(vanilla, model, output_router_logits=True)


def test_a_dropped_auxiliary_loss_fails_the_same_bound(moe: dict[str, Path]) -> None:
    """The chunked loss without the auxiliary term (what the pack computed before) misses the bound."""
    vanilla = _load(moe["mixtral"])
    vanilla_loss = vanilla(input_ids=TOKENS, labels=TOKENS, output_router_logits=True).loss.detach()
    model = _load(moe["mixtral"])
    chunked.install(model, chunk=7)
    model.router_aux_loss_coef = 0.0
    dropped = model(input_ids=TOKENS, labels=TOKENS, output_router_logits=True).loss.detach()
    assert abs(float(dropped - vanilla_loss)) > 1e-6 * abs(float(vanilla_loss))
