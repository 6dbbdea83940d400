"""Short ``Trainer`` runs for a pack's checkpoint and resume tests.

A pack that converts weights must keep what tools outside hfpatch do with a model
working, and the first of those is ``transformers.Trainer``: it saves checkpoints (in
the original layout) and resumes from them with ``model.load_state_dict``.
``trainer_losses`` runs a few optimizer steps on the CPU, a checkpoint every
``save_steps``, and returns the loss logged at each step, so a test compares a resumed
run with the uninterrupted one (and with vanilla transformers) step by step::

    uninterrupted = trainer_losses(load_model(path, "my-pack"), tmp_path / "run")
    resumed = trainer_losses(load_model(path, "my-pack"), tmp_path / "run", resume="checkpoint-2")
    assert resumed[2:] == pytest.approx(uninterrupted[2:], abs=1e-4)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .models import padded_batch

#: steps and checkpoint interval of ``trainer_losses``: a resume from ``checkpoint-2`` recomputes steps 3 and 4
DEFAULT_TRAINER_STEPS = 4


class TrainerBatches(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The three rows of ``padded_batch`` as a ``Trainer`` dataset, repeated (labels = the inputs).

    Each item is ``{"input_ids", "attention_mask", "labels"}`` of one left-padded row, so a
    batch of 3 is the whole padded batch, the same at every step.
    """

    def __init__(self, vocab_size: int, *, pad_token_id: int = 0, repeats: int = DEFAULT_TRAINER_STEPS) -> None:
        """Args:
            vocab_size: the model's vocabulary size (tokens are drawn from ``3 .. vocab_size - 1``).
            pad_token_id: the token id of the padding.
            repeats: how many times the three rows are repeated (the dataset has ``3 * repeats`` items).

        Raises:
            ValueError: ``vocab_size`` is 3 or less, ``pad_token_id`` is outside the vocabulary,
                or ``repeats`` is below 1.
        """
        if repeats < 1:
            raise ValueError(f"TrainerBatches(repeats=...) must be 1 or more, got {repeats}")
        self.ids, self.mask = padded_batch(vocab_size, pad_token_id=pad_token_id)
        self.repeats = repeats

    def __len__(self) -> int:
        return int(self.ids.shape[0]) * self.repeats

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = index % int(self.ids.shape[0])
        return {"input_ids": self.ids[row], "attention_mask": self.mask[row], "labels": self.ids[row]}


def trainer_losses(
    model: Any,
    output_dir: str | Path,
    *,
    resume: str | Path | None = None,
    max_steps: int = DEFAULT_TRAINER_STEPS,
    save_steps: int = 2,
    learning_rate: float = 1e-2,
    dataset: torch.utils.data.Dataset[dict[str, torch.Tensor]] | None = None,
    seed: int = 0,
) -> list[float]:
    """Train ``model`` with ``transformers.Trainer`` on the CPU and return the loss of every step.

    AdamW (``Trainer``'s default) at ``learning_rate``, batches of 3, a checkpoint every
    ``save_steps`` steps written under ``output_dir`` (``checkpoint-N``), seeded.

    Args:
        model: the model to train (loaded with the pack or not); it is trained in place.
        output_dir: where ``Trainer`` writes its checkpoints.
        resume: a checkpoint to resume from, absolute or relative to ``output_dir``
            (``"checkpoint-2"``); ``None`` trains from the model's weights.
        max_steps: optimizer steps in all (a resumed run counts the checkpoint's steps).
        save_steps: the checkpoint interval.
        learning_rate: AdamW's learning rate (large, so a weight lost on resume shows in the loss).
        dataset: the training data; ``TrainerBatches`` of the model's vocabulary and pad id by default.
        seed: ``TrainingArguments.seed``.

    Returns:
        The logged loss of each step, ``max_steps`` of them; a resumed run's list starts
        with the losses the checkpoint logged, so its steps after the checkpoint are at
        the same positions as in the uninterrupted run.
    """
    from transformers import Trainer, TrainingArguments

    if dataset is None:
        from .models import text_config_of

        config = text_config_of(model.config)  # a composite model's vocabulary is its text model's
        pad = getattr(config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) and 0 <= pad < int(config.vocab_size) else 0
        dataset = TrainerBatches(int(config.vocab_size), pad_token_id=pad, repeats=max_steps)
    arguments = TrainingArguments(
        str(output_dir),
        max_steps=max_steps,
        save_steps=save_steps,
        per_device_train_batch_size=3,
        learning_rate=learning_rate,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        seed=seed,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset)
    checkpoint = None if resume is None else Path(output_dir) / resume
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    return [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
