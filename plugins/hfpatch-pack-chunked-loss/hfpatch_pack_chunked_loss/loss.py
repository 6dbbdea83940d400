"""The chunked causal-LM loss: an autograd function over the hidden states and the head's weights.

The loss and its gradients are computed together, chunk of tokens by chunk of tokens, in the
forward (as Liger-Kernel's fused linear cross-entropy does), in one pass: each chunk's logits are
built and transformed with the operations vanilla's forward runs, their log-softmax (vanilla's
``ForCausalLMLoss`` kernel) gives the chunk's losses, and the same buffer is turned in place into
the gradient of the loss with respect to the logits (``softmax - one_hot``), which the head's two
backward matmuls consume before the next chunk overwrites it.  The backward only scales the stored
gradients by the incoming one.  So the step runs the head's three matmuls once, as vanilla does,
never holds more than one chunk's logits, and makes fewer passes over them than vanilla's autograd
(which writes the log-softmax, a zero-filled gradient and the log-softmax's gradient besides the
logits, each a fresh tokens x vocabulary tensor).  Tokens whose label is ignored are not computed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .chunks import chunks

__all__ = ["HeadTransform", "chunked_causal_lm_loss"]


@dataclasses.dataclass(frozen=True)
class HeadTransform:
    """What a family's forward does to the head's output before the loss, found by probing.

    Attributes:
        scale: logits are multiplied by it (cohere's ``logit_scale``; granite's
            ``1 / logits_scaling``); ``None`` when there is none.
        softcap: logits become ``softcap * tanh(logits / softcap)`` (gemma2's
            ``final_logit_softcapping``); ``None`` when there is none.
        prescale: logits are multiplied by it before the soft-cap (muse_glimmer's
            ``output_multiplier``: ``softcap * tanh(logits * prescale / softcap)``); ``None`` when
            there is none.  Set only with ``softcap`` (a scale alone is ``scale``).
    """

    scale: float | None = None
    softcap: float | None = None
    prescale: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply the transform, in the order and with the operations the families use."""
        if self.prescale is not None:
            logits = logits * self.prescale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.scale is not None:
            logits = logits * self.scale
        return logits


def _hand_written(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: HeadTransform
) -> bool:
    # float32 throughout, without autocast (which runs the head in another dtype) and with a
    # transform whose gradient is a constant (a scale): the head's matmuls are written out, into
    # one reused buffer; otherwise autograd differentiates the head and the transform, as vanilla's does
    return (
        hidden.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and transform.softcap is None
        and transform.prescale is None
        and not torch.is_autocast_enabled(hidden.device.type)
    )


def logit_bytes_per_token(hidden: torch.Tensor, head: nn.Linear, transform: HeadTransform, copies: int) -> int:
    """Bytes of chunk x vocabulary tensors one token of a chunk holds at once, at most, on the path the
    loss takes for these inputs: the hand-written path's one reused float32 buffer; autograd's
    ``copies`` tensors (logits, ``log_softmax``'s output, the gradients of the backward, a soft-cap's
    saved ``tanh``) in the logits' dtype, float32 under autocast."""
    vocab = int(head.weight.shape[0])
    if _hand_written(hidden, head.weight, head.bias, transform):
        return vocab * 4
    autocast = torch.is_autocast_enabled(hidden.device.type)
    element = 4 if autocast else torch.promote_types(hidden.dtype, head.weight.dtype).itemsize
    return vocab * element * copies


def _losses_and_logit_gradient_(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor) -> None:
    """A chunk's float32 logits become, in place, ``softmax - one_hot(targets)``; their losses go to ``losses``."""
    # vanilla's cross_entropy is this log_softmax and a gather; the kernel reads a row before it
    # writes it, so it runs in place
    torch.log_softmax(logits, 1, out=logits)
    rows = torch.arange(targets.shape[0], device=logits.device)
    torch.neg(logits[rows, targets], out=losses)
    logits.exp_()
    logits[rows, targets] -= 1


def _check_targets(kept: torch.Tensor, rows: torch.Tensor, vocab: int, ignore_index: int) -> None:
    if kept.numel() == 0:
        return
    # a negative label would index the logits from the end, silently: vanilla's nll_loss raises
    outside = (kept < 0) | (kept >= vocab)
    if bool(outside.any()):
        first = int(outside.nonzero()[0, 0])
        raise IndexError(
            f"label {int(kept[first])} (token {int(rows[first])} of the flattened, shifted labels) is outside "
            f"the vocabulary (0 to {vocab - 1}) and is not the ignore_index ({ignore_index}); vanilla's loss "
            "raises on it too: fix the labels, or pass the ignore_index they use"
        )


