"""hfpatch pack ``moe-replay``: record MoE expert routing and replay it in a later forward pass.

RLHF-style training of a Mixture-of-Experts policy scores tokens that an inference
engine generated; small numerical differences flip the router's top-k for some tokens,
and the training forward then runs experts the rollout never used. Routing replay (R3)
records the selection during generation and forces it in the training forward, while
the routing scores still come from the live router weights, so the router keeps
training.

While an MoE model loads, this pack replaces the class that selects its experts, found
by what it computes (``discover``), with a subclass (``ReplayableRouter``) that behaves
as the original unless ``replay_routing`` (or ``record_routing``) is active. The API::

    from hfpatch_pack_moe_replay import Routing, record_routing, replay_routing

    with torch.no_grad(), record_routing(model) as recording:
        sequences = model.generate(**inputs, max_new_tokens=64)
    routing = recording.routing.padded(sequences.shape[1])   # or Routing.from_vllm(output, model=model)
    with replay_routing(model, routing):
        loss = loss_fn(model(sequences, attention_mask=mask).logits)
        loss.backward()

The modules, each importing only those before it (the pack's pyproject holds the layers,
``make lint`` checks them): ``errors`` (``RoutingError``, ``LIVE``), ``wire`` (vLLM's and
SGLang's arrays, read against a model's decoder layout), ``values`` (the ``Routing`` value),
``scope`` (which replay each router is under), ``selection`` (the mode that answers a
router's selection ``topk``), ``sites`` (where a model type's candidate routers sit),
``probe`` (what a candidate computes), ``discovery`` (which class routes: ``discover``),
``routers`` (the replayable routers), ``replay`` (``replay_routing``), ``recording``
(``record_routing``) and ``engines`` (where a model's routers sit among its decoder layers,
which this module hands ``values`` for ``Routing.from_vllm``). ``trl`` (routing replay in TRL's
``GRPOTrainer``: ``RoutingReplayMixin``, ``ReplayGRPOTrainer``) uses them and is not
imported here: it is the one module that knows trl.
"""

from __future__ import annotations

from collections.abc import Iterator

import hfpatch_core
from hfpatch_core import LoadContext, Patch, Refusal

from .discovery import Discovery, RouterFamily, discover, moe_model_types
from .engines import decoder_layout
from .recording import RoutingRecording, record_routing
from .replay import replay_routing
from .routers import ReplayableRouter, discovery_of, replayable_class, routers_of
from .values import LIVE, Routing, RoutingError, read_layouts_with

# Routing.from_vllm / from_sglang / to_vllm(model=...) read where the model's routers sit among its
# decoder layers: engines reads it from the routers, which sit above values, so it is handed down here.
read_layouts_with(decoder_layout)

__version__ = "0.2.0"

__all__ = [
    "LIVE",
    "Discovery",
    "ReplayableRouter",
    "RouterFamily",
    "Routing",
    "RoutingError",
    "RoutingRecording",
    "__version__",
    "discover",
    "discovery_of",
    "moe_model_types",
    "provide_model_types",
    "provide_patches",
    "record_routing",
    "replay_routing",
    "replayable_class",
    "routers_of",
]


@hfpatch_core.hookimpl
def provide_patches(context: LoadContext) -> list[Patch | Refusal]:
    """The router patches for a load of a replayable model type, else nothing.

    Which class routes, and whether its selection can be replayed exactly, is found by
    ``discover`` from the load's config (probed once per config). The replacement keeps
    the router's parameters, so checkpoints load and save unchanged: this pack has no
    weight-layout change and implements no ``provide_converters``. Without a config
    (``hfpatch check`` asks every model type that way first) it returns nothing and
    ``provide_model_types`` names the model types it replays.
    """
    if context.model_type is None or context.config is None:
        return []
    found = discover(context.model_type, context.config)
    if found.refused is not None and found.candidate is not None:
        # a router the pack found and cannot replay exactly: said in explain and check, not silently skipped
        return [Refusal(found.candidate, found.refused)]
    return [Patch(family.router_class.__name__, replayable_class(family.router_class)) for family in found.routers]


@hfpatch_core.hookimpl
def provide_model_types() -> Iterator[str]:
    """The MoE model types of the causal-LM mapping the pack replays with their default config."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    for model_type in moe_model_types():
        # a text sub-model type (llama4_text) has its parent's modeling module, where check finds no class of it
        if model_type_to_module_name(model_type) == model_type and discover(model_type).replayable:
            yield model_type
