"""Finding a causal LM's head and loss path by probing it, and installing the chunked loss on it."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss

from .loss import HeadTransform, chunked_causal_lm_loss

__all__ = ["DEFAULT_CHUNK", "ChunkedLossRefused", "Installed", "detect", "install", "installed", "uninstall"]

#: Tokens per chunk: 1024 tokens x a 152k vocabulary in float32 is 0.6 GB, against the whole
#: sequence's several GB; smaller chunks cost more Python and smaller matmuls.
DEFAULT_CHUNK = 1024

# A probe's head output: values over the range logits take, a 1.0 (reads a scale) and a
# value so large that tanh saturates (reads a soft-cap).
_PROBE_TOKENS = 4
_SATURATING = 1.0e6


class ChunkedLossRefused(ValueError):
    """The model's head or loss path is not one the chunked loss reproduces exactly; the message says why."""


@dataclasses.dataclass(frozen=True)
class Installed:
    """What ``install`` found and put on a model.

    Attributes:
        transform: what the family's forward does between the head and the loss.
        chunk: tokens per chunk.
    """

    transform: HeadTransform
    chunk: int


_INSTALLED: weakref.WeakKeyDictionary[nn.Module, tuple[Installed, Any]] = weakref.WeakKeyDictionary()


def _decoder(model: PreTrainedModel) -> nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        raise ChunkedLossRefused(f"{type(model).__name__} has no decoder module (get_decoder()) to read hidden states")
    return decoder


def _last_hidden(output: Any) -> torch.Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None and isinstance(output, tuple):
        hidden = output[0]
    if not isinstance(hidden, torch.Tensor):
        raise ChunkedLossRefused("the decoder's output has no last_hidden_state")
    return hidden