class WholeRows:
    """How a chunk's float32 logits become its losses and, in place, their gradient when the head's rows
    are the whole vocabulary (one process); ``vocab_parallel.SplitRows`` when they are a rank's share.
    ``_ChunkedLoss`` calls ``agree``, then ``targets``, then ``losses_`` per chunk, then ``hidden_``."""

    def agree(self, rows: int, chunk: int, device: torch.device) -> tuple[int, int]:
        """The whole vocabulary (for the labels' check) and the chunk to loop with."""
        return rows, chunk

    def targets(self, kept: torch.Tensor) -> None:
        """The counted tokens' labels, before the chunks."""
        self.kept = kept

    def losses_(self, logits: torch.Tensor, part: slice, losses: torch.Tensor) -> None:
        """``logits`` (the chunk ``part`` of the counted tokens) become ``softmax - one_hot``; the losses go to
        ``losses``."""
        _losses_and_logit_gradient_(logits, self.kept[part], losses)

    def hidden_(self, grad: torch.Tensor) -> None:
        """The hidden states' gradient of the counted tokens, complete here."""


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
        plan: tuple[int, WholeRows],
    ) -> torch.Tensor:
        chunk, over = plan
        want_hidden = hidden.requires_grad
        want_weight = weight.requires_grad
        want_bias = bias is not None and bias.requires_grad
        local_vocab = weight.shape[0]
        vocab, chunk = over.agree(local_vocab, chunk, hidden.device)
        # only the counted tokens are computed: an ignored token adds nothing to the loss or a gradient
        rows = (targets != ignore_index).nonzero().squeeze(1)
        every = rows.shape[0] == targets.shape[0]
        kept = targets if every else targets.index_select(0, rows)
        _check_targets(kept, rows, vocab, ignore_index)
        over.targets(kept)
        h_kept = hidden.detach() if every else hidden.detach().index_select(0, rows)
        grad_kept = torch.empty_like(h_kept) if want_hidden else None
        # fp32 accumulators: vanilla rounds the weight's gradient once, after one matmul over
        # every token; summing chunks in the parameter's dtype would round once per chunk.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None  # type: ignore[union-attr]
        losses = torch.empty(rows.shape[0], dtype=torch.float32, device=hidden.device)
        # vanilla's gradient of the loss with respect to a counted token's float32 logits is
        # (softmax - one_hot) / divisor (the mean's count, or num_items_in_batch)
        inverse = torch.reciprocal(divisor.to(device=hidden.device, dtype=torch.float32))
        w = weight.detach()
        b = None if bias is None else bias.detach()
        if _hand_written(hidden, weight, bias, transform):
            buffer = torch.empty((min(chunk, rows.shape[0]), local_vocab), dtype=torch.float32, device=hidden.device)
            for part, h in chunks(h_kept, chunk):
                logits = buffer[: h.shape[0]]
                if b is None:
                    torch.mm(h, w.t(), out=logits)
                else:
                    torch.addmm(b, h, w.t(), out=logits)
                if transform.scale is not None:
                    logits.mul_(transform.scale)
                over.losses_(logits, part, losses[part])
                # the buffer holds softmax - one_hot: the head's backward matmuls, unscaled (below)
                if grad_kept is not None:
                    torch.mm(logits, w, out=grad_kept[part])
                if grad_weight is not None:
                    grad_weight.addmm_(logits.t(), h)
                if grad_bias is not None:
                    grad_bias += logits.sum(0)
            del buffer
            # scaled once, after the matmuls, instead of every logit's gradient before them: the
            # same products rounded in another order (an ulp of float32)
            factor = inverse if transform.scale is None else inverse * transform.scale
            if rows.shape[0]:
                for grad in (grad_kept, grad_weight, grad_bias):
                    if grad is not None:
                        grad.mul_(factor)
        else:
            w.requires_grad_(want_weight)
            if b is not None:
                b.requires_grad_(want_bias)
            for part, h in chunks(h_kept, chunk, grad=want_hidden):
                with torch.enable_grad():
                    out = transform(nn.functional.linear(h, w, b))
                # vanilla upcasts after the family's transform (ForCausalLMLoss's logits.float());
                # in float32 this is ``out``'s own buffer, which no backward reads
                logits = out.detach().float()
                over.losses_(logits, part, losses[part])
                # scaled before the cast to the model's dtype, as vanilla's gradient is
                logits.mul_(inverse)
                inputs = [x for x in (h, w, b) if x is not None and x.requires_grad]
                grads = list(torch.autograd.grad(out, inputs, logits.to(out.dtype))) if inputs else []
                del out, logits
                if grad_kept is not None:
                    grad_kept[part] = grads.pop(0)
                if grad_weight is not None:
                    grad_weight += grads.pop(0)
                if grad_bias is not None:
                    grad_bias += grads.pop(0)
        if grad_kept is not None and rows.shape[0]:
            over.hidden_(grad_kept)
        grad_hidden = grad_kept
        if grad_kept is not None and not every:
            grad_hidden = torch.zeros_like(hidden).index_copy_(0, rows, grad_kept)
        total = losses.sum() / divisor
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
    over: WholeRows | None = None,
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
        over: what the head's rows are (``vocab_parallel.SplitRows``: a rank's share of the
            vocabulary); ``None``: the whole vocabulary.

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
    plan = (chunk, WholeRows() if over is None else over)
    result: torch.Tensor = _ChunkedLoss.apply(
        flat, head.weight, head.bias, targets, divisor, transform, ignore_index, plan
    )
    return result
