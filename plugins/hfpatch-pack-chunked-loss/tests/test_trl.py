"""TRL's ``SFTTrainer`` (default settings: gradient checkpointing on) on a model with the chunked loss installed."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from conftest import VOCAB, load

# the probe's comparison, whose chunked_causal_lm_loss the install's probe calls
compare_module = importlib.import_module("hfpatch_pack_chunked_loss.compare")


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (no download): token ``t<i>`` is id ``i``."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", unk_token="t1", eos_token="t2")


def _sft(checkpoint: Path, install: bool, out: Path) -> list[dict[str, float]]:
    generator = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, VOCAB, (10 + i,), generator=generator).tolist() for i in range(6)]
    model = load(checkpoint)
    if install:
        chunked.install(model, chunk=5)
    config = SFTConfig(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=3,
        learning_rate=1e-3,
        bf16=False,  # fp32, where the bound is the fp32 one
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=1234,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    torch.manual_seed(1234)  # the adapters are drawn when the trainer wraps the model
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": rows}),
        processing_class=_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_sft_trains_as_on_vanilla(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    vanilla = _sft(checkpoints["llama"], False, tmp_path / "vanilla")
    calls = []
    loss = compare_module.chunked_causal_lm_loss

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape)
        return loss(*args, **kwargs)

    monkeypatch.setattr(compare_module, "chunked_causal_lm_loss", counted)
    with caplog.at_level(logging.INFO, logger="hfpatch"):
        ours = _sft(checkpoints["llama"], True, tmp_path / "chunked")
    # install's probe only: TRL's SFTTrainer (1.16) computes its loss through its own tiled head
    # (trl.trainer.utils.add_fused_lm_head, fused_lm_head=True), so its steps never reach the pack,
    # and installing it changes nothing there
    assert len(calls) == 1
    # and the log says so, once
    fused = "trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward"
    said = [r.getMessage() for r in caplog.records if "this training step's loss is computed by" in r.getMessage()]
    assert said == [
        f"hfpatch: LlamaForCausalLM: this training step's loss is computed by {fused}, which replaced the forward "
        "after chunked-loss's install"
    ]
    assert len(ours) == len(vanilla) == 2
    for a, b in zip(ours, vanilla, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])


def test_the_pack_computes_when_the_fused_head_is_off(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """TRL's wrapper without ``fused_lm_head`` calls the forward it wrapped: the pack's step, exact, and the log
    and ``loss_computed_by`` say who computes."""
    from trl.trainer.utils import add_fused_lm_head

    input_ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    vanilla = load(checkpoints["llama"])
    vanilla_loss = vanilla(input_ids=input_ids, labels=input_ids).loss
    model = load(checkpoints["llama"])
    chunked.install(model, chunk=5)
    assert chunked.loss_computed_by(model) == "chunked-loss"
    add_fused_lm_head(model)
    fused = "trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward"
    assert chunked.loss_computed_by(model) == fused
    with caplog.at_level(logging.INFO, logger="hfpatch"):
        out = model(input_ids=input_ids, labels=input_ids)
        fused_out = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    assert out.logits.shape == (2, 1, VOCAB)  # the pack's step
    assert abs(float(out.loss - vanilla_loss)) <= 1e-6 * abs(float(vanilla_loss))
    assert abs(float(fused_out.loss - vanilla_loss)) <= 1e-5 * abs(float(vanilla_loss))
    said = [r.getMessage() for r in caplog.records if "this training step's loss is computed by" in r.getMessage()]
    assert said == [
        "hfpatch: LlamaForCausalLM: this training step's loss is computed by chunked-loss "
        f"(called with labels by {fused})",
        f"hfpatch: LlamaForCausalLM: this training step's loss is computed by {fused}, which replaced the forward "
        "after chunked-loss's install",
    ]
    chunked.uninstall(model)
    assert chunked.loss_computed_by(model) is None
