"""The pack's replayable routers, and where a model's routers are.

While a model of a replayable model type loads (``discovery`` says which, and which of its
classes routes), the pack replaces each router class with a subclass of it
(``ReplayableRouter`` plus the original, made once per class by ``replayable_class``) that
keeps the original's constructor, parameters and outputs, so checkpoints load unchanged
and the forward is the original's, bit for bit, outside a replay. Inside one (or a
recording) the original forward runs under ``SelectionMode``, which answers its selection
``topk`` with the replayed experts (and tells the recordings what was selected).

The router finds its replay in ``scope`` (which ``replay_routing`` fills), so this module
does not import the replay: ``scope`` <- ``selection`` <- ``discovery`` <-
``routers`` <- ``replay`` / ``recording``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, ClassVar

import torch.nn as nn

from hfpatch_core.authoring import runtime_class

from .discovery import Discovery, discover
from .errors import RoutingError
from .scope import replay_of
from .selection import Selection, SelectionMode, recordings

__all__ = ["SELECTIONS", "ReplayableRouter", "discovery_of", "replayable_class", "routers_of", "unpatched_router"]

# The selection of each router of a model that ``routers_of`` found (what its forward intercepts).
SELECTIONS: weakref.WeakKeyDictionary[nn.Module, Selection] = weakref.WeakKeyDictionary()


def _listening(router: nn.Module) -> bool:
    return any(router in recording._layers for recording in recordings())


class ReplayableRouter(nn.Module):
    """Mixin of the pack's routers: the parent's router, plus the replay of a selection.

    A subclass derives from this class and one transformers router class (a ``*TopKRouter``,
    ``Llama4Router``, ... or an MoE block that selects itself), keeping its constructor,
    parameters and forward contract. Outside ``replay_routing`` and ``record_routing`` the
    forward is the parent's. During a replay the parent's forward runs with its selection
    ``topk`` answered by the replayed experts (the live top-k for ``LIVE`` rows) and the values
    its input holds at them: every routing weight the family computes from there (softmax or
    sigmoid scores of the live logits at those experts, renormalised, scaled; the correction
    bias only ever selected) is the parent's own code on the live weights, so gradients
    reach the router.

    transformers' hub kernels would replace this forward (``kernel_layer_name`` of the parent,
    qwen3.5's ``SoftmaxTopKRouter``): the pack's routers opt out, since a kernel cannot replay.
    """

    #: The transformers class this one replays (set for each subclass).
    original: ClassVar[type[nn.Module]]
    kernel_condition = staticmethod(lambda module: False)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        parents = [base for base in cls.__bases__ if base is not ReplayableRouter]
        if parents:
            cls.original = parents[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        replay = replay_of(self)  # in a recomputation: what this forward pass replayed (scope)
        if replay is None and not _listening(self):
            return super().forward(*args, **kwargs)
        selection = SELECTIONS.get(self)
        if selection is None:
            raise RoutingError(
                f"{type(self).__name__}: replay_routing / record_routing was given a module that holds this router "
                "but no config of its model; pass the model (or its base model) itself."
            )
        with SelectionMode(self, selection, replay):
            return super().forward(*args, **kwargs)


_classes: dict[type[nn.Module], type[ReplayableRouter]] = {}
_classes_lock = threading.Lock()


def replayable_class(original: type[nn.Module]) -> type[ReplayableRouter]:
    """The pack's replacement of router class ``original`` (one class per original)."""
    with _classes_lock:
        found = _classes.get(original)
        if found is None:
            name = f"Replayable{original.__name__}"
            # built at runtime, so it pickles as this call (torch.save of a whole model, a worker's copy)
            found = _classes[original] = runtime_class(
                name,
                (ReplayableRouter, original),
                {"__doc__": f"``{original.__name__}`` with routing replay (see ``ReplayableRouter``)."},
                module=__name__,
                rebuild=replayable_class,
                arguments=(original,),
            )
        return found


def _config_of(model: nn.Module) -> Any:
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "model_type", None):
            return config
    return None


def discovery_of(model: nn.Module) -> Discovery | None:
    """What ``discovery.discover`` says of ``model``'s model type and config (``None``: no config)."""
    config = _config_of(model)
    return None if config is None else discover(config.model_type, config)


def routers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every router of ``model``, in module order.

    Raises:
        RoutingError: ``model`` has no config, its model type is refused (the message says
            why), or it has no router of the classes discovered for it.
    """
    found_discovery = discovery_of(model)
    if found_discovery is None:
        raise RoutingError(
            f"{type(model).__name__} holds no transformers config, so hfpatch-pack-moe-replay cannot tell its "
            "routers; pass the model (or its base model)."
        )
    if not found_discovery.replayable:
        raise RoutingError(
            f"hfpatch-pack-moe-replay cannot replay the routing of {found_discovery.model_type} models: "
            f"{found_discovery.refused}."
        )
    families = {family.router_class: family for family in found_discovery.routers}
    found = []
    for name, module in model.named_modules():
        for router_class, family in families.items():
            if isinstance(module, router_class):
                found.append((name, module))
                SELECTIONS[module] = family.selection
                break
    if not found:
        classes = ", ".join(sorted(router_class.__name__ for router_class in families))
        raise RoutingError(
            f"{type(model).__name__} ({found_discovery.model_type}) has no MoE router ({classes}) in this "
            "configuration (no sparse layer?); pass an MoE model."
        )
    return found


def unpatched_router(model: nn.Module) -> str | None:
    """Why ``model``'s routers cannot replay because it was loaded without the pack (naming its first
    vanilla router and that router's class), or ``None`` when every router is the pack's.

    Raises:
        RoutingError: as ``routers_of``.
    """
    for name, router in routers_of(model):
        if not isinstance(router, ReplayableRouter):
            kind = type(router).__name__
            return f"{type(model).__name__} was loaded without the moe-replay pack (router {name} is {kind})"
    return None
