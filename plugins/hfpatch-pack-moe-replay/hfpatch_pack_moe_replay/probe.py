"""Whether a router candidate's selection can be replayed exactly, and what it computes.

``probe_router`` builds a candidate class on the CPU (from the shrunk config, else from the model
built on meta, ``sites``), gives it random weights and runs it on a probe input while
``TorchFunctionMode`` probes watch its ``topk`` calls and linear maps. It accepts the class when
its one selection ``topk`` replays bit for bit, a forced selection changes its outputs with
gradients reaching its weights, its weights for a forced selection follow one of the known rules,
and its forward is deterministic in training mode (``discovery``'s docstring lists them); else it
raises ``Refused``, saying why.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hfpatch_core.authoring import isolated_rng

from .scope import LayerReplay
from .selection import TOPK, Selection, SelectionMode, topk_arguments
from .sites import EXPERT_COUNTS, Sites, shrunk_config

__all__ = ["NO_TOPK", "Refused", "build", "probe_router"]

_PROBE_TOKENS = 6


class Refused(Exception):
    """A candidate is not a replayable router; the message says why."""


NO_TOPK = "it selects experts without a top-k over their scores (hash routing, a sparse mixer, ...)"


def _instantiate(cls: type[nn.Module], config: Any) -> nn.Module:
    errors = []
    for args, kwargs in (((config,), {}), ((config, 0), {}), ((config,), {"layer_idx": 0})):
        try:
            with torch.device("cpu"):
                return cls(*args, **kwargs)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    raise Refused(f"it cannot be built from the config alone ({errors[0]})")


#: The most parameters a router taken out of a model built on meta may have to be probed.
_MAX_PROBE_PARAMETERS = 20_000_000


def build(cls: type[nn.Module], config: Any, sites: Sites | None) -> tuple[nn.Module, int | None]:
    """A CPU instance of ``cls`` to probe, and its input width (``None``: the shrunk config's hidden size).

    Built from the shrunk config like the model builds it; a class whose constructor takes
    other arguments (sizes passed by its MoE block) is taken instead from the model built
    on meta (``router_sites``), its memory allocated on the CPU.
    """
    try:
        return _instantiate(cls, shrunk_config(config)), None
    except Refused:
        if not sites or cls not in sites:
            raise
    meta = sites[cls][0]
    if sum(parameter.numel() for parameter in meta.parameters()) > _MAX_PROBE_PARAMETERS:
        raise Refused(
            f"it cannot be built from the config alone and its instance has over {_MAX_PROBE_PARAMETERS:,} parameters"
        )
    instance = copy.deepcopy(meta).to_empty(device="cpu")
    with torch.no_grad():
        for buffer in instance.buffers():
            buffer.zero_()
    widths = [int(sub.in_features) for sub in instance.modules() if isinstance(sub, nn.Linear)]
    return instance, (widths[0] if widths else None)


@dataclasses.dataclass
class _Call:
    shape: tuple[int, ...]
    k: Any
    dim: Any
    largest: Any


class _Watch(TorchFunctionMode):
    """Notes every ``topk`` call and every linear map's output in a forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.topk: list[_Call] = []
        self.linear: list[torch.Tensor] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in TOPK:
            source, k, dim, largest = topk_arguments(args, kwargs)
            self.topk.append(_Call(tuple(source.shape), k, dim, largest))
        elif func in (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and isinstance(
            result, torch.Tensor
        ):
            self.linear.append(result.detach())
        return result


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [item for item in output if isinstance(item, torch.Tensor)]
    return []


def _run(
    instance: nn.Module,
    hidden: torch.Tensor,
    mode: TorchFunctionMode | None = None,
    extra: dict[str, Any] | None = None,
) -> list[torch.Tensor]:
    with mode if mode is not None else contextlib.nullcontext():
        return _tensors(instance(hidden, **(extra or {})))


def _extra_arguments(instance: nn.Module, config: Any, generator: torch.Generator) -> dict[str, Any]:
    """The forward arguments besides the hidden states that a router takes from its MoE block: a
    per-expert bias (the correction bias some blocks own and pass in)."""
    parameters = list(inspect.signature(instance.forward).parameters.values())[1:]
    counts = [getattr(config, name, None) for name in EXPERT_COUNTS]
    experts = next((count for count in counts if isinstance(count, int)), 0)
    extra: dict[str, Any] = {}
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        needed = parameter.default is inspect.Parameter.empty or parameter.default is None
        if needed and "bias" in parameter.name and experts:
            extra[parameter.name] = torch.rand(experts, generator=generator) * 0.5
    return extra


def probe_router(cls: type[nn.Module], config: Any, sites: Sites | None = None) -> tuple[Selection, str, nn.Module]:
    """The selection of router candidate ``cls``, what it computes in words, and the instance probed.

    Raises:
        Refused: ``cls`` is not a router whose selection can be replayed exactly (the message says why).
    """
    shrunk = shrunk_config(config)
    instance, width = build(cls, config, sites)
    hidden_size = width if width is not None else getattr(shrunk, "hidden_size", None)
    if not isinstance(hidden_size, int):
        raise Refused("its config has no hidden_size")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in instance.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
        for name, buffer in instance.named_buffers():
            if buffer.is_floating_point() and "bias" in name:
                buffer.copy_(torch.rand(buffer.shape, generator=generator).to(buffer.dtype) * 0.5)
    instance.eval()
    hidden: torch.Tensor | None = None
    watch = _Watch()
    errors = []
    extra = _extra_arguments(instance, shrunk, generator)
    for shape in ((_PROBE_TOKENS, hidden_size), (1, _PROBE_TOKENS, hidden_size)):
        candidate = torch.randn(shape, generator=generator)
        watch = _Watch()
        try:
            with torch.no_grad():
                _run(instance, candidate, watch, extra)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        hidden = candidate
        break
    if hidden is None:
        raise Refused(f"its forward does not run on hidden states alone ({errors[0]})")
    selection = _selection_of(watch)
    logits = [out for out in watch.linear if out.shape[-1] == selection.width]
    if not logits:
        raise Refused(
            f"its top-{selection.top_k} over {selection.width} experts scores no linear map of the hidden states"
        )
    logits_value = logits[0].reshape(-1, selection.width)

    with torch.no_grad():
        captured: list[torch.Tensor] = []
        live = _run(instance, hidden, _Capture(selection, captured), extra)
        (own,) = captured
        replayed = _run(instance, hidden, SelectionMode(instance, selection, _replay(own), record=False), extra)
        if len(live) != len(replayed) or not all(torch.equal(a, b) for a, b in zip(live, replayed, strict=True)):
            raise Refused("replaying its own selection does not give its outputs bit for bit")
        if selection.width == 1:
            # one expert: every token selects it, so any recorded routing is the live one
            return selection, "a single expert, selected by every token", instance
        forced_indices = (own + 1) % selection.width
        forcing = SelectionMode(instance, selection, _replay(forced_indices), record=False)
        forced = _run(instance, hidden, forcing, extra)
        if all(torch.equal(a, b) for a, b in zip(live, forced, strict=True)):
            raise Refused("its outputs do not depend on the selected experts")
        instance.train()
        # two seeds of the probe's own (torch.manual_seed would also queue them for a CUDA not started yet)
        with isolated_rng(1):
            first = _run(instance, hidden, None, extra)
        with isolated_rng(2):
            second = _run(instance, hidden, None, extra)
        instance.eval()
        if not all(torch.equal(a, b) for a, b in zip(first, second, strict=True)):
            raise Refused("its forward is random in training mode (jitter or sampling), so no selection is replayable")
    rule = _rule(forced, logits_value, forced_indices, instance, selection)
    if any(call.shape[0] == _PROBE_TOKENS and call.shape[-1] < selection.width for call in watch.topk):
        rule += "; group-limited"
    weights = [p for p in instance.parameters() if p.dim() == 2 and p.shape[0] == selection.width]
    instance.zero_grad(set_to_none=True)
    outputs = _run(instance, hidden, SelectionMode(instance, selection, _replay(forced_indices), record=False), extra)
    total = sum((out.float().sum() for out in outputs if out.requires_grad), torch.zeros(()))
    if total.requires_grad:
        total.backward()
    if not weights or not any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in weights):
        raise Refused("no gradient reaches its router weights through a replayed selection")
    return selection, rule, instance


class _Capture(TorchFunctionMode):
    """Keeps the indices of a live forward's selection."""

    def __init__(self, selection: Selection, captured: list[torch.Tensor]) -> None:
        super().__init__()
        self.selection, self.captured = selection, captured

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in TOPK and self.selection.matches(args, kwargs):
            self.captured.append(result[1].clone())
        return result


def _replay(indices: torch.Tensor) -> LayerReplay:
    return LayerReplay(0, "probe", indices, None)


def _selection_of(watch: _Watch) -> Selection:
    rows = [
        call
        for call in watch.topk
        if len(call.shape) == 2
        and call.shape[0] == _PROBE_TOKENS
        and call.dim in (-1, 1)
        and bool(call.largest)
        and isinstance(call.k, int)
    ]
    if not rows:
        raise Refused("no top-k over a (tokens, experts) tensor in its forward (hash routing, a sparse mixer, ...)")
    width = max(call.shape[1] for call in rows)
    widest = [call for call in rows if call.shape[1] == width]
    if len({call.k for call in widest}) > 1 or len(widest) > 1:
        raise Refused(f"it computes {len(widest)} top-k over its {width} experts, so the selection is ambiguous")
    return Selection(width, int(widest[0].k))


def _rule(
    outputs: list[torch.Tensor],
    logits: torch.Tensor,
    indices: torch.Tensor,
    instance: nn.Module,
    selection: Selection,
) -> str:
    """What the router computes for the forced ``indices``, matched against the known rules."""
    scores = logits.float()
    rules: dict[str, Callable[[], torch.Tensor]] = {
        "softmax top-k": lambda: F.softmax(scores, dim=-1).gather(1, indices),
        "sigmoid top-k": lambda: torch.sigmoid(scores).gather(1, indices),
        "softmax over the selected logits (gpt-oss)": lambda: F.softmax(logits.gather(1, indices).float(), dim=-1),
    }
    notes = []
    if any(
        "bias" in name and buffer.shape == (selection.width,) and bool(buffer.abs().sum() > 0)
        for name, buffer in [*instance.named_buffers(), *instance.named_parameters()]
        if name.rpartition(".")[2] != "bias"
    ):
        notes.append("a correction bias used only to select")
    # a learned scale per expert applied to the selected weights (gemma4's per_expert_scale)
    per_expert_scales = [
        (name.rpartition(".")[2], tensor.detach())
        for name, tensor in [*instance.named_parameters(), *instance.named_buffers()]
        if tensor.shape == (selection.width,) and "bias" not in name.rpartition(".")[2] and tensor.is_floating_point()
    ]
    for output in _in_token_order(outputs, indices):
        flat = output.detach().float().reshape(-1, output.shape[-1])
        # a router that returns bf16 weights rounds them: compare at that precision
        rtol, atol = (1e-4, 1e-6) if output.dtype in (torch.float32, torch.float64) else (1e-2, 1e-3)
        if flat.shape == (indices.shape[0], selection.width):
            dense = torch.full_like(scores, float("-inf")).scatter(1, indices, logits.gather(1, indices).float())
            if torch.allclose(flat, torch.sigmoid(dense), rtol=rtol, atol=atol):
                return _label("sigmoid of the selected logits, scattered over the experts (llama4)", notes)
            continue
        if flat.shape != indices.shape:
            continue
        for name, rule in rules.items():
            base = rule()
            for renormalised in (False, True):
                candidate = base / (base.sum(dim=-1, keepdim=True) + (1e-20 if "sigmoid" in name else 0.0))
                candidate = candidate if renormalised else base
                for per_expert_name, per_expert in [("", None), *per_expert_scales]:
                    scaled = candidate if per_expert is None else candidate * per_expert.float()[indices]
                    scale = float(flat.sum() / scaled.sum())
                    if torch.allclose(flat, scaled * scale, rtol=rtol, atol=atol):
                        words = [name + (", renormalised" if renormalised and "selected" not in name else "")]
                        if per_expert is not None:
                            words.append(f"times the selected experts' {per_expert_name}")
                        if abs(scale - 1.0) > 1e-6:
                            words.append(f"scaled by {scale:g}")
                        return _label(", ".join(words), notes)
    raise Refused(
        "the routing weights it returns for a forced selection match none of the rules the pack knows (softmax or "
        "sigmoid top-k, renormalised or not, scaled; gpt-oss; llama4)"
    )


def _in_token_order(outputs: list[torch.Tensor], indices: torch.Tensor) -> list[torch.Tensor]:
    """``outputs``, plus each flat one that another output permutes (weights grouped by expert, as
    jetmoe's gating returns them with the permutation) put back in ``(tokens, top_k)`` order."""
    found = list(outputs)
    count = indices.numel()
    orders = [
        out
        for out in outputs
        if out.dim() == 1
        and out.numel() == count
        and not out.is_floating_point()
        and torch.equal(out.sort().values, torch.arange(count))
    ]
    for output in outputs:
        if output.dim() == 1 and output.numel() == count and output.is_floating_point():
            for order in orders:
                restored = torch.empty_like(output)
                restored[order] = output
                found.append(restored.reshape(indices.shape))
    return found


def _label(rule: str, notes: list[str]) -> str:
    return rule + "".join(f"; {note}" for note in notes)
