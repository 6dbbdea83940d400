"""Per-token log-probabilities (GRPO, DPO) without the logits: vanilla's values and gradients, fp32, chunked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from test_exactness import _LargestOutput

from conftest import VOCAB, Case, load

INPUT_IDS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(15))
# a per-token weight, as GRPO's advantages and masks give: every token's gradient differs
WEIGHTS = torch.randn(2, 23, generator=torch.Generator().manual_seed(16))


def _vanilla(model: Any, temperature: float) -> torch.Tensor:
    logits = model(input_ids=INPUT_IDS).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, INPUT_IDS[:, 1:, None]).squeeze(-1)


def _grads(model: Any, values: torch.Tensor) -> dict[str, torch.Tensor]:
    (values * WEIGHTS).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vanillas_values_and_gradients(case: Case, checkpoints: dict[str, Path], temperature: float) -> None:
    vanilla = load(checkpoints[case.name])
    expected = _vanilla(vanilla, temperature)
    expected_grads = _grads(vanilla, expected)
    model = load(checkpoints[case.name])
    chunked.install(model, chunk=5)
    values = chunked.token_log_probs(model, INPUT_IDS, temperature=temperature)
    assert values.shape == (2, 23) and values.dtype == torch.float32
    # fp32: the same per-token operations; log-probabilities of a few units within 1e-5
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-5)
    grads = _grads(model, values)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert float((grad - expected_grads[name]).abs().max()) <= 1e-5, name


def test_a_wrong_temperature_fails_the_same_bound(checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints["gemma2"])
    chunked.install(model, chunk=5)
    values = chunked.token_log_probs(model, INPUT_IDS, temperature=0.7)
    assert float((values - _vanilla(load(checkpoints["gemma2"]), 1.0)).abs().max()) > 1e-3


def test_no_tokens_by_vocabulary_tensor_is_made(checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints["llama"])
    chunked.install(model, chunk=5)
    with _LargestOutput() as mode:
        (chunked.token_log_probs(model, INPUT_IDS) * WEIGHTS).sum().backward()
    # at most the head's weight (vocabulary x hidden 32) or a chunk's logits; 2 x 23 tokens x vocabulary is larger
    assert mode.largest <= VOCAB * 32 < 2 * 23 * VOCAB


def test_refused_without_the_install(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="has no chunked loss installed"):
        chunked.token_log_probs(load(checkpoints["llama"]), INPUT_IDS)
    model = load(checkpoints["llama"])
    chunked.install(model)
    with pytest.raises(ValueError, match="temperature must be positive, not 0"):
        chunked.token_log_probs(model, INPUT_IDS, temperature=0)
