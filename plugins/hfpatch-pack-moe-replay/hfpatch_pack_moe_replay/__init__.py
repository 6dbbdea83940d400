"""hfpatch pack ``moe-replay``: record MoE expert routing and replay it in a later forward pass.

RLHF-style training of a Mixture-of-Experts policy scores tokens that an inference
engine generated; small numerical differences flip the router's top-k for some tokens,
and the training forward then runs experts the rollout never used. Routing replay (R3)
records the selection during generation and forces it in the training forward, while
the routing scores still come from the live router weights, so the router keeps
training.

While a model of a covered family loads, this pack replaces its ``*TopKRouter`` with a
subclass (``ReplayableRouter``) that behaves as the
original unless ``replay_routing`` is active. The API::

    from hfpatch_pack_moe_replay import Routing, record_routing, replay_routing

    with torch.no_grad(), record_routing(model) as recording:
        sequences = model.generate(**inputs, max_new_tokens=64)
    routing = recording.routing.padded(sequences.shape[1])   # or Routing.from_vllm(...)
    with replay_routing(model, routing):
        loss = loss_fn(model(sequences, attention_mask=mask).logits)
        loss.backward()

The modules, each importing only those before it: ``values`` (the ``Routing`` value,
vLLM's layout, ``RoutingError``), ``scope`` (which replay each router is under),
``routers`` (the replayable routers), ``replay`` (``replay_routing``) and ``recording``
(``record_routing``).
"""

from __future__ import annotations

import dataclasses

import hfpatch_core
from hfpatch_core import LoadContext, Patch

from .recording import RoutingRecording, record_routing
from .replay import replay_routing
from .routers import REPLAYABLE_ROUTERS, ReplayableRouter, routers_of
from .values import LIVE, Routing, RoutingError

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "LIVE",
    "Family",
    "ReplayableRouter",
    "Routing",
    "RoutingError",
    "RoutingRecording",
    "__version__",
    "provide_patches",
    "record_routing",
    "replay_routing",
    "routers_of",
]


@dataclasses.dataclass(frozen=True)
class Family:
    """What the pack replaces in one model type.

    Attributes:
        router: the exact class name of the family's top-k router.
        replayable: the pack's subclass of it.
    """

    router: str
    replayable: type[ReplayableRouter]


#: The model types this pack patches: those whose router returns
#: ``(router_logits, router_scores, router_indices)`` from a softmax top-k over
#: ``hidden_states.reshape(-1, hidden)`` in transformers 5.3 and 5.24.
FAMILIES: dict[str, Family] = {
    model_type: Family(router.original.__name__, router) for model_type, router in REPLAYABLE_ROUTERS.items()
}


@hfpatch_core.hookimpl
def provide_patches(context: LoadContext) -> list[Patch]:
    """The router patch for a load of a covered model type (see ``FAMILIES``), else nothing.

    The replacement keeps the router's parameter (``weight``, ``(num_experts, hidden)``),
    so checkpoints load and save unchanged: this pack has no weight-layout change and
    implements no ``provide_converters``. It needs no config, so ``hfpatch check`` and
    ``hfpatch explain`` see the same patch as a load.
    """
    family = FAMILIES.get(context.model_type or "")
    if family is None:
        return []
    return [Patch(family.router, family.replayable)]
