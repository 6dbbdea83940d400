"""Finding a causal LM's head and loss path by structure and by probing its own forward (``detect``).

The probe runs the model's forward on 4 tokens with the head's output replaced by chosen values: it reads
which sub-module's output the head reads (or the head's own input), and what the forward does between the
head and the loss (``loss.HeadTransform``); then ``compare.py`` compares the chunked loss with vanilla's.
Where the head's rows live (``rows.HeadRows``, decided by ``placement.locate``) says how the forward runs
for the probe (ZeRO-3 gathers), whether the loss can read the head when the decoder has returned, and
which comparison applies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .compare import compare_with_vanilla
from .errors import ChunkedLossRefused
from .found import LossKind
from .loss import HeadTransform
from .outputs import last_hidden, signature
from .placement import locate
from .rows import HeadRows, plain_linear

__all__ = ["Found", "detect", "find"]

# A probe's head output: values over the range logits take, a 1.0 (reads a scale) and a
# value so large that tanh saturates (reads a soft-cap).
_PROBE_TOKENS = 4
_SATURATING = 1.0e6


def _decoder_candidates(model: nn.Module, head: nn.Module) -> list[nn.Module]:
    """Modules whose output may be the hidden states the head reads: ``get_decoder()`` first, then the
    model's other sub-modules, outermost first (llama4's ``Llama4ForCausalLM`` names its decoder
    ``model`` while its ``base_model_prefix`` says ``language_model``, so ``get_decoder()`` is the model)."""
    found: list[nn.Module] = []
    get_decoder: Any = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if isinstance(decoder, nn.Module) and decoder is not model:
        found.append(decoder)
    for _, module in model.named_modules():
        if module is not model and module is not head and all(module is not seen for seen in found):
            found.append(module)
    return found


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
        composed = _prescaled_softcap(probe, out, saturated, float(flat_out[1]))
        if composed is not None:
            candidates.append(composed)
    # the right transform misses by the rounding of its two or three operations in the model's dtype
    # (a few eps); one with other operations (a bias, a clamp, a per-column scale) misses by far more
    tolerance = 4 * torch.finfo(dtype).eps
    for candidate in candidates:
        if torch.allclose(candidate(probe), out, rtol=tolerance, atol=tolerance):
            return candidate
    raise ChunkedLossRefused(
        "the forward transforms the head's output in a way that is neither the identity, a scale, a "
        "soft-cap nor a scale then a soft-cap (probed with chosen head outputs)"
    )


def _prescaled_softcap(probe: torch.Tensor, out: torch.Tensor, cap: float, at_one: float) -> HeadTransform | None:
    """A scale then a soft-cap (``cap * tanh(x * prescale / cap)``): the saturated probe read the cap,
    the probe's 1.0 reads the prescale through ``atanh``; of the float32 numbers around that estimate
    (a forward's Python float multiplies a tensor as a float32), the one nearest the forward's output."""
    if not abs(at_one) < abs(cap):
        return None
    estimate = torch.tensor(cap * math.atanh(at_one / cap), dtype=torch.float32)
    found = [estimate]
    for direction in (math.inf, -math.inf):
        value = estimate
        for _ in range(4):
            value = torch.nextafter(value, torch.tensor(direction, dtype=torch.float32))
            found.append(value)

    def miss(prescale: torch.Tensor) -> float:
        return float((HeadTransform(softcap=cap, prescale=float(prescale))(probe) - out).abs().max())

    return HeadTransform(softcap=cap, prescale=float(min(found, key=miss)))


def _probe_inputs(head: nn.Linear) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, int(head.weight.shape[0]), (1, _PROBE_TOKENS), generator=generator).to(head.weight.device)


def detect(model: PreTrainedModel) -> HeadTransform:
    """Find the model's head and loss path by structure and probing; refuse when it is not exact.

    Called by tests and ``bench/chunked_loss.py`` (``install`` calls ``find``, which probes).

    Args:
        model: a loaded ``*ForCausalLM`` (any dtype and device).

    Returns:
        The transform between the head and the loss.

    Raises:
        ChunkedLossRefused: with the reason (the head is not an ``nn.Linear`` computing nn.Linear's
            forward, or is sharded; the forward has no ``labels`` or ``logits_to_keep``; the head's
            input is neither a sub-module's output nor one row per token; the transform is none of
            the identity, a scale, a soft-cap, a scale then a soft-cap; the loss is no token-wise
            cross-entropy (``LossKind``); the hidden states change with the labels; the forward
            swaps its own modules; an auxiliary loss is added with a coefficient the pack cannot
            read; or the chunked loss differs from vanilla's on the probe).
    """
    rows = locate(model, model.get_output_embeddings())
    with rows.probing(model, model.get_output_embeddings()):
        return find(model, rows).transform


@dataclasses.dataclass
class Found:
    """What the probe found: the transform, where the hidden states are read, the loss and its auxiliary loss."""

    transform: HeadTransform
    decoder: nn.Module
    aux_loss_coefficient: str | None
    loss: LossKind = dataclasses.field(default_factory=LossKind)
    # the hidden states are the head's input (read by a pre-hook on the head), not ``decoder``'s output
    at_head: bool = False
    # a subclass of nn.Linear whose forward is nn.Linear's in this dtype (``_linear_head``), or None
    linear_subclass: tuple[type, torch.dtype] | None = None


def _linear_head(head: Any) -> tuple[type, torch.dtype] | None:
    """``None`` for a plain ``nn.Linear`` head; for a subclass of it whose forward computes what
    ``nn.Linear``'s does, bit for bit, in the head's dtype (an upcast to float32 that is no cast in
    float32, say), its class and that dtype; otherwise refused with what the subclass adds."""
    if plain_linear(head):
        return None
    name = type(head).__name__
    if not isinstance(head, nn.Linear):
        raise ChunkedLossRefused(f"the LM head is a {name}, not a plain nn.Linear")
    extra = [n for n, _ in head.named_parameters() if n not in ("weight", "bias")]
    if extra:
        raise ChunkedLossRefused(
            f"the LM head is a {name}, an nn.Linear with parameters of its own ({', '.join(extra)}) that its forward "
            "applies to the logits: the chunked loss computes a plain linear head"
        )
    weight = head.weight
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn((1, 2, weight.shape[1]), generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        theirs = head(probe)
        plain = nn.functional.linear(probe, weight, head.bias)
    if theirs.dtype != plain.dtype or theirs.shape != plain.shape or not torch.equal(theirs, plain):
        raise ChunkedLossRefused(
            f"the LM head is a {name}, an nn.Linear subclass whose forward does not compute nn.Linear's in "
            f"{weight.dtype} (its output differs on a probe: {theirs.dtype} {tuple(theirs.shape)})"
        )
    return type(head), weight.dtype


def find(model: PreTrainedModel, rows: HeadRows) -> Found:
    """Probe the model whose head's rows live as ``rows`` says (``placement.locate``), inside
    ``rows.probing``; refuse when the chunked loss is not exact there.  Called by ``install`` and ``detect``.

    Runs the model's forward twice on 4 tokens: once with the head's output replaced by chosen values
    (reads what the forward does between the head and the loss, and which sub-module's output the head
    reads), once with labels, comparing vanilla's own loss and gradients with the chunked loss's
    (``compare.compare_with_vanilla``).

    Raises:
        ChunkedLossRefused: as ``detect`` says.
    """
    head = model.get_output_embeddings()
    linear_subclass = _linear_head(head)
    if rows.refusal is not None:
        raise ChunkedLossRefused(rows.refusal)
    classes = {name: type(module) for name, module in model.named_modules()}
    found = _probe(model, head, rows)
    found.linear_subclass = linear_subclass
    # a forward that swaps its own modules on a short input (an attention that falls back to another
    # class) changed the model the user loaded before any step of theirs: refused, with what changed
    now = {name: type(module) for name, module in model.named_modules()}
    changed = sorted(name for name in {*classes, *now} if classes.get(name) is not now.get(name))
    if changed:
        name = changed[0]
        before, after = classes.get(name), now.get(name)
        raise ChunkedLossRefused(
            f"the model's forward replaced its own modules on the probe's {_PROBE_TOKENS} tokens ({len(changed)} of "
            f"them; {name or 'the model'}: {getattr(before, '__name__', None)} became "
            f"{getattr(after, '__name__', None)}): "
            "the chunked loss cannot probe it without changing it"
        )
    return found


def _probe(model: PreTrainedModel, head: nn.Linear, rows: HeadRows) -> Found:
    candidates = _decoder_candidates(model, head)
    input_ids = _probe_inputs(head)
    parameters = signature(model).parameters
    missing = [name for name in ("labels", "logits_to_keep") if name not in parameters]
    if missing:
        raise ChunkedLossRefused(f"{type(model).__name__}.forward takes no {' or '.join(missing)}")
    outputs: dict[int, torch.Tensor] = {}
    seen: dict[str, Any] = {}

    # whether the loss can read the head when each candidate has run: where the chunked loss reads it
    readable: dict[int, bool] = {}

    def candidate_hook(module: nn.Module, args: Any, output: Any) -> None:
        hidden = last_hidden(output)
        if hidden is not None and id(module) not in outputs:
            outputs[id(module)] = hidden
            readable[id(module)] = rows.readable(head)

    def head_pre_hook(module: nn.Module, args: Any) -> None:
        seen["head_in"] = args[0]
        readable[id(module)] = rows.readable(head)

    def head_hook(module: nn.Module, args: Any, output: torch.Tensor) -> Any:
        return seen.get("head_out")

    was_training = model.training
    handles = [module.register_forward_hook(candidate_hook) for module in candidates]
    handles += [head.register_forward_pre_hook(head_pre_hook), head.register_forward_hook(head_hook)]
    try:
        model.eval()
        with torch.no_grad():
            vocab = head.weight.shape[0]
            probe = torch.linspace(-60.0, 60.0, _PROBE_TOKENS * vocab).reshape(1, _PROBE_TOKENS, vocab)
            probe[0, 0, 0], probe[0, 0, 1] = _SATURATING, 1.0
            seen["head_out"] = probe.to(head.weight.device, head.weight.dtype)
            try:
                out = model(input_ids=input_ids, use_cache=False)
            except Exception as exc:
                if rows.sharded is None:
                    raise
                # a DTensor no FSDP2 or tensor-parallel hook handles (set by hand): vanilla's forward fails too
                raise ChunkedLossRefused(
                    f"{rows.sharded}, and the model's forward fails on it ({type(exc).__name__}: {str(exc)[:200]})"
                ) from exc
        for handle in handles[: len(candidates)]:
            handle.remove()
        decoder = next((m for m in candidates if _same(outputs.get(id(m)), seen.get("head_in"))), None)
        at_head = decoder is None
        if decoder is None:
            # no sub-module returns what the head reads (an MLM head's transform returns a bare tensor, a
            # forward divides the hidden states before the head): the step reads the head's own input,
            # every position of it, and lets the head compute the last position's logits only
            decoder = head
            _check_head_input(seen.get("head_in"), input_ids)
        if not isinstance(getattr(out, "logits", None), torch.Tensor):
            raise ChunkedLossRefused("the forward returns no logits")
        if not readable[id(decoder)]:
            raise ChunkedLossRefused(rows.unreadable(str(rows.sharded)))
        if out.logits.shape != seen["head_out"].shape:
            raise ChunkedLossRefused(
                f"the forward's logits {tuple(out.logits.shape)} are not the head's output {tuple(probe.shape)} "
                "transformed element by element (the forward slices or reshapes them)"
            )
        # what the head "returned", in the head's dtype, is what the forward transformed
        transform = _fit_transform(seen["head_out"].float().cpu(), out.logits.float().cpu(), head.weight.dtype)
        del seen["head_out"]
        coefficient, loss = compare_with_vanilla(model, decoder, head, input_ids, transform, rows, at_head=at_head)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return Found(transform, decoder, coefficient, loss, at_head)


def _check_head_input(head_in: Any, input_ids: torch.Tensor) -> None:
    # the step keeps the head's input at every position and gives the head the last one: that needs
    # one row per token, as the labels have
    if not isinstance(head_in, torch.Tensor) or tuple(head_in.shape[:-1]) != tuple(input_ids.shape):
        shape = tuple(head_in.shape) if isinstance(head_in, torch.Tensor) else type(head_in).__name__
        raise ChunkedLossRefused(
            f"the head's input {shape} is not one row per token of the input {tuple(input_ids.shape)}, and no "
            "sub-module's output is it: the chunked loss cannot read the hidden states"
        )


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)
