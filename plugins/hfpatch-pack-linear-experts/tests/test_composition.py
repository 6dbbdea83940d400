"""linear-experts beside the other first-party packs, and through a ``Trainer`` checkpoint and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hfpatch_pack_linear_experts import LinearExperts

import hfpatch_core
from conftest import PACK, PAD, VOCAB
from hfpatch_core.testing import load_model, logits_of, padded_batch, safetensors_of, trainer_losses

#: The three packs that change different modules of one MoE model: attention, experts, routers.
ALL = f"fused-dense,{PACK},moe-replay"


def _packs_of(model: nn.Module) -> dict[str, str]:
    plan = hfpatch_core.plan_of(model)
    assert plan is not None
    return {target: claim.pack for target, claim in plan.replaced.items()}


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_composes_with_fused_dense_and_moe_replay(checkpoints: dict[str, Path], name: str) -> None:
    """Each pack replaces its own classes of the same model; logits equal vanilla's; the routing recorded
    on the composed model is vanilla's, and replaying another routing moves both models alike."""
    from hfpatch_pack_moe_replay import discover, record_routing, replay_routing

    vanilla = load_model(checkpoints[name], "moe-replay")
    model = load_model(checkpoints[name], ALL)
    # transformers 5.3's deepseek_v3 router returns scores only (its MoE block selects): moe-replay refuses it
    replayable = bool(discover(name, model.config).routers)
    packs = _packs_of(model)
    assert set(packs.values()) == {"fused-dense", PACK, *(["moe-replay"] if replayable else [])}, packs
    assert any(isinstance(module, LinearExperts) for module in model.modules())

    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    torch.testing.assert_close(logits_of(model, ids, mask), logits_of(vanilla, ids, mask), rtol=0, atol=1e-5)
    if not replayable:
        return
    with torch.no_grad(), record_routing(vanilla) as expected, record_routing(model) as recorded:
        vanilla(ids, attention_mask=mask)
        model(ids, attention_mask=mask)
    assert recorded.routing == expected.routing

    # a routing neither model would pick: each token's experts shifted by one (4 experts in these configs)
    routing = expected.routing
    shifted = type(routing)(tuple((layer + 1) % 4 for layer in routing.layers), routing.batch_size)
    with replay_routing(vanilla, shifted):
        replayed_vanilla = logits_of(vanilla, ids, mask)
    with replay_routing(model, shifted):
        replayed = logits_of(model, ids, mask)
    assert not torch.allclose(replayed_vanilla, logits_of(vanilla, ids, mask), atol=1e-3)
    torch.testing.assert_close(replayed, replayed_vanilla, rtol=0, atol=1e-5)


def test_trainer_resume_gives_the_uninterrupted_losses(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """``Trainer`` checkpoints hold the per-expert layout vanilla writes, and a resume from one continues
    the uninterrupted run (and vanilla's) step for step."""
    path = checkpoints["mixtral"]
    vanilla = trainer_losses(load_model(path), tmp_path / "vanilla")
    uninterrupted = trainer_losses(load_model(path, PACK), tmp_path / "patched")
    assert sorted(safetensors_of(tmp_path / "patched" / "checkpoint-2")) == sorted(safetensors_of(path))
    resumed = trainer_losses(load_model(path, PACK), tmp_path / "patched", resume="checkpoint-2")
    # the resumed history starts with checkpoint-2's (steps 1-2); steps 3-4 are computed anew
    assert len(uninterrupted) == len(resumed) == 4
    torch.testing.assert_close(resumed[2:], uninterrupted[2:], atol=1e-4, rtol=0)
    torch.testing.assert_close(uninterrupted, vanilla, atol=1e-4, rtol=0)
