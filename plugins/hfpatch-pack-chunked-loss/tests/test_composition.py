"""The chunked loss on a model loaded with another pack's replacements (fused-dense)."""

from __future__ import annotations

from pathlib import Path

import hfpatch_pack_chunked_loss as chunked
import torch
from transformers import AutoModelForCausalLM

import hfpatch_core
from conftest import VOCAB, load


def test_on_a_fused_dense_model(checkpoints: dict[str, Path]) -> None:
    """fused-dense replaces the attention and MLP classes; the head and loss path the probe reads stay
    vanilla's, so the chunked loss on top equals fused-dense's own vanilla-loss step."""
    input_ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(6))
    sides = {}
    for side in ("fused-dense", "fused-dense + chunked-loss"):
        with hfpatch_core.enabled("fused-dense", strict=True):
            model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"], attn_implementation="eager")
        assert set(hfpatch_core.plan_of(model).replaced) == {"Qwen2Attention", "Qwen2MLP"}
        model.train()
        if side != "fused-dense":
            chunked.install(model, chunk=7)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        sides[side] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (base_loss, base_grads), (loss, grads) = sides.values()
    assert abs(float(loss - base_loss)) <= 1e-6 * abs(float(base_loss))
    assert max(float((grads[n] - base_grads[n]).abs().max()) for n in grads) <= 1e-5
    # and the fused model's step is vanilla's step, so the chunked loss is too
    vanilla = load(checkpoints["qwen2"])
    vanilla_loss = vanilla(input_ids=input_ids, labels=input_ids).loss
    assert abs(float(loss - vanilla_loss.detach())) <= 1e-5 * abs(float(vanilla_loss))
