"""Per-token log-probabilities of the next tokens without the tokens x vocabulary logits (for GRPO, DPO, PPO).

Trainers that score sequences (TRL's GRPO and DPO) need ``log_softmax(logits / T)`` at each label,
not a mean cross-entropy: ``token_log_probs`` computes it chunk of tokens by chunk of tokens from the
decoder's last hidden state and the head the install found, with the transform the probe read.  The
forward keeps no logits; the backward recomputes each chunk's (the gradient it receives differs per
token, so it cannot be computed ahead as the loss's is).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .chunks import chunks
from .forward import active_head, installed_forward
from .loss import HeadTransform, WholeRows
from .placement import at_step

__all__ = ["token_log_probs"]


def _chunk_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: HeadTransform,
    temperature: float,
) -> torch.Tensor:
    # vanilla's: the family's transform, .float() (as ForCausalLMLoss), the trainer's temperature
    logits = transform(nn.functional.linear(hidden, weight, bias)).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        transform: HeadTransform,
        temperature: float,
        chunk: int,
    ) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for part, h in chunks(hidden, chunk):
            out[part] = _chunk_log_probs(h, weight, bias, targets[part], transform, temperature)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets)
        ctx.has_bias = bias is not None
        ctx.settings = (transform, temperature, chunk)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        transform, temperature, chunk = ctx.settings
        want = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if want[0] else None
        # fp32 accumulators: vanilla rounds the weight's gradient once, after one matmul over every token
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want[2] else None  # type: ignore[union-attr]
        w = weight.detach().requires_grad_(want[1])
        b = None if bias is None else bias.detach().requires_grad_(want[2])
        for part, h in chunks(hidden, chunk, grad=want[0]):
            inputs = [x for x in (h, w, b) if x is not None and x.requires_grad]
            if not inputs:
                break
            with torch.enable_grad():
                values = _chunk_log_probs(h, w, b, targets[part], transform, temperature)
                grads = list(torch.autograd.grad(values, inputs, grad_output[part]))
            if grad_hidden is not None:
                grad_hidden[part] = grads.pop(0)
            if grad_weight is not None:
                grad_weight += grads.pop(0)
            if grad_bias is not None:
                grad_bias += grads.pop(0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),  # type: ignore[union-attr]
            None,
            None,
            None,
            None,
        )


def token_log_probs(
    model: nn.Module, input_ids: torch.Tensor, *, temperature: float = 1.0, **inputs: Any
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at each next token, ``(batch, sequence - 1)``, float32.

    Called by a trainer that scores sequences (GRPO's and DPO's per-token log-probabilities), on a
    model with the chunked loss installed, in any mode: equal to vanilla's
    ``log_softmax(model(input_ids).logits[:, :-1].float() / temperature)`` gathered at
    ``input_ids[:, 1:]`` within rounding, differentiable with respect to the model's parameters, and
    computed without the tokens x vocabulary logits (chunks sized by the install's budget).
    Masking padding or prompt tokens is the caller's.

    Args:
        model: a model ``install`` returned for.
        input_ids: ``(batch, sequence)`` token ids.
        temperature: the logits are divided by it (after the family's transform), as TRL's trainers do.
        **inputs: passed to the model's forward (``attention_mask``, ``position_ids`` ...).

    Returns:
        The log-probabilities, ``(batch, sequence - 1)``.

    Raises:
        ValueError: the model has no chunked loss installed, its head is not one the chunked loss
            reads (a LoRA on the head, a sharded head), or ``temperature`` is not positive.
    """
    forward = installed_forward(model)
    if forward is None:
        raise ValueError(
            f"{type(model).__name__} has no chunked loss installed: call hfpatch_pack_chunked_loss.install(model) "
            "(or load it with HF_PATCH_PACKS=chunked-loss) first"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    head = active_head(model.get_output_embeddings(), forward.linear_subclass)  # type: ignore[operator]
    rows = None if head is None else at_step(model, head)
    if head is None or rows is None:
        raise ValueError(
            f"{type(model).__name__}'s head is a {type(model.get_output_embeddings()).__name__}, "  # type: ignore[operator]
            "not a plain nn.Linear the chunked loss reads; compute the log-probabilities from the logits"
        )
    read = forward.read_hidden(
        head, lambda keep: model(input_ids=input_ids, logits_to_keep=keep, use_cache=False, **inputs)
    )
    if read is None:
        raise ValueError(f"{type(model).__name__}'s forward did not run the module the chunked loss reads")
    hidden = read[:, :-1]
    targets = input_ids[:, 1:].reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    with rows.reading(head) as (rows_read, over):  # a ZeRO-3 head gathered for the whole computation
        if type(over) is not WholeRows:
            raise ValueError(
                f"{type(model).__name__}'s head has its rows split over the ranks ({rows.name}): the log-probabilities "
                "are computed over the whole vocabulary; compute them from the logits"
            )
        chunk = forward.installed.chunk_of(int(rows_read.weight.shape[0]))
        values: torch.Tensor = _ChunkedLogProbs.apply(
            flat, rows_read.weight, rows_read.bias, targets, forward.installed.transform, float(temperature), chunk
        )
    return values.reshape(hidden.shape[:-1])
