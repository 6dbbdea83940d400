"""Trainer checkpoints of moe-replay models: a resume loads the experts and goes on exactly.

moe-replay converts no weight, but transformers' own conversions do (qwen2_moe's routed
experts are stacked into 3-D tensors when they load, and split back when they are saved),
and a resume loads the saved, original layout with ``load_state_dict``.  Vanilla
transformers drops the experts there and goes on from the initial weights.  hfpatch's load
guard writes the original layout through the model's conversions: into views of the
stacked tensors where the reversed conversion gives views (5.3), and forward through the
load's own conversions where it copies (5.25).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hfpatch_core
from conftest import PACK, PAD, VOCAB
from hfpatch_core import WeightLayoutError
from hfpatch_core.testing import install_pack, load_model, logits_of, padded_batch, trainer_losses


def experts_copied_on_save(model: torch.nn.Module) -> bool:
    """Whether this release's reversed expert conversion copies (5.25) rather than giving views (5.3)."""
    storages = {tensor.untyped_storage().data_ptr() for tensor in model.state_dict().values()}
    original = hfpatch_core.original_state_dict(model)
    experts = [tensor for key, tensor in original.items() if ".experts." in key]
    assert experts, "the checkpoint has no expert weights"
    return any(tensor.untyped_storage().data_ptr() not in storages for tensor in experts)


def moved(path: Path, packs: str | None) -> torch.nn.Module:
    """The checkpoint loaded with ``packs``, every weight moved away from it (another run's weights)."""
    model = load_model(path, packs)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def test_trainer_resume_gives_the_uninterrupted_losses(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = checkpoints["qwen2_moe"]
    uninterrupted = trainer_losses(load_model(path, PACK), tmp_path / "run")
    resumed = trainer_losses(load_model(path, PACK), tmp_path / "run", resume="checkpoint-2")
    # the resumed history starts with checkpoint-2's (steps 1-2); steps 3-4 are computed anew
    assert len(uninterrupted) == len(resumed) == 4
    torch.testing.assert_close(resumed[2:], uninterrupted[2:], atol=1e-4, rtol=0)
    # moe-replay outside a replay is vanilla, bit for bit
    assert uninterrupted == trainer_losses(load_model(path), tmp_path / "vanilla")


def test_load_state_dict_converts_the_experts_through_the_load_conversions(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen2_moe"]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    source = moved(path, PACK)
    original = {key: value.clone() for key, value in hfpatch_core.original_state_dict(source).items()}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in original
    assert not any(key.endswith("experts.gate_up_proj") for key in original)

    model = load_model(path, PACK)
    copies = experts_copied_on_save(model)  # 5.25: forward through the conversions; 5.3: into views
    assert not torch.equal(logits_of(model, ids, mask), logits_of(source, ids, mask))
    result = model.load_state_dict(original)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    torch.testing.assert_close(logits_of(model, ids, mask), logits_of(source, ids, mask), atol=0, rtol=0)
    for key, tensor in hfpatch_core.original_state_dict(model).items():
        assert torch.equal(tensor, original[key]), key

    # an incomplete group of experts is reported (views) or refused (a conversion), never dropped
    incomplete = {key: value for key, value in original.items() if key != "model.layers.1.mlp.experts.2.up_proj.weight"}
    target = load_model(path, PACK)
    if copies:
        with pytest.raises(
            WeightLayoutError, match=r"model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight.*all the experts"
        ):
            target.load_state_dict(incomplete, strict=False)
    else:
        result = target.load_state_dict(incomplete, strict=False)
        assert list(result.missing_keys) == ["model.layers.1.mlp.experts.2.up_proj.weight"]


_ELSEWHERE = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaMLP

    class ElsewhereMLP(LlamaMLP):
        pass

    @hookimpl
    def provide_patches(context):
        return [Patch("LlamaMLP", ElsewhereMLP)] if context.model_type == "llama" else []
"""


def test_a_model_no_pack_touches_loads_the_original_layout_too(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded while hfpatch is on, with a pack that does not apply to qwen2_moe: the load ran
    transformers' expert stacking only, and load_state_dict still converts the experts;
    vanilla transformers' reports them missing (and would train on from the old weights)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the pack is installed for this test only
    install_pack(tmp_path / "site", "elsewhere", _ELSEWHERE)
    path = checkpoints["qwen2_moe"]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    source = moved(path, None)
    original = {key: value.clone() for key, value in hfpatch_core.original_state_dict(source).items()}

    model = load_model(path, "elsewhere")
    plan = hfpatch_core.plan_of(model)
    assert plan is not None and not plan.entries and not plan.conversions
    assert list(model.load_state_dict(original).missing_keys) == []
    torch.testing.assert_close(logits_of(model, ids, mask), logits_of(source, ids, mask), atol=0, rtol=0)

    vanilla = load_model(path).load_state_dict(original, strict=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in vanilla.missing_keys
