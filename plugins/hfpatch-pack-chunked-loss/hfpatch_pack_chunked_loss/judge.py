"""How the probe judges the chunked loss against vanilla's: each measured against float64, the chunked loss
allowed four times vanilla's own error; and which ``*aux_loss_coef`` attribute the forward adds its auxiliary
loss with.  Used by the probe of every layout of the head (``compare.py``, ``vocab_parallel.py``)."""

from __future__ import annotations

import operator

import torch
from torch import nn

from .errors import ChunkedLossRefused
from .outputs import coefficient_paths

__all__ = ["aux_coefficient", "check", "errors", "judge"]


def errors(vanilla: torch.Tensor, ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, float]:
    """Vanilla's and the chunked loss's largest distance from the float64 ``reference``, and its largest value."""
    reference = reference.to(vanilla.device)
    return (
        float((vanilla.double() - reference).abs().max()),
        float((ours.double() - reference).abs().max()),
        float(reference.abs().max()),
    )


def check(name: str, vanilla: torch.Tensor, ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    """``judge`` on the ``errors`` of ``vanilla`` and ``ours``."""
    judge(name, *errors(vanilla, ours, reference), dtype)


def judge(name: str, vanilla_error: float, our_error: float, scale: float, dtype: torch.dtype) -> None:
    """Refuse when the chunked loss's ``name`` misses float64 by more than four times what vanilla's does (plus
    eight steps of ``dtype``), or when vanilla's loss is no token-wise cross-entropy at all."""
    eps = torch.finfo(dtype).eps
    # the float64 reference is the nearest token-wise cross-entropy (``LossKind``) over the transformed
    # head output: a vanilla loss that misses it by more than rounding (64 steps of the dtype at the loss:
    # a log-sum-exp and a mean over 4 tokens round by a few) is another loss (label smoothing, a z-loss),
    # which would make the bound below meaningless.  Checked on the loss only, where rounding is a few steps: a
    # gradient's sum over a 152k vocabulary misses float64 by tens of steps at its largest element.
    if name == "loss" and vanilla_error > 64 * eps * (scale or 1.0):
        raise ChunkedLossRefused(
            f"vanilla's {name} is not a token-wise cross-entropy over the head's output (shifted or not, a mean "
            f"or a sum over num_items_in_batch: the nearest misses float64's by {vanilla_error:.3g}): the forward "
            "computes another loss"
        )
    # calibrated on this probe: vanilla's own distance from float64 (it grows with the vocabulary and
    # the hidden size as the sums do); eight steps of the dtype at the largest value cover a vanilla that
    # happens to round well
    bound = 4 * vanilla_error + 8 * eps * (scale or 1.0)
    if our_error > bound:
        raise ChunkedLossRefused(
            f"the chunked loss's {name} differs from vanilla's on a probe (from float64: {our_error:.3g}, "
            f"vanilla's {vanilla_error:.3g})"
        )


def aux_coefficient(
    model: nn.Module, vanilla: torch.Tensor, ours: torch.Tensor, aux: torch.Tensor | None
) -> tuple[str | None, torch.Tensor]:
    """Which ``*aux_loss_coef`` attribute the forward multiplies the auxiliary loss by before adding it,
    and the chunked loss with it added as the step adds it."""
    if aux is None:
        return None, ours
    aux = aux.detach().to(ours.device)
    # the right coefficient leaves a loss's rounding (a few steps of float32 at the loss); another
    # misses by the difference of two coefficients times the auxiliary loss
    tolerance = 8 * torch.finfo(torch.float32).eps * max(1.0, abs(float(vanilla)))
    for path in coefficient_paths(model):
        total = ours + operator.attrgetter(path)(model) * aux
        if abs(float(total - vanilla)) <= tolerance:
            return path, total
    if abs(float(ours - vanilla)) <= tolerance:
        return None, ours  # the forward returns an auxiliary loss it does not add
    raise ChunkedLossRefused(
        "the forward adds its auxiliary loss (aux_loss, output_router_logits) to the loss with a coefficient "
        "that is none of the model's *aux_loss_coef attributes"
    )
