"""Trainer checkpoints of moe-replay models: a resume never drops the experts silently.

moe-replay converts no weight, but transformers' own conversions do (qwen2_moe's routed
experts are stacked into 3-D tensors when they load, and split back when they are saved),
and a resume loads the saved, original layout with ``load_state_dict``.  Vanilla
transformers drops the experts there and goes on from the initial weights.  hfpatch's load
guard writes the original layout through the reversed conversions where they give views;
where this one copies (5.25's stacked experts), the resume stops with a
``WeightLayoutError`` naming the expert keys instead of training on from the wrong weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hfpatch_core
from conftest import PACK, PAD, VOCAB
from hfpatch_core import WeightLayoutError
from hfpatch_core.testing import load_model, padded_batch


class Batches(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The padded batch's three rows, four times (labels = inputs)."""

    def __init__(self) -> None:
        self.ids, self.mask = padded_batch(VOCAB, pad_token_id=PAD)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = index % 3
        return {"input_ids": self.ids[row], "attention_mask": self.mask[row], "labels": self.ids[row]}


def train(checkpoint: Path, output: Path, resume: Path | None = None) -> list[float]:
    """The losses of 4 AdamW steps with moe-replay (a checkpoint every 2), from ``resume`` if given."""
    arguments = TrainingArguments(
        str(output),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=3,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=load_model(checkpoint, PACK), args=arguments, train_dataset=Batches())
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _experts_copied_on_save(path: Path) -> bool:
    """Whether this release's reversed expert conversion copies (stacked 3-D experts) rather than giving views."""
    model = load_model(path, PACK)
    storages = {tensor.untyped_storage().data_ptr() for tensor in model.state_dict().values()}
    original = hfpatch_core.original_state_dict(model)
    experts = [tensor for key, tensor in original.items() if ".experts." in key]
    assert experts, "the checkpoint has no expert weights"
    return any(tensor.untyped_storage().data_ptr() not in storages for tensor in experts)


def test_trainer_resume_loads_the_experts_or_stops_never_drops_them(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints["qwen2_moe"]
    uninterrupted = train(path, tmp_path / "run")
    assert len(uninterrupted) == 4
    if _experts_copied_on_save(path):  # 5.25: stacked experts
        with pytest.raises(WeightLayoutError, match=r"experts\.0\.gate_proj\.weight.*a conversion that copies"):
            train(path, tmp_path / "run", resume=tmp_path / "run" / "checkpoint-2")
    else:  # 5.3: the experts load as they are saved
        resumed = train(path, tmp_path / "run", resume=tmp_path / "run" / "checkpoint-2")
        torch.testing.assert_close(resumed[2:], uninterrupted[2:], atol=1e-4, rtol=0)
