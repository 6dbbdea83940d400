"""The chunked loss on a head that DeepSpeed ZeRO-3 partitions.

Under ZeRO-3 each rank holds a slice of every parameter (``ds_tensor``) and an empty placeholder
as its data; DeepSpeed's hooks all-gather a module's parameters before its forward and backward
and partition them again after.  The chunked loss reads the head's weight without calling the
head, so no hook gathers it: a training step gathers the head once, around the whole chunked
loss (``gathered``, ``deepspeed.zero.GatheredParameters`` without a modifier rank, the way TRL's
``maybe_gather_lm_head_ctx`` does for its fused head).  The loss computes the head's gradient in
its forward, whole, and hands it to autograd in the backward: it reaches the parameter's
``AccumulateGrad`` like the gradient of vanilla's head matmul, where ZeRO-3's gradient hook
reduce-scatters it into the rank's partition.  The step runs inside the model's forward (the
installed forward is the model's ``forward``), where DeepSpeed's hooks on the model expect it.
Tied embeddings are one parameter: the embedding's gradient and the head's add up before the hook.

The step's forward still calls the head on the last position (``logits_to_keep=1``), which
DeepSpeed gathers as it gathers vanilla's head; the backward does not gather the head again (the
chunked loss keeps no reference to the weight), so the head is all-gathered twice per step, as in
vanilla's step (forward and backward).

``install``'s probe runs the model's forward before ``deepspeed.initialize`` (a model built under
``zero.Init`` by ``from_pretrained`` has partitioned parameters and no DeepSpeed hooks yet):
``probing`` holds the head gathered for the whole probe and gathers every other module's own
parameters around its forward, one module at a time, as DeepSpeed's hooks would.  Every rank runs
the same probe on the same inputs, so every rank makes the same collectives.

DeepSpeed is imported only where a parameter is partitioned: the pack does not require it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .errors import ChunkedLossRefused
from .loss import WholeRows
from .rows import HeadRows, is_dtensor

__all__ = [
    "ZeRO3",
    "claim",
    "full_rows",
    "gathered",
    "is_partitioned",
    "needs_gathering",
    "partitioned_head",
    "probing",
]


class ZeRO3(HeadRows):
    """A head DeepSpeed ZeRO-3 partitions (``HeadRows``): the probe runs with the model gathered module by
    module (``probing``), and each computation of the loss gathers the head once around it (``gathered``)."""

    name = "zero3"

    def probing(self, model: nn.Module, head: nn.Module) -> contextlib.AbstractContextManager[None]:
        """``probing``, where the probe runs (not refused)."""
        return contextlib.nullcontext() if self.refusal is not None else probing(model, head)

    def readable(self, head: nn.Module) -> bool:
        """Always: the step gathers the head around the loss, which reads it then."""
        return True

    @contextlib.contextmanager
    def reading(self, head: nn.Module) -> Iterator[tuple[Any, WholeRows]]:
        """The head, gathered for the whole computation."""
        with gathered(head.parameters(recurse=False)):
            yield head, WholeRows()


def is_partitioned(parameter: Any) -> bool:
    """Whether ``parameter`` is a ZeRO-3 parameter that is not gathered now (its data a placeholder)."""
    status = getattr(parameter, "ds_status", None)
    # ZeroParamStatus, read by name: the check must not import deepspeed
    return hasattr(parameter, "ds_id") and getattr(status, "name", None) != "AVAILABLE"


def partitioned_head(head: nn.Module) -> bool:
    """Whether the head's weight or bias is partitioned by ZeRO-3 now."""
    return any(is_partitioned(getattr(head, name, None)) for name in ("weight", "bias"))


def full_rows(weight: torch.Tensor) -> int:
    """The head's vocabulary: the first dimension of its whole weight (``ds_shape`` where it is partitioned)."""
    shape = getattr(weight, "ds_shape", None) if is_partitioned(weight) else None
    return int((shape if shape is not None else weight.shape)[0])


def needs_gathering(model: nn.Module) -> bool:
    """Whether the probe must run under ``probing``: a parameter is partitioned."""
    return any(is_partitioned(p) for p in model.parameters())


@contextlib.contextmanager
def gathered(parameters: Iterable[Any]) -> Iterator[None]:
    """Gather the partitioned ones of ``parameters`` (a collective: on every rank), partition them again on exit.

    Parameters already whole (gathered by DeepSpeed's hooks for a module that runs, or persistent)
    are left as they are: partitioning them on exit would pull them from under their module.
    """
    unique = {id(p): p for p in parameters if p is not None and is_partitioned(p)}
    if not unique:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(unique.values()), modifier_rank=None):
        yield


@contextlib.contextmanager
def probing(model: nn.Module, head: nn.Module) -> Iterator[None]:
    """Make a partitioned model's forward runnable for ``install``'s probe.

    The head's parameters stay gathered until the exit (the probe reads the weight after the
    forward, and vanilla's backward through the head needs it); every other module's own partitioned
    parameters are gathered in a forward pre-hook and partitioned in its forward hook, so at most one
    module's parameters and the head are whole at a time.  A module whose forward raised is
    partitioned again at the exit.
    """
    if any(hasattr(module, "ds_id") for module in model.modules()):
        # DeepSpeed's hooks gather and release each module as it runs (the head too, in the probe's
        # forward, from under the probe's own gather): the probe cannot hold the head whole there
        raise ChunkedLossRefused(
            "the model is already run by a DeepSpeed ZeRO-3 engine (deepspeed.initialize, Trainer.train): install "
            "the chunked loss before, at the load (HF_PATCH_PACKS=chunked-loss) or with install(model) before "
            "deepspeed.initialize or Trainer.train"
        )
    held: dict[int, list[contextlib.ExitStack]] = {}

    def before(module: nn.Module, args: Any) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(gathered(module.parameters(recurse=False)))
        held.setdefault(id(module), []).append(stack)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        stacks = held.get(id(module))
        if stacks:
            stacks.pop().close()

    with gathered(head.parameters(recurse=False)):
        handles = []
        try:
            for module in model.modules():
                if module is not head:
                    handles.append(module.register_forward_pre_hook(before, prepend=True))
                    handles.append(module.register_forward_hook(after))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for stacks in held.values():
                while stacks:
                    stacks.pop().close()


def claim(model: nn.Module, head: Any, *, whole_model: bool = True) -> ZeRO3 | None:
    """``ZeRO3`` for a model with partitioned parameters and a linear head (``whole_model``: any parameter of
    the model, the probe's case; else the head's own, a step's); a ``ZeRO3`` refused where the head's weight is
    empty or partitioned otherwise (or its bias alone a ``DTensor``); else ``None``.  Asked last by
    ``placement``, after the ``DTensor`` layouts."""
    if isinstance(head, nn.Linear) and (needs_gathering(model) if whole_model else partitioned_head(head)):
        return ZeRO3()
    for parameter in (getattr(head, "weight", None), getattr(head, "bias", None)):
        if parameter is None:
            continue
        if is_dtensor(parameter):
            sharded = "the LM head's weight is a DTensor (FSDP2 or tensor parallelism)"
        elif is_partitioned(parameter) or parameter.numel() == 0:
            # ZeRO-3 leaves each rank an empty tensor and the shape in ds_shape, outside a gather
            sharded = (
                f"the LM head's weight is partitioned (DeepSpeed ZeRO-3: local shape {tuple(parameter.shape)}, "
                f"whole {tuple(getattr(parameter, 'ds_shape', ()))})"
            )
        else:
            continue
        return ZeRO3(sharded, f"{sharded}: the chunked loss over a partitioned head is not written")
    return None
