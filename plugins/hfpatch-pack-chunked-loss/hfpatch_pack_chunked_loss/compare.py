"""The probe's comparison of the chunked loss with vanilla's, on the model's own forward: which cross-entropy
vanilla computes (``LossKind``), and that the chunked loss and its gradients are vanilla's within the bound
``judge.py`` calibrates against float64 (``compare_with_vanilla``).  A head whose rows are split over the
ranks is compared by its layout (``vocab_parallel.RowsSplit.compare``)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss

from .errors import ChunkedLossRefused
from .found import LossKind
from .judge import aux_coefficient, check, errors, judge
from .loss import HeadTransform, chunked_causal_lm_loss
from .outputs import accepts, coefficient_paths, last_hidden, router_arguments, with_hidden
from .rows import HeadRows

__all__ = ["compare_with_vanilla"]

# chunked_causal_lm_loss is read from this module's globals at each probe (tests/test_probe.py scales it here)

# rows of the head cast to float64 at a time by the probe's reference (32 MiB at hidden 512)
_REFERENCE_ELEMENTS = 2**22


def _targets(labels: torch.Tensor, loss: LossKind) -> torch.Tensor:
    """The flattened labels each token's logits are compared with, as the loss ``loss`` reads them."""
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:] if loss.shift else labels
    return shifted.reshape(-1)


def _float64_logits(
    hidden: torch.Tensor, head: nn.Linear | HeadView, transform: HeadTransform
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
    head: nn.Linear | HeadView,
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


def loss_kind(
    model: nn.Module,
    paths: list[str],
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
        coefficients += [float(operator.attrgetter(path)(model)) for path in paths]
        aux_value = float(aux.detach())
    value = float(vanilla)

    def distance(kind: LossKind) -> float:
        loss = float(
            _reference_loss(logits, transform, _targets(labels, kind), _PROBE_ITEMS if kind.loss_kwargs else None)
        )
        return min(abs(value - (loss + c * aux_value if aux is not None else loss)) for c in coefficients)

    return min(kinds, key=distance)


def compare_with_vanilla(
    model: PreTrainedModel,
    decoder: nn.Module,
    head: nn.Linear,
    input_ids: torch.Tensor,
    transform: HeadTransform,
    rows: HeadRows,
    *,
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
        hidden = last_hidden(output)
        if replacing(hidden):
            return with_hidden(output, seen["replace"])
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

    split = rows.compare is not None  # the head's rows split over the ranks: the layout compares
    if split and model.loss_function is not ForCausalLMLoss:
        # the vocabulary-parallel loss is ForCausalLMLoss's: which other cross-entropy a forward computes
        # is read (_loss_kind) from the whole logits, which no rank holds
        raise ChunkedLossRefused(
            f"the head's rows are split over the ranks and the loss is "
            f"{getattr(model.loss_function, '__name__', model.loss_function)!r}, not ForCausalLMLoss: the chunked "
            "loss over vocabulary shards computes ForCausalLMLoss only"
        )
    # what the forward takes, and where an auxiliary loss's coefficient may be read, before it runs
    router = router_arguments(model)
    # under tensor parallelism the loss is ForCausalLMLoss (above), compared as a mean
    items = not split and accepts(model, "num_items_in_batch")
    paths = coefficient_paths(model)
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
        arguments = {"input_ids": input_ids, "labels": labels, "use_cache": False, **router}
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
    if rows.compare is None:
        return _compare_whole(model, head, seen, hidden, labels, loss, out, transform, rows, items, paths)
    # tensor parallelism: each rank's rows of the head
    return rows.compare(model, head, hidden, labels, loss, out, seen["weight"], transform), LossKind()


def _compare_whole(
    model: PreTrainedModel,
    head: nn.Linear,
    seen: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    out: Any,
    transform: HeadTransform,
    rows: HeadRows,
    items: bool,
    paths: list[str],
) -> tuple[str | None, LossKind]:
    """``compare_with_vanilla`` on a head this rank holds whole: float64's reference first, then the chunked
    loss, then the judgement."""
    # the head as the forward used it: under FSDP2 the whole weight its pre-forward hook gathered,
    # freed when the backward below reshards the unit, so the chunked loss reads a copy of it
    weight, bias = seen["weight"], seen.get("bias")
    used = HeadView(weight, bias)
    if rows.sharded is not None:
        used = HeadView(
            weight.detach().clone().requires_grad_(weight.requires_grad),
            None if bias is None else bias.detach().clone().requires_grad_(bias.requires_grad),
        )
    aux = getattr(out, "aux_loss", None)
    h64, logits64, blocks = _float64_logits(hidden, used, transform)
    kind = loss_kind(model, paths, loss.detach(), aux, logits64, labels, transform, items)
    targets = _targets(labels, kind)
    divisor = _PROBE_ITEMS if kind.loss_kwargs else None
    reference_loss, reference_hidden, by_token, reference_head = _reference(
        h64, logits64, blocks, hidden, used, targets, divisor, transform
    )
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
    coefficient, ours_total = aux_coefficient(model, loss.detach(), ours_loss.detach(), aux)
    if aux is not None and coefficient is not None:
        reference_loss = reference_loss + operator.attrgetter(coefficient)(model) * aux.detach().double()
    check("loss", loss.detach(), ours_total, reference_loss, hidden.dtype)
    # vanilla's matmul sums over the vocabulary in blocks, a one-token chunk's in one pass: the
    # calibration is the worse of the two orders, each measured from float64
    vanilla_error, our_error, scale = errors(vanilla[0], ours[0], reference_hidden)
    by_token_error = float((by_token.double() - reference_hidden).abs().max())
    judge("hidden-state gradient", max(vanilla_error, by_token_error), our_error, scale, hidden.dtype)
    if len(wanted) == 2:
        step = max(1, _REFERENCE_ELEMENTS // used.weight.shape[1])
        worst = (0.0, 0.0, 0.0)
        for start in range(0, used.weight.shape[0], step):
            block = slice(start, start + step)
            found = errors(vanilla[1][block], ours[1][block], reference_head(block))
            worst = (max(worst[0], found[0]), max(worst[1], found[1]), max(worst[2], found[2]))
        judge("head gradient", *worst, hidden.dtype)
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


class HeadView:
    """A head's weight and bias as one forward used them (what ``chunked_causal_lm_loss`` reads of a head)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
