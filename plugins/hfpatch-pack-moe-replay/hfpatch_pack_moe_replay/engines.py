"""Where a model's routers sit among its decoder layers: what an inference engine's per-layer slots map to.

vLLM and SGLang report a slot of ``routed_experts`` for **every** decoder layer (a dense layer's is
zeros); a ``Routing`` holds one layer per router. So ``Routing.from_vllm`` / ``from_sglang`` /
``to_vllm`` (``values``, reading the arrays with ``wire``) need the model's ``DecoderLayout``: found
here from the routers ``routers_of`` finds and the module list that holds them, not from a table of
model types.

``values`` sits below the routers, so it does not import this module: the package's ``__init__``
hands it ``decoder_layout`` (``values.read_layouts_with``).
"""

from __future__ import annotations

import torch.nn as nn

from .errors import RoutingError
from .routers import SELECTIONS, routers_of
from .wire import DecoderLayout

__all__ = ["DecoderLayout", "decoder_layout"]


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """Which decoder layer each router of ``model`` sits in.

    The routers are those ``routers_of`` finds (the pack's discovery: the module that selects the
    experts, whatever the family calls it); their decoder layers are the module list that holds
    them all (``model.layers``, ``language_model.layers``, ...), each router's index in it.

    Raises:
        RoutingError: as ``routers_of``; the routers are not all in one module list of layers, two
            routers sit in one layer, or they select different numbers of experts.
    """
    routers = routers_of(model)
    modules = dict(model.named_modules())
    names = [name for name, _ in routers]
    container = _layer_list(names, modules)
    if container is None:
        raise RoutingError(
            f"{type(model).__name__}: its routers ({', '.join(names)}) are not all in one list of decoder layers, "
            "so the engine's per-layer slots cannot be matched to them."
        )
    prefix, layers = container
    moe_layers = tuple(int(name[len(prefix) + 1 :].split(".", 1)[0]) for name in names)
    if len(set(moe_layers)) != len(moe_layers):
        raise RoutingError(
            f"{type(model).__name__}: several routers sit in one decoder layer ({', '.join(names)}); an engine "
            "reports one routing per decoder layer."
        )
    selections = [SELECTIONS[router] for _, router in routers]
    top_ks = {selection.top_k for selection in selections}
    if len(top_ks) != 1:
        raise RoutingError(
            f"{type(model).__name__}: its routers select {sorted(top_ks)} experts per token; a Routing has one top_k."
        )
    return DecoderLayout(
        model=type(model).__name__,
        num_layers=len(layers),
        moe_layers=moe_layers,
        router_names=tuple(names),
        top_k=top_ks.pop(),
        num_experts=tuple(selection.width for selection in selections),
    )


def _layer_list(names: list[str], modules: dict[str, nn.Module]) -> tuple[str, nn.ModuleList] | None:
    """The outermost ``nn.ModuleList`` that holds every router, one per numbered child (the decoder layers)."""
    parts = names[0].split(".")
    for end in range(1, len(parts)):
        prefix = ".".join(parts[:end])
        found = modules.get(prefix)
        if not isinstance(found, nn.ModuleList):
            continue
        holds = all(
            name.startswith(prefix + ".") and name[len(prefix) + 1 :].split(".", 1)[0].isdigit() for name in names
        )
        if holds:
            return prefix, found
    return None
