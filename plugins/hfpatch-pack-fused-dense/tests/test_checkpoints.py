"""Checkpoints of fused-dense models: Trainer resume, load_state_dict of the original layout, accelerate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hfpatch_core
from conftest import PACK, PAD, VOCAB
from hfpatch_core import WeightLayoutError
from hfpatch_core.testing import load_model, logits_of, padded_batch, safetensors_of, trainer_losses


def train(checkpoint: Path, packs: str | None, output: Path, resume: str | None = None) -> list[float]:
    """The losses of 4 AdamW steps (a checkpoint every 2), from ``resume`` if given."""
    return trainer_losses(load_model(checkpoint, packs), output, resume=resume)


def test_trainer_resume_gives_the_uninterrupted_losses(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = checkpoints["llama"]
    vanilla = train(path, None, tmp_path / "vanilla")
    uninterrupted = train(path, PACK, tmp_path / "patched")
    assert sorted(safetensors_of(tmp_path / "patched" / "checkpoint-2")) == sorted(safetensors_of(path))
    resumed = train(path, PACK, tmp_path / "patched", resume="checkpoint-2")
    # the resumed history starts with checkpoint-2's (steps 1-2); steps 3-4 are computed anew
    assert len(uninterrupted) == len(resumed) == 4
    torch.testing.assert_close(resumed[2:], uninterrupted[2:], atol=1e-4, rtol=0)
    torch.testing.assert_close(uninterrupted, vanilla, atol=1e-4, rtol=0)


def test_load_state_dict_takes_the_original_layout(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama-bias"]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    source = load_model(path, PACK)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    original = {key: value.clone() for key, value in hfpatch_core.original_state_dict(source).items()}
    assert "model.layers.0.self_attn.q_proj.weight" in original and "model.layers.0.mlp.up_proj.bias" in original
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in original)

    target = load_model(path, PACK)
    assert not torch.equal(logits_of(target, ids, mask), logits_of(source, ids, mask))
    result = target.load_state_dict(original)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    torch.testing.assert_close(logits_of(target, ids, mask), logits_of(source, ids, mask), atol=0, rtol=0)
    vanilla = load_model(path)  # the same dict is what an unpatched model loads
    vanilla.load_state_dict(original)
    torch.testing.assert_close(logits_of(vanilla, ids, mask), logits_of(source, ids, mask), atol=1e-5, rtol=0)

    incomplete = {key: value for key, value in original.items() if not key.endswith("layers.1.self_attn.k_proj.weight")}
    with pytest.raises(RuntimeError, match=r"missing keys \['model.layers.1.self_attn.k_proj.weight'\]"):
        load_model(path, PACK).load_state_dict(incomplete)
    result = load_model(path, PACK).load_state_dict(incomplete, strict=False)  # Trainer's call
    assert list(result.missing_keys) == ["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(WeightLayoutError, match="assign=True"):
        load_model(path, PACK).load_state_dict(original, assign=True)
    patched_layout = source.state_dict()  # the patched layout still loads as it always did
    again = load_model(path, PACK)
    result = again.load_state_dict(patched_layout)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    torch.testing.assert_close(logits_of(again, ids, mask), logits_of(source, ids, mask), atol=0, rtol=0)


def test_accelerate_save_state_and_load_state_round_trip(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from accelerate import Accelerator

    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    accelerator = Accelerator(cpu=True)
    model: Any = accelerator.prepare(load_model(checkpoints["llama"], PACK))
    expected = logits_of(model, ids, mask)
    accelerator.save_state(str(tmp_path / "state"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    accelerator.load_state(str(tmp_path / "state"))
    torch.testing.assert_close(logits_of(model, ids, mask), expected, atol=0, rtol=0)
