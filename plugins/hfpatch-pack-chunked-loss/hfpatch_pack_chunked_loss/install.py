"""Finding a causal LM's head and loss path by probing it, and installing the chunked loss on it."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import operator
import os
import re
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss

from . import vocab_parallel, zero3
from .loss import HeadTransform, chunked_causal_lm_loss, logit_bytes_per_token
from .sharded import is_dtensor, plain_linear, sharded_after_decoder, tensor_parallel_refusal

__all__ = [
    "BUDGET_ENV",
    "DEFAULT_BUDGET",
    "LOGIT_COPIES",
    "ChunkedLossRefused",
    "Installed",
    "LossKind",
    "budget_from_env",
    "chunk_for",
    "detect",
    "install",
    "installed",
    "loss_computed_by",
    "uninstall",
]

#: The environment variable that sets the byte budget of a step's logits (``install``'s default):
#: ``HF_PATCH_PACKS=chunked-loss HF_PATCH_CHUNKED_LOSS_BUDGET=512MiB``.  Read at each install.
BUDGET_ENV = "HF_PATCH_CHUNKED_LOSS_BUDGET"

#: The default budget: 256 MiB of chunk x vocabulary tensors, 110 tokens per chunk at a 151,936
#: vocabulary, 524 at 32,000 (``chunk_for``).
DEFAULT_BUDGET = 256 * 2**20

#: How many chunk x vocabulary tensors one chunk's loss holds at once, at most, where autograd computes it
#: (a soft-cap, bfloat16, autocast; float32 otherwise holds one buffer: ``loss.logit_bytes_per_token``): the
#: logits (their transform's output and the float32 copy replace them), ``log_softmax``'s output
#: saved for the backward, and in the backward the gradient it receives and the one it makes; a
#: soft-cap's ``tanh`` output, saved for its backward, is the fourth (a scale's product replaces
#: the logits).  ``tests/test_budget.py`` measures a step's logits against the budget.
LOGIT_COPIES = 4

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}
_BYTES = re.compile(r"\s*(?P<number>\d+)\s*(?P<unit>[a-z]*)\s*")

# A probe's head output: values over the range logits take, a 1.0 (reads a scale) and a
# value so large that tanh saturates (reads a soft-cap).
_PROBE_TOKENS = 4
_SATURATING = 1.0e6
# rows of the head cast to float64 at a time by the probe's reference (32 MiB at hidden 512)
_REFERENCE_ELEMENTS = 2**22
# the model's attribute holding the installed forward (``installed``, ``uninstall``)
_STATE = "_hfpatch_chunked_loss"

logger = logging.getLogger("hfpatch")


class ChunkedLossRefused(ValueError):
    """The model's head or loss path is not one the chunked loss reproduces exactly; the message says why."""


def budget_from_env() -> int:
    """The budget ``HF_PATCH_CHUNKED_LOSS_BUDGET`` sets, or ``DEFAULT_BUDGET`` when it is unset or empty.

    Called by ``install`` when given neither ``chunk`` nor ``budget``.

    Raises:
        ValueError: the variable is not a positive number of bytes (``268435456``, ``256MiB``, ``1GiB``).
    """
    raw = os.environ.get(BUDGET_ENV, "")
    if not raw.strip():
        return DEFAULT_BUDGET
    match = _BYTES.fullmatch(raw.lower())
    if match is None or match["unit"] not in _UNITS or int(match["number"]) < 1:
        raise ValueError(
            f"{BUDGET_ENV}={raw!r} is not a positive number of bytes; write it as 268435456, 256MiB or 1GiB "
            "(units B, KiB, MiB, GiB), or unset it for the default (256MiB)"
        )
    return int(match["number"]) * _UNITS[match["unit"]]


