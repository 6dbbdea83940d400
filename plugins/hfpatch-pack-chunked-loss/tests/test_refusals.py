"""Structures the chunked loss does not reproduce are refused with the reason, and left vanilla."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from conftest import load, refused


class _ClampedLlama(LlamaForCausalLM):
    """A head transform that is neither a scale nor a soft-cap: logits clamped to [-20, 20]."""

    def forward(  # type: ignore[override]
        self, input_ids: Any = None, labels: Any = None, logits_to_keep: int = 0, **kwargs: Any
    ) -> Any:
        out = super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits.clamp(-20.0, 20.0)
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
        return out


def test_a_head_that_is_not_a_plain_linear(checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints["llama"])
    model.lm_head = nn.Sequential(model.lm_head)
    assert "the LM head is a Sequential, not a plain nn.Linear" in refused(model)


def test_a_loss_of_the_callers(checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints["llama"])

    def label_smoothed(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        shifted = logits.float()[..., :-1, :].reshape(-1, vocab_size)
        return nn.functional.cross_entropy(shifted, labels[..., 1:].reshape(-1), label_smoothing=0.1)

    model.loss_function = label_smoothed
    assert "vanilla's loss is not a token-wise cross-entropy over the head's output" in refused(model)


def test_a_loss_of_the_callers_that_computes_the_causal_lms_is_claimed(checkpoints: dict[str, Path]) -> None:
    """The loss is judged by what it computes, not by its name: ForCausalLMLoss ignores a
    ``label_smoothing`` keyword (its ``**kwargs``), so this one is the causal LM's loss."""
    model = load(checkpoints["llama"])

    def renamed(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size, label_smoothing=0.1, **kwargs)

    model.loss_function = renamed
    assert chunked.install(model).loss == chunked.LossKind(shift=True, loss_kwargs=True)


def test_a_transform_that_is_neither_a_scale_nor_a_soft_cap(checkpoints: dict[str, Path]) -> None:
    model = _ClampedLlama.from_pretrained(checkpoints["llama"], attn_implementation="eager")
    assert "neither the identity, a scale, a soft-cap nor a scale then a soft-cap" in refused(model)
    # the same checkpoint in vanilla's class is claimed: the refusal is the clamp's
    assert chunked.install(load(checkpoints["llama"])).transform == chunked.HeadTransform()


def test_chunk_must_be_positive(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="chunk must be positive"):
        chunked.install(load(checkpoints["llama"]), chunk=0)


def test_installing_twice(checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints["llama"])
    chunked.install(model)
    with pytest.raises(ValueError, match="already has the chunked loss"):
        chunked.install(model)


def test_a_sharded_head(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """FSDP2 and tensor parallelism make the head's weight a DTensor: refused (one gloo rank here)."""
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = load(checkpoints["llama"])
        mesh = init_device_mesh("cpu", (1,))
        model.lm_head.weight = nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Replicate()]))
        assert "the LM head's weight is a DTensor (FSDP2 or tensor parallelism)" in refused(model)
    finally:
        torch.distributed.destroy_process_group()