def _with_hidden(output: Any, hidden: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    output.last_hidden_state = hidden
    return output


def _sharded(head: nn.Linear) -> bool:
    # a head sharded after install (fully_shard, a tp_plan) is seen at each step: vanilla's step runs
    return any(type(p).__name__ == "DTensor" for p in (head.weight, head.bias) if p is not None)


def _fit_transform(probe: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> HeadTransform:
    """The transform that makes ``out`` from ``probe`` exactly, among scale and soft-cap."""
    flat_probe, flat_out = probe.reshape(-1), out.reshape(-1)
    one = float(flat_out[1]) / float(flat_probe[1])
    saturated = float(flat_out[0])
    candidates = [HeadTransform()]
    if one != 0.0:
        candidates.append(HeadTransform(scale=one))
    if saturated != 0.0:
        candidates.append(HeadTransform(softcap=saturated))
    # the right transform misses by the rounding of its two or three operations in the model's dtype
    # (a few eps); one with other operations (a bias, a clamp, a per-column scale) misses by far more
    tolerance = 4 * torch.finfo(dtype).eps
    for candidate in candidates:
        if torch.allclose(candidate(probe), out, rtol=tolerance, atol=tolerance):
            return candidate
    raise ChunkedLossRefused(
        "the forward transforms the head's output in a way that is neither the identity, a scale nor a "
        "soft-cap (probed with chosen head outputs)"
    )


def _probe_inputs(model: PreTrainedModel) -> torch.Tensor:
    vocab = int(model.get_output_embeddings().weight.shape[0])
    device = model.get_output_embeddings().weight.device
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (1, _PROBE_TOKENS), generator=generator).to(device)


def detect(model: PreTrainedModel) -> HeadTransform:
    """Find the model's head and loss path by structure and probing; refuse when it is not exact.

    Called by ``install`` (and by tests and ``bench/chunked_loss.py``).  Runs the model's forward
    twice on 4 tokens: once with the head's output replaced by chosen values (reads what the forward
    does between the head and the loss), once with labels, comparing vanilla's own loss and
    gradients with the chunked loss's.

    Args:
        model: a loaded ``*ForCausalLM`` (any dtype and device).

    Returns:
        The transform between the head and the loss.

    Raises:
        ChunkedLossRefused: with the reason (the head is not a plain ``nn.Linear``; the forward has no
            ``labels`` or ``logits_to_keep``; the loss is not transformers' ``ForCausalLMLoss``;
            something runs between the decoder and the head; the transform is neither a scale nor a
            soft-cap; or the chunked loss differs from vanilla's on the probe).
    """
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ChunkedLossRefused(f"the LM head is a {type(head).__name__}, not a plain nn.Linear")
    if _sharded(head):
        raise ChunkedLossRefused(
            "the LM head's weight is a DTensor (FSDP2 or tensor parallelism): the chunked loss is not "
            "tested on sharded heads"
        )
    parameters = inspect.signature(model.forward).parameters
    missing = [name for name in ("labels", "logits_to_keep") if name not in parameters]
    if missing:
        raise ChunkedLossRefused(f"{type(model).__name__}.forward takes no {' or '.join(missing)}")
    if model.loss_function is not ForCausalLMLoss:
        raise ChunkedLossRefused(
            f"the loss is {getattr(model.loss_function, '__name__', model.loss_function)!r}, not ForCausalLMLoss"
        )
    decoder = _decoder(model)
    input_ids = _probe_inputs(model)
    seen: dict[str, Any] = {}

    def decoder_hook(module: nn.Module, args: Any, output: Any) -> Any:
        seen["decoder"] = _last_hidden(output)
        if "replace" in seen:
            return _with_hidden(output, seen["replace"])
        return None

    def head_pre_hook(module: nn.Module, args: Any) -> None:
        seen["head_in"] = args[0]

    def head_hook(module: nn.Module, args: Any, output: torch.Tensor) -> Any:
        return seen.get("head_out")

    was_training = model.training
    handles = [
        decoder.register_forward_hook(decoder_hook),
        head.register_forward_pre_hook(head_pre_hook),
        head.register_forward_hook(head_hook),
    ]
    try:
        model.eval()
        with torch.no_grad():
            vocab = head.weight.shape[0]
            probe = torch.linspace(-60.0, 60.0, _PROBE_TOKENS * vocab).reshape(1, _PROBE_TOKENS, vocab)
            probe[0, 0, 0], probe[0, 0, 1] = _SATURATING, 1.0
            seen["head_out"] = probe.to(head.weight.device, head.weight.dtype)
            out = model(input_ids=input_ids, use_cache=False)
            if not torch.equal(seen["head_in"], seen["decoder"]):
                raise ChunkedLossRefused("the head's input is not the decoder's last hidden state")
            if not isinstance(getattr(out, "logits", None), torch.Tensor):
                raise ChunkedLossRefused("the forward returns no logits")
            # what the head "returned", in the head's dtype, is what the forward transformed
            transform = _fit_transform(seen["head_out"].float().cpu(), out.logits.float().cpu(), head.weight.dtype)
            del seen["head_out"]
        _compare_with_vanilla(model, decoder, head, input_ids, transform, seen)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return transform


def _compare_with_vanilla(
    model: PreTrainedModel,
    decoder: nn.Module,
    head: nn.Linear,
    input_ids: torch.Tensor,
    transform: HeadTransform,
    seen: dict[str, Any],
) -> None:
    with torch.no_grad():
        decoder(input_ids=input_ids)
    hidden = seen.pop("decoder").detach().clone().requires_grad_(True)
    seen["replace"] = hidden
    labels = input_ids.clone()
    labels[0, 1] = -100
    loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
    del seen["replace"]
    wanted = [hidden, head.weight] if head.weight.requires_grad else [hidden]
    vanilla = torch.autograd.grad(loss, wanted)
    # chunk 1: every chunk boundary the probe has, so a wrong accumulation shows
    ours_loss = chunked_causal_lm_loss(hidden, head, labels, transform, chunk=1)
    ours = torch.autograd.grad(ours_loss, wanted)
    # fp32: a reordered sum over 4 tokens is within a few ulps (1e-7 relative); bf16 logits are
    # the same numbers in both (one token at a time is one row of the same matmul), so the bound
    # is a few steps of the hidden states' dtype
    bound = 1e-5 if hidden.dtype == torch.float32 else 8 * torch.finfo(hidden.dtype).eps
    pairs = [("loss", loss.detach(), ours_loss.detach())]
    names = ("hidden-state gradient", "head gradient")
    pairs += [(name, a, b) for name, a, b in zip(names, vanilla, ours, strict=False)]
    for name, a, b in pairs:
        scale = float(a.detach().float().abs().max()) or 1.0
        if float((a.float() - b.float()).abs().max()) > bound * scale:
            raise ChunkedLossRefused(f"the chunked loss's {name} differs from vanilla's on a probe")


def install(model: PreTrainedModel, *, chunk: int = DEFAULT_CHUNK) -> Installed:
    """Make the model's training steps compute the loss in chunks of tokens.

    Called once per model, after it is loaded (and before ``peft.get_peft_model`` or a Trainer
    wraps it, or after: both call the model's own forward).  Afterwards a forward with ``labels``,
    in training mode and with autograd on, returns vanilla's loss (within rounding) computed without
    the tokens x vocabulary logits, and ``.logits`` holds the logits of the last position only
    (``(batch, 1, vocabulary)``, as ``logits_to_keep=1`` gives).  Every other forward (no labels,
    ``eval()``, ``no_grad``, generation, a ``logits_to_keep`` of the caller's) is vanilla's.

    Args:
        model: a loaded ``*ForCausalLM``.
        chunk: tokens per chunk.

    Returns:
        What was found and installed.

    Raises:
        ChunkedLossRefused: the model's head or loss path is not one this reproduces (``detect``).
        ValueError: ``chunk`` is not positive, or the model already has it.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be positive, not {chunk}")
    if model in _INSTALLED:
        raise ValueError(f"{type(model).__name__} already has the chunked loss")
    transform = detect(model)
    decoder = _decoder(model)
    head = model.get_output_embeddings()
    original: Callable[..., Any] = model.forward
    signature = inspect.signature(original)
    captured: list[torch.Tensor] = []

    def decoder_hook(module: nn.Module, args: Any, output: Any) -> None:
        if captured == [] and state.active:
            captured.append(_last_hidden(output))

    class _State:
        active = False

    state = _State()
    handle = decoder.register_forward_hook(decoder_hook)

    # wraps: Trainer reads the forward's signature (the dataset columns it keeps, loss kwargs)
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        labels = arguments.get("labels")
        extra = dict(arguments.pop("kwargs", {}) or {})
        current = model.get_output_embeddings()
        if (
            labels is None
            or not model.training
            or not torch.is_grad_enabled()
            or current is not head
            or type(current) is not nn.Linear
            or _sharded(current)
            or arguments.get("logits_to_keep", 0) != 0
        ):
            return original(*args, **kwargs)
        arguments.update(labels=None, logits_to_keep=1)
        captured.clear()
        state.active = True
        try:
            out = original(**arguments, **extra)
        finally:
            state.active = False
        hidden = captured.pop()
        loss = chunked_causal_lm_loss(
            hidden,
            head,
            labels,
            transform,
            chunk=chunk,
            num_items_in_batch=extra.get("num_items_in_batch"),
            ignore_index=extra.get("ignore_index", -100),
            shift_labels=extra.get("shift_labels"),
        )
        if isinstance(out, tuple):
            return (loss, *out)
        out.loss = loss
        return out

    model.forward = forward
    result = Installed(transform, chunk)
    _INSTALLED[model] = (result, (original, handle))
    return result


def installed(model: nn.Module) -> Installed | None:
    """What ``install`` put on ``model``, or ``None``.  Called by anyone who wants to know."""
    entry = _INSTALLED.get(model)
    return None if entry is None else entry[0]


def uninstall(model: nn.Module) -> None:
    """Give the model vanilla's forward back.  Called after ``install``; does nothing otherwise."""
    entry = _INSTALLED.pop(model, None)
    if entry is None:
        return
    _, (_original, handle) = entry
    handle.remove()
    del model.forward
