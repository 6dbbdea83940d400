"""TRL's ``SFTTrainer`` on a fused-dense model, with the real TRL (issue 29 item 2).

PEFT draws LoRA's random initialisation in ``named_modules()`` order. The fused model lists
q/k/v/o and gate/up/down in vanilla's order, so ``target_modules="all-linear"`` with a fixed seed
starts from vanilla's adapters, and the fused views compute what the separate projections do:
the trainer's losses are vanilla's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from conftest import PACK, PAD, VOCAB
from hfpatch_core.testing import FP32_TOLERANCES, load_model, padded_batch


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (no download): token ``t<i>`` is id ``i``."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token=f"t{PAD}", unk_token="t1", eos_token="t2")


def sft(checkpoint: Path, packs: str | None, out: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The adapters SFTTrainer starts from and its losses over 4 steps."""
    ids = torch.cat([padded_batch(VOCAB, pad_token_id=PAD, seed=seed)[0] for seed in range(3)])
    rows = [[int(token) for token in row if token != PAD] for row in ids]
    model = load_model(checkpoint, packs)
    config = SFTConfig(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=3,
        learning_rate=1e-3,
        bf16=False,  # TRL trains in bf16 autocast by default: fp32 here, where the pack is exact
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=1234,
        use_cpu=True,
        dataloader_num_workers=0,  # and TRL's default gradient checkpointing, on
    )
    torch.manual_seed(1234)  # the adapters are drawn when the trainer wraps the model
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": rows}),
        processing_class=tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    start = {key: value.detach().clone() for key, value in trainer.model.state_dict().items() if "lora_A" in key}
    trainer.train()
    return start, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_sft_with_a_seeded_all_linear_lora_trains_as_on_vanilla(
    name: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    vanilla_start, vanilla_losses = sft(checkpoints[name], None, tmp_path / "vanilla")
    start, losses = sft(checkpoints[name], PACK, tmp_path / "patched")
    assert list(start) == list(vanilla_start) and vanilla_start
    for key, value in vanilla_start.items():
        assert torch.equal(start[key], value), key
    assert len(losses) == len(vanilla_losses) == 4
    # the training checks' fp32 bound (hfpatch_core.testing.FP32_TOLERANCES): other adapters move
    # the losses by 1e-2 (issue 29)
    gap = max(abs(a - b) for a, b in zip(losses, vanilla_losses, strict=True))
    assert gap <= FP32_TOLERANCES.loss, (losses, vanilla_losses)
