"""``chunked_causal_lm_loss`` itself against vanilla's ``ForCausalLMLoss`` on a bare head: the paths
the models of the other files do not take (a bias, a frozen head or hidden state, every label
ignored, a scaled backward), what the one-pass kernel allocates, and the labels it refuses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hfpatch_pack_chunked_loss import HeadTransform, chunked_causal_lm_loss
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

HIDDEN, VOCAB, BATCH, SEQUENCE, CHUNK = 16, 50, 2, 13, 4

TRANSFORMS = {
    "identity": HeadTransform(),
    "scale": HeadTransform(scale=0.25),
    "softcap": HeadTransform(softcap=3.0),
}


def _inputs(seed: int = 0, *, bias: bool = False) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias)
    hidden = torch.randn(BATCH, SEQUENCE, HIDDEN, generator=generator).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
    labels[0, :3] = -100  # a prompt
    labels[1, -2:] = -100  # padding
    return hidden, head, labels


def _vanilla(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, transform: HeadTransform, **kw: Any) -> Any:
    return ForCausalLMLoss(transform(head(hidden)), labels, VOCAB, **kw)


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    wanted = [t for t in tensors if t.requires_grad]
    return list(torch.autograd.grad(loss, wanted))


def _assert_vanillas(
    compute: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor], tensors: list[torch.Tensor]
) -> None:
    ours, theirs = compute(), reference()
    # fp32: the same per-token operations, the sums in another order (test_exactness.py's bounds)
    assert abs(float(ours - theirs)) <= 1e-6 * abs(float(theirs))
    for a, b in zip(_grads(ours, tensors), _grads(theirs, tensors), strict=True):
        assert float((a - b).abs().max()) <= 1e-5


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_with_and_without_a_bias(name: str, bias: bool) -> None:
    hidden, head, labels = _inputs(bias=bias)
    transform = TRANSFORMS[name]
    tensors = [hidden, head.weight, *([head.bias] if bias else [])]
    _assert_vanillas(
        lambda: chunked_causal_lm_loss(hidden, head, labels, transform, chunk=CHUNK),
        lambda: _vanilla(hidden, head, labels, transform),
        tensors,
    )


@pytest.mark.parametrize("frozen", ["head", "hidden"])
def test_a_frozen_head_or_hidden_state(frozen: str) -> None:
    """LoRA freezes the head; a frozen decoder gives hidden states without a gradient."""
    hidden, head, labels = _inputs(1)
    if frozen == "head":
        head.weight.requires_grad_(False)
    else:
        hidden = hidden.detach()
    for transform in TRANSFORMS.values():
        _assert_vanillas(
            lambda t=transform: chunked_causal_lm_loss(hidden, head, labels, t, chunk=CHUNK),
            lambda t=transform: _vanilla(hidden, head, labels, t),
            [hidden, head.weight],
        )


def test_every_label_ignored_is_vanillas_nan_and_zero_gradients() -> None:
    hidden, head, labels = _inputs(2)
    labels = torch.full_like(labels, -100)
    ours = chunked_causal_lm_loss(hidden, head, labels, HeadTransform(), chunk=CHUNK)
    theirs = _vanilla(hidden, head, labels, HeadTransform())
    assert torch.isnan(theirs) and torch.isnan(ours)
    for a, b in zip(_grads(ours, [hidden, head.weight]), _grads(theirs, [hidden, head.weight]), strict=True):
        assert torch.equal(a, b) and not a.any()


def test_a_scaled_backward_scales_the_gradients() -> None:
    """Gradient accumulation and loss scaling send another gradient than 1.0 into the backward."""
    hidden, head, labels = _inputs(3)
    ours = chunked_causal_lm_loss(hidden, head, labels, HeadTransform(scale=0.5), chunk=CHUNK) * 0.375
    theirs = _vanilla(hidden, head, labels, HeadTransform(scale=0.5)) * 0.375
    for a, b in zip(_grads(ours, [hidden, head.weight]), _grads(theirs, [hidden, head.weight]), strict=True):
        assert float((a - b).abs().max()) <= 1e-5


@pytest.mark.parametrize("label", [VOCAB, -5])
def test_a_label_outside_the_vocabulary_is_refused_by_name(label: int) -> None:
    """Vanilla's nll_loss raises on it; a negative label would otherwise index the logits from the end."""
    hidden, head, labels = _inputs(4)
    labels[1, 5] = label  # shifted: token 1 * 13 + 4 of the flattened targets
    with pytest.raises(IndexError) as raised:
        _vanilla(hidden, head, labels, HeadTransform())
    with pytest.raises(IndexError, match=rf"label {label} \(token 17 .*outside the vocabulary \(0 to {VOCAB - 1}\)"):
        chunked_causal_lm_loss(hidden, head, labels, HeadTransform(), chunk=CHUNK)
    assert "out of bounds" in str(raised.value)


class _VocabularyOutputs(TorchDispatchMode):
    """Every (rows, vocabulary) tensor an operation returns (views of ``parameter``, the head's
    transposed weight, aside), and the head's matmuls run."""

    def __init__(self, parameter: torch.Tensor) -> None:
        super().__init__()
        self.parameter = parameter.untyped_storage().data_ptr()
        self.shapes: list[tuple[int, ...]] = []
        self.storages: set[int] = set()
        self.matmuls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            if any(VOCAB in a.shape for a in operands):
                self.matmuls += 1
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dim() == 2
                and tensor.shape[1] == VOCAB
                and tensor.untyped_storage().data_ptr() != self.parameter
            ):
                self.shapes.append(tuple(tensor.shape))
                self.storages.add(tensor.untyped_storage().data_ptr())
        return out


def test_one_pass_one_buffer_and_only_the_counted_tokens() -> None:
    """float32: each chunk's logits are made once, in one buffer reused by every chunk, for the
    counted tokens only, and the head's three matmuls run once per chunk (no recompute)."""
    hidden, head, labels = _inputs(5)
    counted = int((nn.functional.pad(labels, (0, 1), value=-100)[..., 1:] != -100).sum())
    chunks = -(-counted // CHUNK)
    with _VocabularyOutputs(head.weight) as mode:
        loss = chunked_causal_lm_loss(hidden, head, labels, HeadTransform(), chunk=CHUNK)
        loss.backward()
    assert len(mode.storages) == 1, mode.shapes
    assert max(rows for rows, _ in mode.shapes) == CHUNK
    # the last chunk holds what is left of the counted tokens, not of every token
    assert min(rows for rows, _ in mode.shapes) == counted - (chunks - 1) * CHUNK
    assert mode.matmuls == 3 * chunks
    # and vanilla's step, measured the same way, writes several tokens x vocabulary tensors
    with _VocabularyOutputs(head.weight) as mode:
        _vanilla(hidden, head, labels, HeadTransform()).backward()
    assert len(mode.storages) >= 3 and max(rows for rows, _ in mode.shapes) == BATCH * SEQUENCE
