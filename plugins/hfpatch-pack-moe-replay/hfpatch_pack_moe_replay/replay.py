"""Replaying a routing: ``replay_routing`` makes a model's routers select the given experts.

The selection is forced, the scores are not: each router recomputes them from its live
weights (see ``ReplayableRouter``), so the training forward runs the rollout's experts
and the loss still trains the routers. Everything that can be checked before the
forward pass (the model was loaded with the pack, the layer count, top-k and expert ids
fit it) is checked on entering the block, so a misfit fails there, naming the layer,
rather than deep inside the model. The block only opens a scope (``scope``); the
routers do the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from .errors import LIVE, RoutingError, shape
from .routers import SELECTIONS, routers_of, unpatched_router
from .scope import OPEN, OPEN_LOCK, REPLAY, LayerReplay
from .values import Routing

__all__ = ["replay_routing"]

_PACK = "moe-replay"


@contextlib.contextmanager
def replay_routing(model: nn.Module, routing: Routing) -> Iterator[None]:
    """Make ``model``'s routers select the experts of ``routing`` inside the block.

    Only ``model``'s routers and only the current thread (and context) are affected; the
    block leaves nothing behind, also when it raises. Each router's scores are recomputed
    from its live weights (see ``ReplayableRouter``), so ``loss.backward()`` trains
    them. With gradient checkpointing, call ``backward()`` inside the block: the
    recomputed forward must replay too (it does, also on autograd's GPU threads).

    Args:
        model: a model loaded with the ``moe-replay`` pack (``hfpatch_core.enable("moe-replay")``
            or ``HF_PATCH_PACKS``), or any module containing one.
        routing: from ``record_routing``, ``Routing.from_vllm`` or
            ``Routing.stack``, one layer per router of ``model``.

    Raises:
        RoutingError: here, when ``model`` has no replayable router or the routing's layer
            count, top-k or expert ids do not fit it; in the forward pass, when a layer
            routes another number of tokens than the routing holds.
    """
    if not isinstance(routing, Routing):
        raise RoutingError(
            f"replay_routing(model, routing): routing must be a Routing, got {type(routing).__name__}; build one "
            "with record_routing(model), Routing.from_vllm(output, model=model) or Routing(layers=...)."
        )
    unpatched = unpatched_router(model)
    if unpatched is not None:
        raise RoutingError(
            f"replay_routing: {unpatched}; load it with hfpatch_core.enable({_PACK!r}) (or "
            f"HF_PATCH_PACKS={_PACK}) before from_pretrained."
        )
    routers = routers_of(model)
    names = [name for name, _ in routers]
    if routing.num_layers != len(routers):
        raise RoutingError(
            f"replay_routing: the routing has {routing.num_layers} layers, {type(model).__name__} has "
            f"{len(routers)} MoE routers ({', '.join(names)}); pass the routing recorded on (or returned by vLLM "
            "for) this architecture, one layer per MoE layer, dense layers excluded."
        )
    plan: dict[nn.Module, LayerReplay] = {}
    for layer, ((name, router), indices) in enumerate(zip(routers, routing.layers, strict=True)):
        selection = SELECTIONS[router]
        top_k, experts = selection.top_k, selection.width
        if routing.top_k != top_k:
            raise RoutingError(
                f"replay_routing: layer {layer} ({name}) selects top_k={top_k} experts per token, so it expected "
                f"routing of shape ({routing.num_tokens}, {top_k}), got {shape(indices)}; record the routing with "
                "the same num_experts_per_tok."
            )
        highest = int(indices.max())
        if highest >= experts:
            raise RoutingError(
                f"replay_routing: layer {layer} ({name}) has {experts} experts (ids 0..{experts - 1}), the routing "
                f"names expert {highest}; pass a routing recorded on a model with this config."
            )
        live = (indices == LIVE).all(dim=1)
        plan[router] = LayerReplay(layer, name, indices, live if bool(live.any()) else None)
    outer = REPLAY.get()
    token = REPLAY.set({**outer, **plan} if outer else plan)
    with OPEN_LOCK:
        for router, replay in plan.items():
            OPEN.setdefault(router, []).append(replay)
    try:
        yield
    finally:
        REPLAY.reset(token)
        with OPEN_LOCK:
            for router, replay in plan.items():
                owners = OPEN[router]
                owners.remove(replay)
                if not owners:
                    del OPEN[router]
