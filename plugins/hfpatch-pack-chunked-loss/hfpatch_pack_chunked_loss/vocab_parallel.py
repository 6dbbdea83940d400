"""The chunked loss over a head whose rows (the vocabulary) are split over ranks for the whole step.

Transformers' tensor parallelism (``tp_plan="auto"``) shards a causal LM's head by rows: 5.25's
``colwise_gather_output`` (torch's ``ColwiseParallel(input_layouts=Replicate(),
output_layouts=Replicate())``) keeps ``lm_head.weight`` a ``DTensor`` placed ``Shard(0)`` on a 1-D
mesh, 5.3's keeps a plain tensor of this rank's rows; both feed every rank the same (replicated)
hidden states and all-gather the logits, so every rank of vanilla's step holds tokens x the whole
vocabulary, several times.  Here (Megatron's vocabulary-parallel cross-entropy, chunked over tokens)
each rank computes its rows' logits one chunk of tokens at a time, with the family's transform
(a scale and a soft-cap act element by element, so on each shard as on the whole); the ranks
all-reduce the largest logit and the sum of exponentials (the log-sum-exp) and the target's logit
(taken by the rank whose rows hold the label, 0 elsewhere), so no rank ever holds tokens x the whole
vocabulary.  The gradient of the local logits is ``softmax_local - one_hot_local``, scaled as vanilla's
reduction scales it; the hidden states' gradient is the sum over the ranks of each rank's matmul (an
all-reduce, as vanilla's ``Partial`` -> ``Replicate`` one), the weight's is this rank's rows' (5.25:
through ``DTensor.to_local``, whose backward makes it the ``Shard(0)`` gradient of the parameter).

Every rank runs every collective of a step in the same order: the chunk is agreed over the ranks
(the smallest, for the rank with the most rows), and the tokens computed (those not ignored) are the
same on every rank, as tensor parallelism requires of its inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .judge import aux_coefficient, errors, judge
from .loss import HeadTransform, WholeRows, chunked_causal_lm_loss
from .rows import DTENSOR, HeadRows, dtensor_weight, is_dtensor, rows_placed, split_refusal

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["RowSplit", "RowsSplit", "causal_lm_loss", "claim", "local_rows", "row_split"]


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """How a head's rows are split over the ranks of a tensor-parallel group.

    Attributes:
        group: the process group of the mesh the rows are split over.
        rank: this rank's place in the group (its rows come after those of lower places).
        world: the group's size.
    """

    group: Any
    rank: int
    world: int


@dataclasses.dataclass(frozen=True)
class LocalRows:
    """This rank's rows of a split head, as the loss reads a head (``weight``, ``bias``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def row_split(model: nn.Module, head: nn.Module) -> RowSplit | None:
    """The split of the head's rows when tensor parallelism splits them for the whole step, else ``None``.

    Called by ``placement`` (at the install and at each training step) for a head no FSDP2 unit holds.  A
    ``DTensor`` weight (5.25) split as ``Shard(0)`` on a 1-D mesh of more than one rank, with a bias that is
    absent or split the same way; or a plain weight with fewer rows than the head's
    ``out_features`` on the model's 1-D ``_device_mesh`` (5.3's tensor parallelism, which keeps this
    rank's rows as a plain tensor).  Anything else (``rows.split_refusal`` says why) is not one."""
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if not isinstance(weight, torch.Tensor) or not dist.is_available() or not dist.is_initialized():
        return None
    if is_dtensor(weight):
        mesh = weight.device_mesh  # type: ignore[attr-defined]
        if mesh.ndim != 1 or mesh.size() < 2 or not rows_placed(weight, mesh):
            return None
        if bias is not None and not (is_dtensor(bias) and rows_placed(bias, mesh)):
            return None
        return RowSplit(mesh.get_group(), mesh.get_local_rank(), mesh.size())
    out_features = getattr(head, "out_features", None)
    mesh = getattr(model, "_device_mesh", None)
    if not isinstance(out_features, int) or weight.ndim != 2 or weight.shape[0] >= out_features or mesh is None:
        return None
    if getattr(mesh, "ndim", 0) != 1 or mesh.size() < 2 or is_dtensor(bias):
        return None
    # 5.3's get_tensor_shard: ceil(rows / world) rows a rank, the last one the rest
    world, rank = mesh.size(), mesh.get_local_rank()
    block = -(-out_features // world)
    if weight.shape[0] != max(0, min(block, out_features - rank * block)):
        return None
    if bias is not None and bias.shape != weight.shape[:1]:
        return None
    return RowSplit(mesh.get_group(), rank, world)


def local_rows(head: nn.Linear, split: RowSplit | None) -> Any:
    """What the loss reads as the head: the head itself when its rows are not split; this rank's rows
    otherwise (5.25: ``DTensor.to_local``, differentiable: the gradient it receives becomes the
    parameter's ``Shard(0)`` gradient)."""
    if split is None:
        return head

    def local(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor.to_local() if tensor is not None and is_dtensor(tensor) else tensor  # type: ignore[attr-defined]

    weight = local(head.weight)
    assert weight is not None
    return LocalRows(weight, local(head.bias))


def _agree(split: RowSplit, rows: int, chunk: int, device: torch.device) -> tuple[int, int, int]:
    """Every rank's count of rows and the smallest chunk, in one all-reduce: this rank's first row, the whole
    vocabulary and the chunk every rank loops with (so that every rank runs as many chunks)."""
    values = torch.zeros(split.world + 1, dtype=torch.int64, device=device)
    values[split.rank] = rows
    values[split.world] = -chunk
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=split.group)
    sizes = values[: split.world].tolist()
    return sum(sizes[: split.rank]), sum(sizes), -int(values[split.world])


def _chunk_losses_and_gradient_(
    logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, split: RowSplit
) -> torch.Tensor:
    """A chunk's float32 local logits become, in place, ``softmax_local - one_hot_local``; returns its losses.

    Two all-reduces: the largest logit of each token (for the exponentials), then the sums of the
    exponentials and the target's logit (0 on the ranks that do not hold it)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    mine = rows[owned]
    target = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    target[mine] = logits[mine, local_targets[owned]]
    largest = logits.amax(1)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=split.group)
    logits.sub_(largest.unsqueeze(1)).exp_()
    sums = torch.stack((logits.sum(1), target))
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=split.group)
    total, target = sums[0], sums[1]
    logits.div_(total.unsqueeze(1))
    logits[mine, local_targets[owned]] -= 1
    # vanilla's log_softmax, x - max - log(sum(exp(x - max))), at the target
    return -((target - largest) - torch.log(total))


class SplitRows(WholeRows):
    """A rank's share of the vocabulary for ``loss.chunked_causal_lm_loss``: the chunk agreed over the
    ranks, each chunk's losses from the ranks' all-reduced log-sum-exp and target logit, and the hidden
    states' gradient summed over the ranks (each rank's matmul covers its rows)."""

    def __init__(self, split: RowSplit) -> None:
        self.split = split

    def agree(self, rows: int, chunk: int, device: torch.device) -> tuple[int, int]:
        self.offset, vocab, chunk = _agree(self.split, rows, chunk, device)
        self.rows = rows
        return vocab, chunk

    def targets(self, kept: torch.Tensor) -> None:
        self.local = kept - self.offset
        self.owned = (self.local >= 0) & (self.local < self.rows)

    def losses_(self, logits: torch.Tensor, part: slice, losses: torch.Tensor) -> None:
        losses.copy_(_chunk_losses_and_gradient_(logits, self.local[part], self.owned[part], self.split))

    def hidden_(self, grad: torch.Tensor) -> None:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.split.group)


def causal_lm_loss(
    hidden: torch.Tensor,
    head: Any,
    labels: torch.Tensor | None,
    transform: HeadTransform,
    *,
    split: RowSplit | None,
    chunk: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """``loss.chunked_causal_lm_loss`` when ``split`` is ``None``; over this rank's rows ``head``
    (``local_rows``) otherwise, the same loss on every rank of the split's group.

    Called by the installed forward, on every rank of the group alike (it runs collectives).

    Returns:
        The scalar float32 loss, differentiable with respect to ``hidden`` and the head's rows.

    Raises:
        ValueError: neither ``labels`` nor ``shift_labels`` is given.
        IndexError: a label outside the vocabulary that is not ``ignore_index``.
    """
    return chunked_causal_lm_loss(
        hidden,
        head,
        labels,
        transform,
        chunk=chunk,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        shift_labels=shift_labels,
        over=None if split is None else SplitRows(split),
    )


def _max_over(split: RowSplit, values: list[float], device: torch.device) -> list[float]:
    # on the device the group's backend reduces (NCCL: the GPU)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=split.group)
    return [float(v) for v in tensor]


def _gather_columns(local: torch.Tensor, split: RowSplit) -> torch.Tensor:
    """The ranks' column blocks of a (tokens x rows) tensor side by side, in rank order (blocks of
    unequal width padded for the all-gather)."""
    widths = torch.zeros(split.world, dtype=torch.int64, device=local.device)
    widths[split.rank] = local.shape[1]
    dist.all_reduce(widths, op=dist.ReduceOp.SUM, group=split.group)
    widest = int(widths.max())
    padded = nn.functional.pad(local, (0, widest - local.shape[1])).contiguous()
    blocks = [torch.empty_like(padded) for _ in range(split.world)]
    dist.all_gather(blocks, padded, group=split.group)
    return torch.cat([block[:, : int(width)] for block, width in zip(blocks, widths.tolist(), strict=True)], 1)


class RowsSplit(HeadRows):
    """The head's rows split over the ranks of a tensor-parallel group for the whole step (``HeadRows``): each
    rank reads its rows (``local_rows``), a chunk's losses come from the ranks' all-reduced log-sum-exp
    (``SplitRows``), and the probe compares over the ranks (``compare``)."""

    name = "tensor-parallel rows"

    def __init__(self, split: RowSplit | None, sharded: str | None = None, refusal: str | None = None) -> None:
        super().__init__(sharded, refusal)
        self.split = split  # None where refused

    def readable(self, head: nn.Module) -> bool:
        """Always: the rows stay split, where the loss reads them, for the whole step."""
        return True

    @contextlib.contextmanager
    def reading(self, head: nn.Module) -> Iterator[tuple[Any, WholeRows]]:
        """This rank's rows of the head, and the vocabulary-parallel reduction of each chunk."""
        assert self.split is not None
        yield local_rows(head, self.split), SplitRows(self.split)  # type: ignore[arg-type]

    def compare(
        self,
        model: nn.Module,
        head: nn.Linear,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        loss: torch.Tensor,
        out: Any,
        weight: torch.Tensor,
        transform: HeadTransform,
    ) -> str | None:
        """The install's probe (``compare.compare_with_vanilla``) on a split head: vanilla's tensor-parallel
        loss and gradients (``loss`` computed by the model from ``hidden``; ``weight`` the parameter the
        head's forward read) against the vocabulary-parallel loss's, both measured against float64.

        The float64 reference is the single-process loss: the probe's 4 tokens' logits, all-gathered (4 x the
        vocabulary), through the family's transform and ``cross_entropy``; its gradient of the hidden states
        the sum over ranks of each rank's rows' product, its gradient of the weight this rank's rows'.  Each
        error is the largest over the ranks (an all-reduce), so every rank takes the same decision: one that
        installed and one that refused would run different collectives in the next step.

        Returns the path of the auxiliary loss's coefficient (``Installed.aux_loss_coefficient``).

        Raises:
            ChunkedLossRefused: as ``compare.compare_with_vanilla`` does, on every rank alike.
        """
        split = self.split
        assert split is not None
        rows = local_rows(head, split)
        wants_weight = weight.requires_grad
        wanted = [hidden, weight] if wants_weight else [hidden]
        vanilla = list(torch.autograd.grad(loss, wanted))
        if wants_weight and is_dtensor(vanilla[1]):
            vanilla[1] = vanilla[1].to_local()  # type: ignore[attr-defined]
        # chunk 1: every chunk boundary the probe has, so a wrong accumulation shows
        ours_loss = causal_lm_loss(hidden, rows, labels, transform, split=split, chunk=1)
        mine = [hidden, rows.weight] if wants_weight else [hidden]
        ours = torch.autograd.grad(ours_loss, mine)
        vanilla_value, ours_value = _max_over(split, [float(loss.detach()), float(ours_loss.detach())], hidden.device)
        h = hidden.detach().reshape(-1, hidden.shape[-1]).double()
        targets = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(h.device)
        w = rows.weight.detach().double()
        b = None if rows.bias is None else rows.bias.detach().double()
        local_logits = nn.functional.linear(h, w, b)
        offset, _, _ = _agree(split, w.shape[0], 1, h.device)
        logits = _gather_columns(local_logits, split).requires_grad_(True)
        with torch.enable_grad():
            reference_loss = nn.functional.cross_entropy(transform(logits), targets, ignore_index=-100)
            (grad_logits,) = torch.autograd.grad(reference_loss, logits)
        mine_logits = grad_logits[:, offset : offset + w.shape[0]]
        reference_hidden = mine_logits @ w
        dist.all_reduce(reference_hidden, op=dist.ReduceOp.SUM, group=split.group)
        # one token at a time in the head's dtype, summed over the ranks: the order of a one-token chunk
        local_weight = rows.weight.detach()
        by_token = torch.cat([mine_logits[i : i + 1].to(local_weight.dtype) @ local_weight for i in range(h.shape[0])])
        dist.all_reduce(by_token, op=dist.ReduceOp.SUM, group=split.group)
        # the reference's collectives first, then the judgement (every rank alike)
        aux = getattr(out, "aux_loss", None)
        coefficient, ours_total = aux_coefficient(
            model, torch.tensor(vanilla_value, dtype=torch.float32), torch.tensor(ours_value, dtype=torch.float32), aux
        )
        if aux is not None and coefficient is not None:
            reference_loss = reference_loss + operator.attrgetter(coefficient)(model) * aux.detach().double()

        def judged(
            name: str, found: tuple[float, float, float], calibration: Callable[[], float] | None = None
        ) -> None:
            vanilla_error, our_error, scale = found
            if calibration is not None:
                vanilla_error = max(vanilla_error, calibration())
            agreed = _max_over(split, [vanilla_error, our_error, scale], hidden.device)
            judge(name, agreed[0], agreed[1], agreed[2], hidden.dtype)

        judged("loss", errors(torch.tensor(vanilla_value), ours_total, reference_loss.detach()))
        judged(
            "hidden-state gradient",
            errors(vanilla[0], ours[0], reference_hidden.reshape(hidden.shape)),
            lambda: float((by_token.double() - reference_hidden).abs().max()),
        )
        if wants_weight:
            judged("head gradient", errors(vanilla[1], ours[1], mine_logits.T @ h))
        return coefficient


def claim(model: nn.Module, head: nn.Module) -> RowsSplit | None:
    """``RowsSplit`` when the head's rows are split over the ranks (``row_split``); for a ``DTensor`` head split
    otherwise (no FSDP2 unit holds it: ``placement`` asks ``fsdp2`` first), a ``RowsSplit`` refused with how it
    is placed; else ``None``."""
    dtensor = dtensor_weight(head)
    weight = getattr(head, "weight", None)
    # a rank with no rows of a plain head is an empty weight, which no reader reads (``zero3.claim`` refuses it)
    split = row_split(model, head) if dtensor or (isinstance(weight, torch.Tensor) and weight.numel()) else None
    if split is not None:
        return RowsSplit(split, DTENSOR if dtensor else None)
    if not dtensor:
        return None
    refusal = (
        f"{DTENSOR}, outside any FSDP2 unit (so sharded for the whole step, as tensor parallelism shards it), "
        f"and {split_refusal(model, head)}: the vocabulary-parallel loss reads a head whose rows are split over "
        "a 1-D mesh of ranks (Shard(0)), as tp_plan='auto' shards it"
    )
    return RowsSplit(None, DTENSOR, refusal)
