"""Holding top-k decisions (MoE routing) equal on both sides of a comparison.

A token whose top-k router scores tie within the rounding of a low-precision dtype can
take another expert in one model than in the other: which one depends on the order in
which a CPU's kernels round, so a comparison that lets each side route on its own
fails on some hosts and passes on others. ``HeldRouting`` records every ``topk`` of one
model's forward passes (vanilla's), then makes the other model's ``topk`` calls return
the recorded indices, with that model's own scores gathered at them, so its gradients
reach its router exactly as top-k's backward sends them.

Forcing must not hide a real bug: a forced decision is legitimate only where the other
model's own top-k differs by a tie, its scores within ``tie_ulps`` units in the last
place of ``dtype`` (the dtype the models compute in) of the recorded choice's scores.
Every other difference, and a different number of ``topk`` calls, is reported in
``problems``. In float32 a tie is within 1.9e-6 (16 ulps): what a reordered fp32 sum
moves, so holding is harmless there and a routing change is always reported.

Recomputation (activation checkpointing) calls ``topk`` again during the backward pass;
those calls are not new decisions: the recorder lets them run, and the forcing side
returns what it returned for the same input in the forward pass (a recomputation's
input is bitwise the forward's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: units in the last place (of the models' dtype, relative to the scores) within which two
#: top-k scores are a tie.  Softmax scores differ relatively by about their logits' absolute
#: difference, and a bf16 router logit in [4, 8) rounds in steps of 2**-5, 4 ulps of 1.0:
#: 16 covers a rounding step of a logit up to 16, or a few of smaller ones (forced ties
#: measured at most 0.031, 4 ulps, on the qwen-moe test models; docs/training.md)
DEFAULT_TIE_ULPS = 16


def _topk_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, int, int, bool, bool]:
    """``(input, k, dim, largest, sorted)`` of a ``torch.topk`` / ``Tensor.topk`` call."""
    names = ("input", "k", "dim", "largest", "sorted")
    bound = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        bound["input" if key == "self" else key] = value
    return (
        bound["input"],
        int(bound["k"]),
        int(bound.get("dim", -1)),
        bool(bound.get("largest", True)),
        bool(bound.get("sorted", True)),
    )


def _fingerprint(tensor: torch.Tensor, k: int, dim: int) -> tuple[Any, ...]:
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return tuple(tensor.shape), str(tensor.dtype), k, dim, hashlib.blake2b(data, digest_size=16).hexdigest()


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass (a checkpoint's recomputation)."""
    return bool(torch._C._current_graph_task_id() != -1)


