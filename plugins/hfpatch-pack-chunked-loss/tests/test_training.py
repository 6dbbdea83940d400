"""The chunked loss in the user's stack: HF Trainer (gradient accumulation, gradient checkpointing) and PEFT LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

from conftest import VOCAB, load


def _examples(count: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(3)
    examples = []
    for index in range(count):
        input_ids = torch.randint(3, VOCAB, (16,), generator=generator)
        labels = input_ids.clone()
        labels[: 2 + index % 5] = -100  # prompts of different lengths: num_items_in_batch matters
        examples.append({"input_ids": input_ids, "labels": labels})
    return examples


def _train(model: Any, output: Path, *, bf16: bool = False) -> list[float]:
    arguments = TrainingArguments(
        bf16=bf16,
        output_dir=str(output),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        # plain SGD: a parameter moves by lr x its gradient, so the 1e-5 gradient bound carries over
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_drop_last=True,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=_examples(12))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_with_gradient_accumulation_and_checkpointing(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    vanilla = load(checkpoints["gemma2"])
    vanilla_losses = _train(vanilla, tmp_path / "vanilla")
    model = load(checkpoints["gemma2"])
    chunked.install(model, chunk=5)
    shapes: list[tuple[int, ...]] = []
    model.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.logits.shape)))
    losses = _train(model, tmp_path / "pack")
    # every step went through the chunked loss (its .logits: the last position's)
    assert shapes == [(2, 1, VOCAB)] * 6
    assert len(losses) == 3
    # each logged loss: a sum of two micro-batches' losses over num_items_in_batch, 1e-6 relative
    for ours, theirs in zip(losses, vanilla_losses, strict=True):
        assert abs(ours - theirs) <= 1e-6 * abs(theirs)
    # three steps of lr 0.1 x gradients within 1e-5 of vanilla's
    for (name, ours), theirs in zip(model.named_parameters(), vanilla.parameters(), strict=True):
        assert float((ours - theirs).abs().max()) <= 1e-5, name


def test_peft_lora(checkpoints: dict[str, Path]) -> None:
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(3, VOCAB, (2, 20), generator=generator)
    sides = {}
    for side in ("vanilla", "pack"):
        torch.manual_seed(5)  # the same LoRA initialisation on both sides
        model = load(checkpoints["cohere"])
        if side == "pack":
            chunked.install(model, chunk=7)
        peft_model = get_peft_model(model, lora)
        # LoRA's B starts at zero: move it, so that the adapters change the loss
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        peft_model.train()
        loss = peft_model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        grads = {name: p.grad.clone() for name, p in peft_model.named_parameters() if p.grad is not None}
        sides[side] = (loss.detach(), grads)
    (vanilla_loss, vanilla_grads), (loss, grads) = sides["vanilla"], sides["pack"]
    assert vanilla_grads.keys() == grads.keys() and all("lora_" in name for name in grads)
    assert abs(float(loss - vanilla_loss)) <= 1e-6 * abs(float(vanilla_loss))
    assert max(float((grads[name] - vanilla_grads[name]).abs().max()) for name in grads) <= 1e-5


def test_peft_with_the_head_trained(checkpoints: dict[str, Path]) -> None:
    """``modules_to_save=["lm_head"]``: PEFT trains a copy of the head, which the chunked loss reads."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"], lora_dropout=0.0)
    input_ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(8))
    sides = {}
    for side in ("vanilla", "pack"):
        torch.manual_seed(5)
        model = load(checkpoints["granite"])
        if side == "pack":
            chunked.install(model, chunk=7)
        peft_model = get_peft_model(model, lora)
        with torch.no_grad():  # the trained copy differs from the original head: a step reading the wrong one fails
            peft_model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
        peft_model.train()
        out = peft_model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in peft_model.named_parameters() if p.grad is not None}
        sides[side] = (out.loss.detach(), grads, out.logits.shape)
    (vanilla_loss, vanilla_grads, _), (loss, grads, shape) = sides["vanilla"], sides["pack"]
    assert shape == (2, 1, VOCAB)  # the chunked step ran
    assert any("modules_to_save.default" in name for name in grads) and vanilla_grads.keys() == grads.keys()
    assert abs(float(loss - vanilla_loss)) <= 1e-6 * abs(float(vanilla_loss))
    assert max(float((grads[name] - vanilla_grads[name]).abs().max()) for name in grads) <= 1e-5


def test_trainer_in_bf16_autocast_within_vanillas_own_spread(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """``bf16=True``: Trainer runs the step under autocast; the pack's losses and weights stay within three times
    what autocast does to vanilla (vanilla bf16 against vanilla fp32, measured in this run)."""
    runs = {}
    for side, bf16 in (("fp32", False), ("vanilla", True), ("pack", True)):
        model = load(checkpoints["gemma2"])
        if side == "pack":
            chunked.install(model, chunk=5)
        shapes: list[tuple[int, ...]] = []
        model.register_forward_hook(lambda module, args, output, seen=shapes: seen.append(tuple(output.logits.shape)))
        losses = _train(model, tmp_path / side, bf16=bf16)
        runs[side] = (losses, dict(model.named_parameters()), shapes)
    assert runs["pack"][2] == [(2, 1, VOCAB)] * 6 and runs["vanilla"][2] == [(2, 16, VOCAB)] * 6
    reference_losses, reference, _ = runs["fp32"]
    for index, reference_loss in enumerate(reference_losses):
        spread = abs(runs["vanilla"][0][index] - reference_loss)
        floor = 2 * torch.finfo(torch.bfloat16).eps * abs(reference_loss)
        assert abs(runs["pack"][0][index] - reference_loss) <= max(3 * spread, floor), index
    for name, weight in reference.items():
        spread = float((runs["vanilla"][1][name] - weight).abs().max())
        floor = 2 * torch.finfo(torch.bfloat16).eps * float(weight.abs().max())
        assert float((runs["pack"][1][name] - weight).abs().max()) <= max(3 * spread, floor), name
