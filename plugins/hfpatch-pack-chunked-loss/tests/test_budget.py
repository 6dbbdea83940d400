"""Chunks sized by a byte budget: at a 151,936 vocabulary and 2 x 512 tokens a training step holds at most the
budget of logits (measured by the tensors it makes), set through ``install`` or ``HF_PATCH_CHUNKED_LOSS_BUDGET``."""

from __future__ import annotations

import re
import weakref
from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, LlamaConfig

import hfpatch_core
from hfpatch_core.errors import PackError

VOCAB = 151_936
HIDDEN = 16
BUDGET = 64 * 2**20
_SMALL = dict(
    hidden_size=HIDDEN,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": lambda: LlamaConfig(**_SMALL),
    "gemma2": lambda: Gemma2Config(**_SMALL, head_dim=8, final_logit_softcapping=3.0),
    "cohere": lambda: CohereConfig(**_SMALL, logit_scale=0.5),
}
TOKENS = torch.randint(3, VOCAB, (2, 512), generator=torch.Generator().manual_seed(14))


class _LiveLogits(TorchDispatchMode):
    """The most bytes of logits-like tensors (a vocabulary-sized dimension, no hidden-sized one: not the
    head's weight, its views or gradients) alive at once, counted by storage while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[weakref.ref[Any], int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and VOCAB in tensor.shape and HIDDEN not in tensor.shape:
                storage = tensor.untyped_storage()
                self.live[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        self.live = {key: value for key, value in self.live.items() if value[0]() is not None}
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def _model(family: str, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager", dtype=dtype)
    model.train()
    return model


def _held(model: Any) -> int:
    with _LiveLogits() as mode:
        out = model(input_ids=TOKENS, labels=TOKENS)
        out.loss.backward()
    assert out.logits.shape == (2, 1, VOCAB)  # the chunked step ran
    return mode.peak


@pytest.mark.parametrize(("family", "dtype"), [("llama", None), ("gemma2", None), ("cohere", None), ("llama", "bf16")])
def test_a_step_holds_at_most_the_budget(family: str, dtype: str | None) -> None:
    model = _model(family, torch.bfloat16 if dtype else torch.float32)
    assert chunked.install(model, budget=BUDGET).budget == BUDGET
    held = _held(model)
    assert held <= BUDGET
    # the budget is used, not undercut by a guess: more than half of it holds logits
    assert held > BUDGET / 2


def test_a_fixed_chunk_of_the_whole_batch_holds_more() -> None:
    """The other side: 128 tokens per chunk (the old default, 1,024, would be the whole batch) exceed it."""
    model = _model("llama")
    chunked.install(model, chunk=128)
    assert _held(model) > BUDGET


def test_chunk_for() -> None:
    one_token = VOCAB * 4 * chunked.LOGIT_COPIES
    assert chunked.chunk_for(10 * one_token, VOCAB) == 10
    assert chunked.chunk_for(10 * one_token, VOCAB, held=1) == 9  # the last position's logits count
    assert chunked.chunk_for(1, VOCAB) == 1  # one token at least
    assert chunked.chunk_for(chunked.DEFAULT_BUDGET, VOCAB) == 110


def test_the_budget_through_the_environment(checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_PATCH_PACKS", "chunked-loss")
    monkeypatch.setenv(chunked.BUDGET_ENV, "64MiB")
    with hfpatch_core.enabled(strict=True):
        model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    assert chunked.installed(model) == chunked.Installed(chunked.HeadTransform(), budget=BUDGET)
    monkeypatch.delenv(chunked.BUDGET_ENV)
    assert chunked.install(AutoModelForCausalLM.from_pretrained(checkpoints["llama"])).budget == chunked.DEFAULT_BUDGET


@pytest.mark.parametrize("value", ["lots", "0", "-5MiB", "64 parsecs"])
def test_a_budget_that_is_not_bytes_is_an_error(
    value: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(chunked.BUDGET_ENV, value)
    with pytest.raises(ValueError, match=f"{chunked.BUDGET_ENV}={value!r} is not a positive number of bytes"):
        chunked.budget_from_env()
    monkeypatch.setenv("HF_PATCH_PACKS", "chunked-loss")
    with pytest.raises(PackError, match="is not a positive number of bytes"), hfpatch_core.enabled(strict=True):
        AutoModelForCausalLM.from_pretrained(checkpoints["llama"])


def test_chunk_and_budget_are_exclusive(checkpoints: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    with pytest.raises(ValueError, match=re.escape("a chunk (5 tokens) or a budget (64 bytes), not both")):
        chunked.install(model, chunk=5, budget=64)
    with pytest.raises(ValueError, match="budget must be a positive number of bytes, not 0"):
        chunked.install(model, budget=0)