@dataclasses.dataclass
class HeldRouting:
    """Records the top-k decisions of one model's forward passes and forces them in another's.

    Use ``record()`` around the reference model's forward (and backward) passes, then
    ``force()`` around the other model's, in the same order (``step`` names the current
    step in messages). ``forced`` counts the decisions (one row of one ``topk`` call) that
    differed and were forced; ``problems`` lists every difference that is not a tie.

    Attributes:
        dtype: the dtype the models compute in; its rounding decides what is a tie.
        tie_ulps: how many units in the last place of ``dtype`` two scores may differ by and tie.
    """

    dtype: torch.dtype
    tie_ulps: float = DEFAULT_TIE_ULPS
    step: int | None = None
    calls: list[torch.Tensor] = dataclasses.field(default_factory=list)
    forced: int = 0
    decisions: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    #: the largest relative score difference of a decision that differed (a tie or not)
    largest_gap: float = 0.0
    _replayed: int = 0
    _forward: dict[tuple[Any, ...], torch.Tensor] = dataclasses.field(default_factory=dict)
    _non_ties: int = 0

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Record the indices of every forward-pass ``topk`` call inside the block."""
        with _intercepted(self._record):
            yield

    @contextlib.contextmanager
    def force(self) -> Iterator[None]:
        """Replay the recorded indices, in call order, to every forward-pass ``topk`` call in the block."""
        with _intercepted(self._force):
            yield

    def for_another_model(self) -> HeldRouting:
        """A ``HeldRouting`` that forces the decisions recorded here on one more model, counted apart."""
        return HeldRouting(self.dtype, self.tie_ulps, calls=list(self.calls))

    @property
    def tie_bound(self) -> float:
        """The largest relative difference of two scores that is a tie (``tie_ulps`` of ``dtype``)."""
        return float(self.tie_ulps * torch.finfo(self.dtype).eps)

    def finish(self) -> list[str]:
        """``problems``, with one more where the forcing side made fewer ``topk`` calls than were recorded."""
        if self._replayed < len(self.calls):
            self.problems.append(
                f"routing: vanilla made {len(self.calls)} top-k calls (MoE routing decisions), the patched model "
                f"{self._replayed}: the pack routes differently or computes top-k another way"
            )
        if self._non_ties:
            self.problems.append(
                f"routing: {self._non_ties} of {self.decisions} top-k decisions of the patched model differ from "
                f"vanilla's beyond a tie (first ones above); {self.forced} differed in all"
            )
        return self.problems

    def _where(self, call: int) -> str:
        return f"{'' if self.step is None else f'step {self.step}, '}top-k call {call + 1}"

    def _record(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = func(*args, **kwargs)
        if not _in_backward():
            self.calls.append(result[1].detach().clone())
        return result

    def _force(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        scores, k, dim, largest, _ = _topk_arguments(args, kwargs)
        key = _fingerprint(scores, k, dim)
        if _in_backward():
            indices = self._forward.get(key)
            if indices is None:  # not a recomputation of a forward call: nothing to hold it to
                return func(*args, **kwargs)
            return torch.return_types.topk((scores.gather(dim, indices), indices))
        call = self._replayed
        self._replayed += 1
        with torch.no_grad():
            own = func(*args, **kwargs)
        if call >= len(self.calls):
            self.problems.append(
                f"routing: the patched model makes more top-k calls than vanilla's {len(self.calls)} "
                f"(first extra: {self._where(call)}); it ran unforced"
            )
            return func(*args, **kwargs)
        indices = self.calls[call].to(scores.device)
        if indices.shape != own[1].shape:
            self.problems.append(
                f"routing: {self._where(call)} selects shape {tuple(own[1].shape)} in the patched model, "
                f"{tuple(indices.shape)} in vanilla; it ran unforced"
            )
            return func(*args, **kwargs)
        self._forward[key] = indices
        self._check(call, scores, indices, own[1], dim, largest)
        return torch.return_types.topk((scores.gather(dim, indices), indices))

    def _check(
        self, call: int, scores: torch.Tensor, forced: torch.Tensor, own: torch.Tensor, dim: int, largest: bool
    ) -> None:
        """Count the rows where ``forced`` differs from ``own``; report those that are not a tie."""
        if forced.numel() == 0:  # a top-0 (glm5_next's indexer when nothing is to select) decides nothing
            return
        with torch.no_grad():
            k = forced.shape[dim] if forced.dim() else 1
            rows_forced, rows_own = forced.movedim(dim, -1).reshape(-1, k), own.movedim(dim, -1).reshape(-1, k)
            self.decisions += rows_forced.shape[0]
            differs = (rows_forced != rows_own).any(-1)
            count = int(differs.sum())
            if not count:
                return
            self.forced += count
            values = scores.detach().float()
            # the k scores of each choice, best first: a tie moves each by no more than the tie bound
            chosen = values.gather(dim, forced).movedim(dim, -1).reshape(-1, k).sort(-1, descending=largest).values
            best = values.gather(dim, own).movedim(dim, -1).reshape(-1, k).sort(-1, descending=largest).values
            scale = torch.maximum(chosen.abs(), best.abs()).clamp_min(torch.finfo(torch.float32).tiny)
            relative = ((chosen - best).abs() / scale).amax(-1)
            beyond = relative > self.tie_bound
            self.largest_gap = max(self.largest_gap, float(relative.amax()))
            self._non_ties += int(beyond.sum())
            for row in beyond.nonzero().flatten().tolist()[: max(0, 3 - len(self.problems))]:
                self.problems.append(
                    f"routing: at {self._where(call)}, row {row}, vanilla chose {rows_forced[row].tolist()} and "
                    f"the patched model {rows_own[row].tolist()}, whose scores differ by {float(relative[row]):.3g} "
                    f"relative: beyond a tie in {str(self.dtype).removeprefix('torch.')} (at most "
                    f"{self.tie_bound:.3g}, {self.tie_ulps:g} ulps), so the pack changes routing, not only rounding"
                )


@contextlib.contextmanager
def _intercepted(handle: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]) -> Iterator[None]:
    """Sends every ``torch.topk`` / ``Tensor.topk`` call inside the block to ``handle``.

    The functions themselves are replaced, not intercepted with a ``TorchFunctionMode``:
    the autograd engine runs a checkpointed block's recomputation with no mode active,
    and that recomputation must take the decisions its forward pass took.
    """
    function, method = torch.topk, torch.Tensor.topk

    def topk(*args: Any, **kwargs: Any) -> Any:
        return handle(function, args, kwargs)

    def tensor_topk(*args: Any, **kwargs: Any) -> Any:
        return handle(method, args, kwargs)

    setattr(torch, "topk", topk)  # noqa: B010 (mypy: a module attribute assigned a function of another type)
    setattr(torch.Tensor, "topk", tensor_topk)  # noqa: B010
    try:
        yield
    finally:
        setattr(torch, "topk", function)  # noqa: B010
        setattr(torch.Tensor, "topk", method)  # noqa: B010
