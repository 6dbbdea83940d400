"""The install's probe at a Qwen-size vocabulary: its bound is calibrated on vanilla's own distance from float64,
so it claims what is exact whatever the seed, and still refuses a loss that is not vanilla's."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from hfpatch_pack_chunked_loss import ChunkedLossRefused
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

import hfpatch_core

compare_module = importlib.import_module("hfpatch_pack_chunked_loss.compare")

QWEN_VOCAB = 151_936
# a tiny hidden size: the head is 151,936 x 16, the probe's sums over the vocabulary are Qwen's
_SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)


def _model(seed: int, family: Any = LlamaConfig) -> Any:
    torch.manual_seed(seed)
    config = family(**_SMALL, vocab_size=QWEN_VOCAB, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.train()
    return model


@pytest.mark.parametrize("seed", range(6))
def test_a_qwen_size_vocabulary_is_claimed_whatever_the_seed(seed: int) -> None:
    assert chunked.install(_model(seed, Qwen2Config if seed % 2 else LlamaConfig)).transform == chunked.HeadTransform()


def _off_by_a_ten_thousandth(monkeypatch: pytest.MonkeyPatch) -> None:
    loss = compare_module.chunked_causal_lm_loss

    def scaled(*args: Any, **kwargs: Any) -> torch.Tensor:
        return loss(*args, **kwargs) * (1 + 1e-4)

    monkeypatch.setattr(compare_module, "chunked_causal_lm_loss", scaled)


def test_a_loss_off_by_a_ten_thousandth_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the bound: a chunked loss scaled by 1 + 1e-4 (its gradients too) is refused."""
    _off_by_a_ten_thousandth(monkeypatch)
    with pytest.raises(ChunkedLossRefused, match="the chunked loss's loss differs from vanilla's on a probe"):
        chunked.install(_model(0))


def test_a_refusal_of_the_selected_pack_warns(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _off_by_a_ten_thousandth(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="hfpatch"), hfpatch_core.enabled("chunked-loss", strict=True):
        model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    assert chunked.installed(model) is None
    [record] = [r for r in caplog.records if "chunked-loss refused" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("hfpatch: chunked-loss refused LlamaForCausalLM: the chunked loss's loss")
    assert "its training steps compute vanilla's full logits" in record.getMessage()
