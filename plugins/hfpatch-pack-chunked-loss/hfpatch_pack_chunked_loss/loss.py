"""The chunked causal-LM loss: an autograd function over the hidden states and the head's weights.

The loss and its gradients are computed together, chunk of tokens by chunk of tokens, in the
forward (as Liger-Kernel's fused linear cross-entropy does): each chunk's logits are built,
transformed, upcast and reduced with the very operations vanilla's ``ForCausalLMLoss`` runs,
differentiated with autograd, and dropped before the next chunk.  The backward only scales the
stored gradients by the incoming one, so the step computes the head's matmuls as often as
vanilla does and never holds more than one chunk's logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["HeadTransform", "chunked_causal_lm_loss"]


@dataclasses.dataclass(frozen=True)
class HeadTransform:
    """What a family's forward does to the head's output before the loss, found by probing.

    Attributes:
        scale: logits are multiplied by it (cohere's ``logit_scale``; granite's
            ``1 / logits_scaling``); ``None`` when there is none.
        softcap: logits become ``softcap * tanh(logits / softcap)`` (gemma2's
            ``final_logit_softcapping``); ``None`` when there is none.
    """

    scale: float | None = None
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply the transform, in the order and with the operations the families use."""
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.scale is not None:
            logits = logits * self.scale
        return logits


def _chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: HeadTransform,
    ignore_index: int,
) -> torch.Tensor:
    logits = nn.functional.linear(hidden, weight, bias)
    # vanilla upcasts after the family's transform (ForCausalLMLoss's logits.float())
    logits = transform(logits).float()
    return nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        divisor: torch.Tensor,
        transform: HeadTransform,
        ignore_index: int,
        chunk: int,
    ) -> torch.Tensor:
        want_weight = weight.requires_grad
        want_bias = bias is not None and bias.requires_grad
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        # fp32 accumulators: vanilla rounds the weight's gradient once, after one matmul over
        # every token; summing chunks in the parameter's dtype would round once per chunk.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None  # type: ignore[union-attr]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = weight.detach().requires_grad_(want_weight)
        b = None if bias is None else bias.detach().requires_grad_(want_bias)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk].detach().requires_grad_(grad_hidden is not None)
            with torch.enable_grad():
                part = _chunk_loss(h, w, b, targets[start : start + chunk], transform, ignore_index) / divisor
                inputs = [x for x in (h, w, b) if x is not None and x.requires_grad]
                grads = list(torch.autograd.grad(part, inputs)) if inputs else []
            total += part.detach()
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = grads.pop(0)
            if grad_weight is not None:
                grad_weight += grads.pop(0)
            if grad_bias is not None:
                grad_bias += grads.pop(0)
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in (grad_hidden, grad_weight, grad_bias)))
        ctx.present = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        out: list[torch.Tensor | None] = []
        for tensor, present, dtype in zip(saved, ctx.present, ctx.dtypes, strict=True):
            if not present:
                out.append(None)
                continue
            # a loss of 1.0 * grad_output: Trainer's scaling (gradient accumulation) lands here
            out.append((tensor if bool(grad_output == 1) else tensor * grad_output).to(dtype))
        return (*out, None, None, None, None, None)


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor | None,
    transform: HeadTransform,
    *,
    chunk: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss vanilla's ``ForCausalLMLoss`` computes from ``transform(head(hidden))``, in chunks.

    Called by the installed forward in a training step with labels.

    Args:
        hidden: the decoder's last hidden states, ``(batch, sequence, hidden)``.
        head: the LM head (a plain ``nn.Linear``; tied or not).
        labels: the unshifted labels (ignored when ``shift_labels`` is given).
        transform: the family's transform between the head and the loss.
        chunk: tokens per chunk.
        num_items_in_batch: vanilla's: a sum divided by it instead of a mean.
        ignore_index: labels with this value count for nothing.
        shift_labels: labels already shifted, as vanilla accepts them.

    Returns:
        The scalar float32 loss, differentiable with respect to ``hidden`` and the head.

    Raises:
        ValueError: neither ``labels`` nor ``shift_labels`` is given.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        # cross_entropy's mean: over the tokens that are not ignored (nan when there is none, as vanilla)
        divisor = (targets != ignore_index).sum().to(torch.float32)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device)
    result: torch.Tensor = _ChunkedLoss.apply(
        flat, head.weight, head.bias, targets, divisor, transform, ignore_index, chunk
    )
    return result
