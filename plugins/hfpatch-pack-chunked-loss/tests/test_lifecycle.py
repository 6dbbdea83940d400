"""A model with the chunked loss is handled as users handle models: deep-copied (TRL's reference models, EMA
copies), pickled (``torch.save(model)``), freed by the garbage collector, uninstalled on a copy."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref
from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch

from conftest import VOCAB, load

TOKENS = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(13))


def _step(model: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=TOKENS, labels=TOKENS)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _installed_model(checkpoints: dict[str, Path]) -> Any:
    model = load(checkpoints["gemma2"])
    chunked.install(model, chunk=7)
    return model


def _assert_is_its_own(copied: Any, original: Any, checkpoints: dict[str, Path]) -> None:
    """``copied`` has the chunked loss, computes with its own weights, and its gradients land on it."""
    with torch.no_grad():
        copied.lm_head.weight.mul_(2)
    reference = load(checkpoints["gemma2"])
    with torch.no_grad():
        reference.lm_head.weight.mul_(2)
    for mode in ("train", "eval"):
        for model in (copied, original, reference):
            getattr(model, mode)()
        original.zero_grad(set_to_none=True)
        loss, grads = _step(copied)
        assert all(p.grad is None for p in original.parameters()), mode  # nothing landed on the original
        reference_loss, reference_grads = _step(reference)
        original_loss, _ = _step(original)
        assert abs(float(loss - reference_loss)) <= 1e-6 * abs(float(reference_loss)), mode
        assert abs(float(loss - original_loss)) > 1e-3, mode
        assert max(float((grads[n] - reference_grads[n]).abs().max()) for n in grads) <= 1e-5
    copied.train()
    assert copied(input_ids=TOKENS, labels=TOKENS).logits.shape == (2, 1, VOCAB)  # the chunked step
    assert chunked.installed(copied) == chunked.installed(original)


def test_a_deepcopy_computes_with_its_own_weights(checkpoints: dict[str, Path]) -> None:
    model = _installed_model(checkpoints)
    _assert_is_its_own(copy.deepcopy(model), model, checkpoints)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_pickled_model_loads_with_the_chunked_loss(how: str, checkpoints: dict[str, Path]) -> None:
    model = _installed_model(checkpoints)
    if how == "pickle":
        restored = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        restored = torch.load(buffer, weights_only=False)
    _assert_is_its_own(restored, model, checkpoints)


def test_uninstalling_a_copy_leaves_the_original(checkpoints: dict[str, Path]) -> None:
    model = _installed_model(checkpoints)
    copied = copy.deepcopy(model)
    chunked.uninstall(copied)
    assert chunked.installed(copied) is None and "forward" not in copied.__dict__
    assert not copied.model._forward_hooks and model.model._forward_hooks  # the log's hook, on the copy only
    assert copied(input_ids=TOKENS, labels=TOKENS).logits.shape == (2, 20, VOCAB)
    assert chunked.installed(model) is not None
    assert model(input_ids=TOKENS, labels=TOKENS).logits.shape == (2, 1, VOCAB)


def test_an_installed_model_is_freed(checkpoints: dict[str, Path]) -> None:
    model = _installed_model(checkpoints)
    _step(model)
    reference = weakref.ref(model)
    del model
    gc.collect()
    assert reference() is None