def chunk_for(budget: int, vocab: int, held: int = 0, *, per_token: int | None = None) -> int:
    """Tokens per chunk such that a chunk's logits and ``held`` bytes (the last position's logits a
    training step returns) fit ``budget`` bytes.  ``per_token``: what one token of a chunk holds
    (``loss.logit_bytes_per_token`` for the path the loss takes); at most ``LOGIT_COPIES`` float32
    tensors of ``vocab`` entries, the default.

    One token at least: a budget below one token's logits gives chunks of one token.
    """
    return max(1, (budget - held) // (per_token or vocab * 4 * LOGIT_COPIES))


@dataclasses.dataclass(frozen=True)
class LossKind:
    """Which token-wise cross-entropy (``ignore_index=-100``) a family's forward computes from its logits,
    found by probing its loss against each (``_loss_kind``).

    Attributes:
        shift: the logits at position t are compared with the label at t + 1 (``ForCausalLMLoss``);
            ``False``: with the label at t (bart's, xlnet's, xlm's and cpmant's causal-LM heads).
        loss_kwargs: the forward hands its loss keyword arguments to the loss: a sum divided by
            ``num_items_in_batch`` when given, and ``ignore_index`` and ``shift_labels`` are read;
            ``False``: the mean over the counted tokens whatever the call passes.
    """

    shift: bool = True
    loss_kwargs: bool = True


@dataclasses.dataclass(frozen=True)
class Installed:
    """What ``install`` found and put on a model.

    Attributes:
        transform: what the family's forward does between the head and the loss.
        chunk: tokens per chunk when ``install`` was given one; ``None`` when chunks are sized by ``budget``.
        budget: bytes of chunk x vocabulary logits a step holds at most (``chunk_for``); ``None``
            when ``chunk`` is fixed.
        aux_loss_coefficient: where the family's forward reads the coefficient of the auxiliary
            (MoE load-balancing) loss it adds to the loss, as a dotted attribute path from the model
            (``"router_aux_loss_coef"``), read at each step; ``None`` when the forward adds none.
        loss: which cross-entropy the family's forward computes (``LossKind``).
    """

    transform: HeadTransform
    chunk: int | None = None
    budget: int | None = None
    aux_loss_coefficient: str | None = None
    loss: LossKind = LossKind()

    def chunk_of(self, vocab: int, held: int = 0, *, per_token: int | None = None) -> int:
        """Tokens per chunk for a head of ``vocab`` rows, with ``held`` bytes of logits already alive
        and ``per_token`` bytes held by each token of a chunk (``chunk_for``)."""
        if self.chunk is not None:
            return self.chunk
        return chunk_for(self.budget or DEFAULT_BUDGET, vocab, held, per_token=per_token)


def _modules_named(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


def _last_hidden(output: Any) -> torch.Tensor | None:
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None and isinstance(output, tuple) and output:
        hidden = output[0]
    return hidden if isinstance(hidden, torch.Tensor) else None


def _with_hidden(output: Any, hidden: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    output.last_hidden_state = hidden
    return output


def _sharded(head: nn.Linear) -> str | None:
    """Why the head's weight is not a whole local tensor (FSDP2, tensor parallelism, ZeRO-3), or ``None``."""
    for parameter in (head.weight, head.bias):
        if parameter is None:
            continue
        if type(parameter).__name__ == "DTensor":
            return "the LM head's weight is a DTensor (FSDP2 or tensor parallelism)"
        # ZeRO-3 leaves each rank an empty tensor and the shape in ds_shape, outside a gather
        if zero3.is_partitioned(parameter) or parameter.numel() == 0:
            return (
                f"the LM head's weight is partitioned (DeepSpeed ZeRO-3: local shape {tuple(parameter.shape)}, "
                f"whole {tuple(getattr(parameter, 'ds_shape', ()))})"
            )
    return None


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


def _router_arguments(model: nn.Module) -> dict[str, Any]:
    # the probe asks for the auxiliary loss whatever the config says: a step may ask for it at call time
    return {"output_router_logits": True} if "output_router_logits" in _signature(model).parameters else {}


def _signature(model: nn.Module) -> inspect.Signature:
    return inspect.signature(type(model).forward.__get__(model))


def _coefficient_paths(model: nn.Module) -> list[str]:
    """Attributes of the model and of its text config named ``*aux_loss_coef`` (every family reads its
    coefficient from one: ``router_aux_loss_coef``, ``aux_loss_coef``, ``text_config.router_aux_loss_coef``)."""
    paths = [name for name, value in vars(model).items() if name.endswith("aux_loss_coef") and _number(value)]
    config = getattr(model, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        named = (f"config.{name}" for name, value in vars(config).items() if value is text)
        prefix = "config" if text is config else next(named, None)
        if prefix is not None:
            paths += [f"{prefix}.{n}" for n, v in vars(text).items() if n.endswith("aux_loss_coef") and _number(v)]
    return paths


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def detect(model: PreTrainedModel) -> HeadTransform:
    """Find the model's head and loss path by structure and probing; refuse when it is not exact.

    Called by ``install`` (and by tests and ``bench/chunked_loss.py``).  See ``_detect`` for what is
    probed.

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
    return _detect(model).transform


@dataclasses.dataclass
class _Found:
    transform: HeadTransform
    decoder: nn.Module
    aux_loss_coefficient: str | None
    loss: LossKind = LossKind()
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


def _detect(model: PreTrainedModel) -> _Found:
    """Runs the model's forward twice on 4 tokens: once with the head's output replaced by chosen
    values (reads what the forward does between the head and the loss, and which sub-module's output
    the head reads), once with labels, comparing vanilla's own loss and gradients with the chunked
    loss's (``_compare_with_vanilla``)."""
    head = model.get_output_embeddings()
    if zero3.needs_gathering(model) and isinstance(head, nn.Linear):
        # ZeRO-3 before deepspeed.initialize: probed gathered, on every rank
        with zero3.probing(model, head):
            return _detect(model)
    linear_subclass = _linear_head(head)
    sharded = _sharded(head)
    if sharded is not None and not is_dtensor(head.weight):
        raise ChunkedLossRefused(f"{sharded}: the chunked loss over a partitioned head is not written")
    tensor_parallel = tensor_parallel_refusal(model, head, str(sharded))
    if tensor_parallel is not None:
        raise ChunkedLossRefused(tensor_parallel)
    parameters = _signature(model).parameters
    missing = [name for name in ("labels", "logits_to_keep") if name not in parameters]
    if missing:
        raise ChunkedLossRefused(f"{type(model).__name__}.forward takes no {' or '.join(missing)}")
    candidates = _decoder_candidates(model, head)
    classes = {name: type(module) for name, module in model.named_modules()}
    input_ids = _probe_inputs(head)
    outputs: dict[int, torch.Tensor] = {}
    seen: dict[str, Any] = {}

    # whether the head's weight is whole when each candidate has run: where the chunked loss reads it
    whole: dict[int, bool] = {}

    def candidate_hook(module: nn.Module, args: Any, output: Any) -> None:
        hidden = _last_hidden(output)
        if hidden is not None and id(module) not in outputs:
            outputs[id(module)] = hidden
            whole[id(module)] = not is_dtensor(head.weight)

    def head_pre_hook(module: nn.Module, args: Any) -> None:
        seen["head_in"] = args[0]
        whole[id(module)] = not is_dtensor(head.weight)

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
                if sharded is None:
                    raise
                # a DTensor no FSDP2 or tensor-parallel hook handles (set by hand): vanilla's forward fails too
                raise ChunkedLossRefused(
                    f"{sharded}, and the model's forward fails on it ({type(exc).__name__}: {str(exc)[:200]})"
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
        if not whole[id(decoder)] and vocab_parallel.row_split(model, head) is None:
            raise ChunkedLossRefused(sharded_after_decoder(model, head, str(sharded)))
        if out.logits.shape != seen["head_out"].shape:
            raise ChunkedLossRefused(
                f"the forward's logits {tuple(out.logits.shape)} are not the head's output {tuple(probe.shape)} "
                "transformed element by element (the forward slices or reshapes them)"
            )
        # what the head "returned", in the head's dtype, is what the forward transformed
        transform = _fit_transform(seen["head_out"].float().cpu(), out.logits.float().cpu(), head.weight.dtype)
        del seen["head_out"]
        coefficient, loss = _compare_with_vanilla(
            model, decoder, head, input_ids, transform, copy=sharded is not None, at_head=at_head
        )
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    _check_unchanged(model, classes)
    return _Found(transform, decoder, coefficient, loss, at_head, linear_subclass)


def _check_unchanged(model: nn.Module, classes: dict[str, type]) -> None:
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


def _targets(labels: torch.Tensor, loss: LossKind) -> torch.Tensor:
    """The flattened labels each token's logits are compared with, as the loss ``loss`` reads them."""
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:] if loss.shift else labels
    return shifted.reshape(-1)


def _float64_logits(
    hidden: torch.Tensor, head: nn.Linear | _HeadView, transform: HeadTransform
) -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
    """The probe's hidden states, their transformed logits in float64 (the head cast a block of rows
    at a time: the whole of it in float64 would be twice the head's memory), and those blocks."""
    h = hidden.detach().reshape(-1, hidden.shape[-1]).double()
    weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
    rows = max(1, _REFERENCE_ELEMENTS // weight.shape[1])
    blocks = [slice(start, start + rows) for start in range(0, weight.shape[0], rows)]
    logits = torch.cat(
        [nn.functional.linear(h, weight[b].double(), None if bias is None else bias[b].double()) for b in blocks], -1
    )
    return h, logits, blocks


def _reference_loss(
    logits: torch.Tensor, transform: HeadTransform, targets: torch.Tensor, divisor: Any
) -> torch.Tensor:
    # cross_entropy's sum over the counted tokens, divided as the loss divides it (a mean: by their count)
    total = nn.functional.cross_entropy(
        transform(logits), targets.to(logits.device), ignore_index=-100, reduction="sum"
    )
    count = (targets != -100).sum()
    return total / (count if divisor is None else torch.as_tensor(divisor, dtype=total.dtype, device=total.device))


def _reference(
    h: torch.Tensor,
    logits: torch.Tensor,
    blocks: list[slice],
    hidden: torch.Tensor,
    head: nn.Linear | _HeadView,
    targets: torch.Tensor,
    divisor: Any,
    transform: HeadTransform,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[slice], torch.Tensor]]:
    """The probe's loss and gradients in float64 (``_float64_logits``).

    Returns the loss, the hidden states' gradient, that gradient summed token by token in the head's
    dtype from float64's gradient of the logits, and a function giving the head weight's gradient for a
    slice of its rows.
    """
    weight = head.weight.detach()
    logits = logits.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = _reference_loss(logits, transform, targets, divisor)
        (grad_logits,) = torch.autograd.grad(loss, logits)
    grad_hidden = torch.zeros_like(h)
    for b in blocks:
        grad_hidden += grad_logits[:, b] @ weight[b].double()
    # the same gradient summed over the vocabulary one token at a time in the head's dtype: a chunk of
    # one token (the probe's, and a step's last chunk) sums it in another order than vanilla's matmul
    by_token = torch.cat([grad_logits[i : i + 1].to(weight.dtype) @ weight for i in range(h.shape[0])])
    return (
        loss.detach(),
        grad_hidden.reshape(hidden.shape),
        by_token.reshape(hidden.shape),
        lambda b: grad_logits[:, b].T @ h,
    )


# the probe's num_items_in_batch: more than its 4 tokens, so a sum divided by it is no mean
_PROBE_ITEMS = 7


def _accepts(model: nn.Module, name: str) -> bool:
    parameters = _signature(model).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _loss_kind(
    model: nn.Module,
    vanilla: torch.Tensor,
    aux: torch.Tensor | None,
    logits: torch.Tensor,
    labels: torch.Tensor,
    transform: HeadTransform,
    items: bool,
) -> LossKind:
    """Which token-wise cross-entropy vanilla's loss is: the one of ``LossKind``'s four whose float64 value
    (with the auxiliary loss, times any ``*aux_loss_coef``) is nearest vanilla's.  That it is near enough,
    and the gradients, ``_compare_with_vanilla`` checks next."""
    kinds = [LossKind(shift, kwargs) for shift in (True, False) for kwargs in ((True, False) if items else (False,))]
    coefficients = [0.0]
    if aux is not None:
        coefficients += [float(operator.attrgetter(path)(model)) for path in _coefficient_paths(model)]
        aux_value = float(aux.detach())
    value = float(vanilla)

    def distance(kind: LossKind) -> float:
        loss = float(
            _reference_loss(logits, transform, _targets(labels, kind), _PROBE_ITEMS if kind.loss_kwargs else None)
        )
        return min(abs(value - (loss + c * aux_value if aux is not None else loss)) for c in coefficients)

    return min(kinds, key=distance)


def _compare_with_vanilla(
    model: PreTrainedModel,
    decoder: nn.Module,
    head: nn.Linear,
    input_ids: torch.Tensor,
    transform: HeadTransform,
    *,
    copy: bool = False,
    at_head: bool = False,
) -> tuple[str | None, LossKind]:
    """Vanilla's loss and gradients (hidden states, head) on the probe against the chunked loss's, both
    measured against float64: the chunked loss may miss it by at most four times what vanilla misses it by
    (plus eight steps of the dtype), so the bound grows with the vocabulary as vanilla's own error does.
    For the hidden states' gradient, a sum over the vocabulary, the calibration is also that sum taken
    one token at a time (the order of the probe's one-token chunks).  ``at_head``: the hidden states are
    the head's input, not ``decoder``'s output.

    Which cross-entropy vanilla computes (``LossKind``) is read from its loss first: the probe passes
    ``num_items_in_batch`` where the forward takes it, and the labels with one token ignored.

    Returns the path of the auxiliary loss's coefficient (``Installed.aux_loss_coefficient``) and the loss.
    """
    seen: dict[str, torch.Tensor] = {}

    def replacing(hidden: Any) -> bool:
        # the call with labels computes the hidden states the call without them did, or the step (which
        # calls without labels) would read others than vanilla's loss does
        if "replace" not in seen:
            return False
        seen["labeled"] = hidden
        return isinstance(hidden, torch.Tensor) and hidden.shape == seen["replace"].shape

    def decoder_hook(module: nn.Module, args: Any, output: Any) -> Any:
        hidden = _last_hidden(output)
        if replacing(hidden):
            return _with_hidden(output, seen["replace"])
        if hidden is not None:
            seen["decoder"] = hidden
        return None

    def head_pre_hook(module: nn.Module, args: Any) -> Any:
        seen["weight"] = head.weight
        if head.bias is not None:
            seen["bias"] = head.bias
        if at_head:
            if replacing(args[0]):
                return (seen["replace"], *args[1:])
            seen["decoder"] = args[0]
        return None

    split = vocab_parallel.row_split(model, head)
    if split is not None and model.loss_function is not ForCausalLMLoss:
        # the vocabulary-parallel loss is ForCausalLMLoss's: which other cross-entropy a forward computes
        # is read (_loss_kind) from the whole logits, which no rank holds
        raise ChunkedLossRefused(
            f"the head's rows are split over the ranks and the loss is "
            f"{getattr(model.loss_function, '__name__', model.loss_function)!r}, not ForCausalLMLoss: the chunked "
            "loss over vocabulary shards computes ForCausalLMLoss only"
        )
    handles = [head.register_forward_pre_hook(head_pre_hook)]
    if not at_head:
        handles.append(decoder.register_forward_hook(decoder_hook))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
        hidden = seen.pop("decoder").detach().clone().requires_grad_(True)
        seen["replace"] = hidden
        labels = input_ids.clone()
        labels[0, 1] = -100
        arguments = {"input_ids": input_ids, "labels": labels, "use_cache": False, **_router_arguments(model)}
        # under tensor parallelism the loss is ForCausalLMLoss (above), compared as a mean
        items = split is None and _accepts(model, "num_items_in_batch")
        try:
            out = model(**arguments, **({"num_items_in_batch": torch.tensor(_PROBE_ITEMS)} if items else {}))
        except TypeError:
            if not items:
                raise
            # a **kwargs that does not take it (passed to a module that names its arguments): nor does a step
            items = False
            out = model(**arguments)
    except Exception:
        if "labeled" in seen and not _near(seen["labeled"], hidden):
            raise ChunkedLossRefused(_labels_change_the_hidden_states(seen["labeled"], hidden)) from None
        raise
    finally:
        for handle in handles:
            handle.remove()
    if "labeled" in seen and not _near(seen["labeled"], hidden):
        raise ChunkedLossRefused(_labels_change_the_hidden_states(seen["labeled"], hidden))
    loss = out.loss
    if split is not None:  # tensor parallelism: each rank's rows of the head
        weight = seen["weight"]
        coefficient = vocab_parallel.compare_with_vanilla(
            model, head, split, hidden, labels, loss, out, weight, transform
        )
        return coefficient, LossKind()
    # the head as the forward used it: under FSDP2 the whole weight its pre-forward hook gathered,
    # freed when the backward below reshards the unit, so the chunked loss reads a copy of it
    weight, bias = seen["weight"], seen.get("bias")
    used = _HeadView(weight, bias)
    if copy:
        used = _HeadView(
            weight.detach().clone().requires_grad_(weight.requires_grad),
            None if bias is None else bias.detach().clone().requires_grad_(bias.requires_grad),
        )
    aux = getattr(out, "aux_loss", None)
    h64, logits64, blocks = _float64_logits(hidden, used, transform)
    kind = _loss_kind(model, loss.detach(), aux, logits64, labels, transform, items)
    targets = _targets(labels, kind)
    divisor = _PROBE_ITEMS if kind.loss_kwargs else None
    wanted = [hidden, weight] if weight.requires_grad else [hidden]
    mine = [hidden, used.weight] if weight.requires_grad else [hidden]
    vanilla = torch.autograd.grad(loss, wanted, retain_graph=False)
    # chunk 1: every chunk boundary the probe has, so a wrong accumulation shows
    ours_loss = chunked_causal_lm_loss(
        hidden,
        used,  # type: ignore[arg-type]
        None,
        transform,
        chunk=1,
        shift_labels=targets.reshape(labels.shape),
        num_items_in_batch=divisor,
    )
    ours = torch.autograd.grad(ours_loss, mine)
    coefficient, ours_total = _aux_coefficient(model, loss.detach(), ours_loss.detach(), aux, hidden.dtype)
    reference_loss, reference_hidden, by_token, reference_head = _reference(
        h64,
        logits64,
        blocks,
        hidden,
        used,
        targets,
        divisor,
        transform,
    )
    if aux is not None and coefficient is not None:
        reference_loss = reference_loss + operator.attrgetter(coefficient)(model) * aux.detach().double()
    _check("loss", loss.detach(), ours_total, reference_loss, hidden.dtype)
    # vanilla's matmul sums over the vocabulary in blocks, a one-token chunk's in one pass: the
    # calibration is the worse of the two orders, each measured from float64
    vanilla_error, our_error, scale = _errors(vanilla[0], ours[0], reference_hidden)
    by_token_error = float((by_token.double() - reference_hidden).abs().max())
    _judge("hidden-state gradient", max(vanilla_error, by_token_error), our_error, scale, hidden.dtype)
    if len(wanted) == 2:
        rows = max(1, _REFERENCE_ELEMENTS // used.weight.shape[1])
        worst = (0.0, 0.0, 0.0)
        for start in range(0, used.weight.shape[0], rows):
            block = slice(start, start + rows)
            reference = reference_head(block)
            errors = _errors(vanilla[1][block], ours[1][block], reference)
            worst = (max(worst[0], errors[0]), max(worst[1], errors[1]), max(worst[2], errors[2]))
        _judge("head gradient", *worst, hidden.dtype)
    return coefficient, kind


def _near(labeled: Any, unlabeled: torch.Tensor) -> bool:
    """Whether the hidden states of the call with labels are the call without labels' (the first runs
    under autograd, the second not): within 16 steps of the dtype at their largest value, as a forward
    that takes another kernel under autograd (doge's) rounds; inputs built from the labels change them
    by their own size."""
    if not isinstance(labeled, torch.Tensor) or labeled.shape != unlabeled.shape:
        return False
    difference = float((labeled.detach().double() - unlabeled.detach().double()).abs().max())
    return difference <= 16 * torch.finfo(unlabeled.dtype).eps * float(unlabeled.detach().abs().max())


def _labels_change_the_hidden_states(labeled: Any, unlabeled: torch.Tensor) -> str:
    shape = tuple(labeled.shape) if isinstance(labeled, torch.Tensor) else type(labeled).__name__
    return (
        f"the forward computes other hidden states with labels ({shape}) than without ({tuple(unlabeled.shape)}): "
        "it builds inputs from the labels (an encoder-decoder's decoder inputs), so a step's hidden states, read "
        "without labels, are not the ones vanilla's loss reads"
    )


class _HeadView:
    """A head's weight and bias as one forward used them (what ``chunked_causal_lm_loss`` reads of a head)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias


def _errors(vanilla: torch.Tensor, ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, float]:
    reference = reference.to(vanilla.device)
    return (
        float((vanilla.double() - reference).abs().max()),
        float((ours.double() - reference).abs().max()),
        float(reference.abs().max()),
    )


def _check(name: str, vanilla: torch.Tensor, ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    _judge(name, *_errors(vanilla, ours, reference), dtype)


def _judge(name: str, vanilla_error: float, our_error: float, scale: float, dtype: torch.dtype) -> None:
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


def _aux_coefficient(
    model: nn.Module, vanilla: torch.Tensor, ours: torch.Tensor, aux: torch.Tensor | None, dtype: torch.dtype
) -> tuple[str | None, torch.Tensor]:
    """Which ``*aux_loss_coef`` attribute the forward multiplies the auxiliary loss by before adding it,
    and the chunked loss with it added as the step adds it."""
    if aux is None:
        return None, ours
    aux = aux.detach().to(ours.device)
    # the right coefficient leaves a loss's rounding (a few steps of float32 at the loss); another
    # misses by the difference of two coefficients times the auxiliary loss
    tolerance = 8 * torch.finfo(torch.float32).eps * max(1.0, abs(float(vanilla)))
    for path in _coefficient_paths(model):
        total = ours + operator.attrgetter(path)(model) * aux
        if abs(float(total - vanilla)) <= tolerance:
            return path, total
    if abs(float(ours - vanilla)) <= tolerance:
        return None, ours  # the forward returns an auxiliary loss it does not add
    raise ChunkedLossRefused(
        "the forward adds its auxiliary loss (aux_loss, output_router_logits) to the loss with a coefficient "
        "that is none of the model's *aux_loss_coef attributes"
    )


class _ChunkedForward:
    """The forward ``install`` puts on a model instance: a training step's loss in chunks, every other call
    the model's own forward.

    An object, not a closure: ``copy.deepcopy(model)`` copies it with the model (the copy computes with
    its own weights), ``pickle`` / ``torch.save(model)`` store it, and the model it refers to is freed
    with it (a cycle the garbage collector breaks).
    """

    def __init__(
        self,
        model: nn.Module,
        decoder: nn.Module,
        installed: Installed,
        original: Any,
        *,
        at_head: bool = False,
        linear_subclass: tuple[type, torch.dtype] | None = None,
    ) -> None:
        self.model = model
        self.decoder = decoder
        # the hidden states are the head's input (``_detect``): read by a pre-hook on the head, which
        # hands the head the last position only (what logits_to_keep=1 gives elsewhere)
        self.at_head = at_head
        self.linear_subclass = linear_subclass
        self.active = False  # in a call of this forward (the decoder's hook then has nothing to say)
        self.watch: _Watch | None = None
        self.handles: list[Any] = []  # the _Watch's hook on the decoder, removed by uninstall
        self.installed = installed
        # a forward set on the instance before the install (another wrapper): called as the original
        self.original = original
        self.disabled = False
        self.fell_back: set[str] = set()  # the kinds of vanilla fallback already warned about

    def read_hidden(self, head: nn.Module, call: Callable[[int], Any]) -> torch.Tensor | None:
        """The hidden states the chunked loss reads (every position) in ``call(logits_to_keep)``, a forward
        of the model that computes the last position's logits only; ``None`` when none were read.
        Called by ``token_log_probs``."""
        captured: list[torch.Tensor] = []

        def after(module: nn.Module, args: Any, output: Any) -> None:
            hidden = _last_hidden(output)
            if not captured and hidden is not None:
                captured.append(hidden)

        def before(module: nn.Module, args: Any) -> Any:
            if captured:
                return None
            captured.append(args[0])
            return (args[0][..., -1:, :], *args[1:])

        at_head = self.at_head
        handle = head.register_forward_pre_hook(before) if at_head else self.decoder.register_forward_hook(after)
        try:
            call(0 if at_head else 1)
        finally:
            handle.remove()
        return captured[0] if captured else None

    def _target(self) -> Callable[..., Any]:
        if self.original is not None:
            return self.original  # type: ignore[no-any-return,unused-ignore]
        return types.MethodType(type(self.model).forward, self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        # Trainer reads the forward's signature (the dataset columns it keeps, loss kwargs), generate too
        return inspect.signature(self._target())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        was, self.active = self.active, True
        try:
            return self._call(*args, **kwargs)
        finally:
            self.active = was

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        target = self._target()
        model, installed = self.model, self.installed
        arguments = dict(inspect.signature(target).bind(*args, **kwargs).arguments)
        labels = arguments.get("labels")
        extra = dict(arguments.pop("kwargs", {}) or {})
        get_head: Any = model.get_output_embeddings
        head = _active_head(get_head(), self.linear_subclass)
        loss = installed.loss
        if (
            self.disabled
            or labels is None
            # loss arguments a forward that does not hand them to its loss ignores, or reads otherwise
            or (not (loss.loss_kwargs and loss.shift) and ("shift_labels" in extra or "ignore_index" in extra))
            or not model.training
            or not torch.is_grad_enabled()
            or head is None
            # ZeRO-3's partitions are never whole here; a DTensor may be (FSDP2 gathers it in the forward)
            or (_sharded(head) is not None and not is_dtensor(head.weight) and not zero3.partitioned_head(head))
            or arguments.get("logits_to_keep", 0) != 0
            or "adapter_names" in extra
        ):
            return target(*args, **kwargs)
        want_tuple = _wants_tuple(model, arguments, extra)
        arguments.update(labels=None, logits_to_keep=0 if self.at_head else 1)
        if "return_dict" in arguments:
            arguments["return_dict"] = True
        elif want_tuple:
            extra["return_dict"] = True
        captured: list[torch.Tensor] = []
        splits: list[vocab_parallel.RowSplit | None] = []

        def capture(module: nn.Module, inputs: Any, output: Any) -> None:
            hidden = _last_hidden(output)
            if captured or hidden is None:
                return
            # the head's rows split over the ranks (tensor parallelism) when the decoder has returned, or whole
            split = vocab_parallel.row_split(model, head)
            if split is not None or not is_dtensor(head.weight):
                captured.append(hidden)
                splits.append(split)

        def capture_input(module: nn.Module, args: Any) -> Any:
            if captured or is_dtensor(head.weight):
                return None
            captured.append(args[0])
            splits.append(None)
            return (args[0][..., -1:, :], *args[1:])

        if self.at_head:
            handle = head.register_forward_pre_hook(capture_input)
        else:
            handle = self.decoder.register_forward_hook(capture)
        try:
            out = target(**arguments, **extra)
        finally:
            handle.remove()
        aux = getattr(out, "aux_loss", None)
        if not captured:
            # sharded otherwise since the install (a head made an FSDP2 unit of its own): vanilla's step
            self._fall_back(
                sharded_after_decoder(model, head, "the LM head's weight is a DTensor")
                if is_dtensor(head.weight)
                else "the step's forward never handed the head the decoder's hidden states"
            )
            return target(*args, **kwargs)
        if aux is not None and installed.aux_loss_coefficient is None:
            self._fall_back(
                "the forward returned an auxiliary loss (aux_loss) whose coefficient the install's probe did not "
                "find, so the chunked loss cannot add it as vanilla's does"
            )
            return target(*args, **kwargs)
        # a head ZeRO-3 partitions is gathered once for the whole loss (zero3.py)
        with zero3.gathered(head.parameters(recurse=False)):
            rows = vocab_parallel.local_rows(head, splits[0])  # the head, or this rank's rows of it
            per_token = logit_bytes_per_token(captured[0], rows, installed.transform, LOGIT_COPIES)
            last = getattr(out, "logits", None)
            # the last position's logits the step returns, with what their graph saves, count as a chunk's tokens
            held = last.numel() // int(rows.weight.shape[0]) * per_token if isinstance(last, torch.Tensor) else 0
            chunk = installed.chunk_of(int(rows.weight.shape[0]), held, per_token=per_token)
            if loss.loss_kwargs:
                loss_arguments = {
                    "num_items_in_batch": extra.get("num_items_in_batch"),
                    "ignore_index": extra.get("ignore_index", -100),
                    "shift_labels": extra.get("shift_labels") if loss.shift else labels,
                }
            else:
                # the mean over the counted tokens, as the forward's own CrossEntropyLoss computes it
                loss_arguments = {"shift_labels": None if loss.shift else labels}
            value = vocab_parallel.causal_lm_loss(
                captured[0], rows, labels, installed.transform, split=splits[0], chunk=chunk, **loss_arguments
            )
        if aux is not None:
            coefficient = operator.attrgetter(installed.aux_loss_coefficient)(model)  # type: ignore[arg-type]
            value = value + coefficient * aux.to(value.device)
        if self.watch is not None and model.__dict__.get("forward") is not self:
            self.watch.say(f"chunked-loss (called with labels by {_described(model.__dict__.get('forward'))})")
        out.loss = value
        return out.to_tuple() if want_tuple else out

    def _fall_back(self, reason: str) -> None:
        # the pack was installed, so its user expects the chunked step: a step that runs vanilla's instead
        # (its full logits, and this forward twice) is said once per model and reason
        if reason not in self.fell_back:
            self.fell_back.add(reason)
            logger.warning(
                "hfpatch: chunked-loss on %s: %s; this training step, and each like it, computes vanilla's full logits",
                type(self.model).__name__,
                reason,
            )


def _described(function: Any) -> str:
    # functools.wraps gives a wrapper its wrapped function's name (TRL's fused head is named
    # LlamaForCausalLM.forward): the code object says where it was written
    function = getattr(function, "__func__", function)
    code, module = getattr(function, "__code__", None), getattr(function, "__globals__", {}).get("__name__")
    if code is None:
        return f"{type(function).__module__}.{type(function).__qualname__}"
    return f"{module}.{code.co_qualname}" if module else str(code.co_qualname)


class _Watch:
    """A hook on the decoder: when ``model.forward`` was replaced after the install (TRL's
    ``add_fused_lm_head`` wraps it) and the wrapper runs the decoder itself in a training step, the
    wrapper computes that step's loss, not the pack (which computes it when the wrapper calls the
    forward it wrapped with labels); the first step of each kind logs which (``hfpatch`` logger, info).
    """

    def __init__(self, forward: _ChunkedForward) -> None:
        self.forward = forward
        self.said: set[str] = set()

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        forward = self.forward
        wrapper = forward.model.__dict__.get("forward")
        if forward.disabled or forward.active or wrapper is forward:
            return
        if forward.model.training and torch.is_grad_enabled():
            self.say(f"{_described(wrapper)}, which replaced the forward after chunked-loss's install")

    def say(self, who: str) -> None:
        if who not in self.said:
            self.said.add(who)
            name = type(self.forward.model).__name__
            logger.info("hfpatch: %s: this training step's loss is computed by %s", name, who)


def loss_computed_by(model: nn.Module) -> str | None:
    """Who computes a training step's loss on ``model``: ``"chunked-loss"``, the wrapper set on
    ``model.forward`` after the install (described by where its code is, e.g. TRL's
    ``trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward``), or ``None`` without the pack.

    A wrapper decides at each call: TRL's computes its own loss when called with ``fused_lm_head=True``
    and otherwise calls the pack's forward, which then computes it; the log says which did, per kind.
    """
    state = model.__dict__.get(_STATE)
    if not isinstance(state, _ChunkedForward) or state.disabled:
        return None
    wrapper = model.__dict__.get("forward")
    return "chunked-loss" if wrapper is state else _described(wrapper)


def _active_head(current: Any, linear_subclass: tuple[type, torch.dtype] | None = None) -> nn.Linear | None:
    """The plain ``nn.Linear`` a training step's head runs, or ``None`` (vanilla's step then runs).

    A head replaced since the install by another plain ``nn.Linear`` (``resize_token_embeddings``) is
    read as it is: the probe found what the forward does after the head, whichever head it is.  PEFT's
    ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``) runs its active adapter's trained copy of
    the head, or the original one when adapters are disabled: that module is the head.  A subclass of
    ``nn.Linear`` the probe found computing nn.Linear's forward (``linear_subclass``: its class and the
    dtype it was probed in) is the head while its weight keeps that dtype.
    """
    if _linear(current, linear_subclass):
        return current
    original, copies = getattr(current, "original_module", None), getattr(current, "modules_to_save", None)
    if not isinstance(original, nn.Module) or not isinstance(copies, nn.ModuleDict):
        return None
    active = list(getattr(current, "active_adapters", ()))
    if getattr(current, "disable_adapters", False) or not active or any(name not in copies for name in active):
        chosen = original
    else:
        chosen = copies[active[0]]
    return chosen if _linear(chosen, linear_subclass) else None  # type: ignore[return-value]


def _linear(module: Any, linear_subclass: tuple[type, torch.dtype] | None) -> bool:
    if plain_linear(module):
        return True
    return (
        linear_subclass is not None
        and type(module) is linear_subclass[0]
        and getattr(getattr(module, "weight", None), "dtype", None) == linear_subclass[1]
    )


def _wants_tuple(model: nn.Module, arguments: dict[str, Any], extra: dict[str, Any]) -> bool:
    asked = arguments.get("return_dict", extra.get("return_dict"))
    if asked is None:
        asked = getattr(getattr(model, "config", None), "return_dict", True)
    return not asked


def install(model: PreTrainedModel, *, chunk: int | None = None, budget: int | None = None) -> Installed:
    """Make the model's training steps compute the loss in chunks of tokens.

    Called once per model, after it is loaded (and before ``peft.get_peft_model`` or a Trainer
    wraps it, or after: both call the model's own forward).  Afterwards a forward with ``labels``,
    in training mode and with autograd on, returns vanilla's loss (within rounding; with the MoE
    auxiliary loss the family adds) computed without the tokens x vocabulary logits, and ``.logits``
    holds the logits of the last position only (``(batch, 1, vocabulary)``, as ``logits_to_keep=1``
    gives).  Every other forward (no labels, ``eval()``, ``no_grad``, generation, a
    ``logits_to_keep`` of the caller's) is vanilla's.  The model deep-copies, pickles and is freed
    as any model.

    Args:
        model: a loaded ``*ForCausalLM``.
        chunk: tokens per chunk, whatever the vocabulary; give it or ``budget``, not both.
        budget: bytes of chunk x vocabulary logits a step holds at most (``chunk_for``).  Neither
            given: ``HF_PATCH_CHUNKED_LOSS_BUDGET`` (``budget_from_env``), else 256 MiB.

    Returns:
        What was found and installed.

    Raises:
        ChunkedLossRefused: the model's head or loss path is not one this reproduces (``detect``).
        ValueError: ``chunk`` or ``budget`` is not positive, both are given, the budget variable is
            not a number of bytes, or the model already has it.
    """
    if chunk is not None and budget is not None:
        raise ValueError(f"give install a chunk ({chunk} tokens) or a budget ({budget} bytes), not both")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be positive, not {chunk}")
    if budget is not None and budget < 1:
        raise ValueError(f"budget must be a positive number of bytes, not {budget}")
    if chunk is None and budget is None:
        budget = budget_from_env()
    if installed(model) is not None:
        raise ValueError(f"{type(model).__name__} already has the chunked loss")
    found = _detect(model)
    result = Installed(found.transform, chunk, budget, found.aux_loss_coefficient, found.loss)
    original = model.__dict__.get("forward")
    forward = _ChunkedForward(
        model, found.decoder, result, original, at_head=found.at_head, linear_subclass=found.linear_subclass
    )
    forward.watch = _Watch(forward)
    forward.handles = [found.decoder.register_forward_hook(forward.watch.after)]
    model.__dict__["forward"] = forward
    model.__dict__[_STATE] = forward
    return result


def _installed_forward(model: nn.Module) -> _ChunkedForward | None:
    state = model.__dict__.get(_STATE)
    return state if isinstance(state, _ChunkedForward) and not state.disabled else None


def installed(model: nn.Module) -> Installed | None:
    """What ``install`` put on ``model``, or ``None``.  Called by anyone who wants to know."""
    state = model.__dict__.get(_STATE)
    return state.installed if isinstance(state, _ChunkedForward) and not state.disabled else None


def uninstall(model: nn.Module) -> None:
    """Give the model vanilla's forward back.  Called after ``install``; does nothing otherwise.

    A wrapper set on ``model.forward`` after the install (TRL's fused head) keeps calling what it
    wrapped, which from now on is the model's own forward.
    """
    state: Any = model.__dict__.pop(_STATE, None)
    if not isinstance(state, _ChunkedForward):
        return
    state.disabled = True
    for handle in state.handles:
        handle.remove()
    original = state.original
    if model.__dict__.get("forward") is state:
        if original is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = original
