"""``hfpatch_core.apply`` of moe-replay on a model loaded without it (issue 40: apply() planned
nothing, since discovery probed the routers under apply's ``no_grad``, and the cached refusal
switched the pack off for every later load of that config)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hfpatch_core
from hfpatch_core import plan_of
from hfpatch_core.testing import check_pack_equivalence

PACK = "moe-replay"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_apply_replaces_the_routers_and_later_loads_still_do(family: str, checkpoints) -> None:
    checkpoint = checkpoints[family]
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(ids).logits
    plan = hfpatch_core.apply(model, packs=PACK)
    assert plan.replaced, plan.summary()
    routers = [module for module in model.modules() if type(module).__module__.startswith("hfpatch_pack_moe_replay")]
    assert routers and len(routers) == model.config.num_hidden_layers
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    with hfpatch_core.enabled(packs=PACK):
        loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    loaded_plan = plan_of(loaded)
    assert loaded_plan is not None and loaded_plan.fingerprint == plan.fingerprint
    hfpatch_core.revert(model)
    assert not any(type(module).__module__.startswith("hfpatch_pack_moe_replay") for module in model.modules())


def test_the_apply_path_of_verify_passes(checkpoints) -> None:
    report = check_pack_equivalence(PACK, checkpoints["mixtral"], apply_path=True, generate_tokens=4)
    assert report.ok and report.apply_path, report.failures
