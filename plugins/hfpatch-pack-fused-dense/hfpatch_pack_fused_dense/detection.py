"""Finding the projections to fuse, structurally, on the meta device.

For a config, every decoder layer of the model is built on the meta device (no memory,
no initialisation; about 0.5 ms a layer) and each module in it is checked for one of
the two layouts the pack fuses:

* **attention**: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, each exactly an
  ``nn.Linear``; q/k/v read the same input size and all have a bias or none does;
  ``k_proj`` and ``v_proj`` have the same output size; q and k/v outputs are whole heads
  of ``module.head_dim``; ``o_proj`` reads what ``q_proj`` writes; and if there are
  ``q_norm`` / ``k_norm``, both normalise one head (``[head_dim]`` weights);
* **MLP**: ``gate_proj``, ``up_proj``, ``down_proj``, each exactly an ``nn.Linear``, and
  an ``act_fn``; gate and up have the same input and output sizes and the same bias
  setting, and ``down_proj`` reads what they write.

A module that has some of these projections but not that layout (a cross-attention
whose ``k_proj`` reads another width, a q-only bias, a ``q_proj`` that is a quantized or
adapter wrapper, a norm over all heads at once) is *rejected*, with the reason, and so
is its class.  Sizes are read from the built modules, so the converters get exactly the
sizes the installed transformers builds.

Results are cached by decoder-layer class and the config's content (a ``to_dict`` dump,
about 0.05 ms), so repeated loads of one model pay for the build once.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
import torch.nn as nn

Kind = Literal["attention", "mlp"]

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Site:
    """One fusable module, as found in the decoder layers.

    Attributes:
        path: the module's path inside its decoder layer (``"self_attn"``,
            ``"mlp.shared_expert"``): the converters' patterns start with it.
        kind: ``"attention"`` or ``"mlp"``.
        class_name: the module's class name (the patch target).
        sizes: the output sizes of the fused parts, in fused order: ``(q, k, v)`` or
            ``(gate, up)``.
        bias: whether the fused parts have a bias.
        qk_norm: for an attention, whether it has per-head ``q_norm`` / ``k_norm``.
    """

    path: str
    kind: Kind
    class_name: str
    sizes: tuple[int, ...]
    bias: bool
    qk_norm: bool = False


@dataclasses.dataclass(frozen=True)
class Detection:
    """What ``detect`` found in a model's decoder layers.

    Attributes:
        sites: one per (class, path) that is fusable in every layer it occurs in.
        rejected: class name -> why its modules are not fused (the first problem found).
    """

    sites: tuple[Site, ...] = ()
    rejected: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def classes(self, kind: Kind | None = None) -> dict[str, tuple[Site, ...]]:
        """Fusable class name -> its sites (of ``kind`` only, when given), in layer order."""
        found: dict[str, list[Site]] = {}
        for site in self.sites:
            if kind is None or site.kind == kind:
                found.setdefault(site.class_name, []).append(site)
        return {name: tuple(sites) for name, sites in found.items()}


def _children(module: nn.Module, names: Iterable[str]) -> dict[str, Any]:
    return {name: getattr(module, name) for name in names if getattr(module, name, None) is not None}


def _not_linear(children: Mapping[str, Any]) -> str | None:
    for name, child in children.items():
        if type(child) is not nn.Linear:
            return f"{name} is {type(child).__qualname__}, not nn.Linear"
    return None


def attention_layout(module: nn.Module) -> Site | str | None:
    """The attention site of ``module`` (with an empty path), the reason it is not fusable, or ``None``.

    ``None``: ``module`` has none of ``q_proj`` / ``k_proj`` / ``v_proj`` (not an attention
    this pack could fuse at all).
    """
    found = _children(module, ATTENTION_PROJECTIONS)
    if not any(name in found for name in ATTENTION_PROJECTIONS[:3]):
        return None
    missing = [name for name in ATTENTION_PROJECTIONS if name not in found]
    if missing:
        return f"has {sorted(found)} but no {missing}"
    if (problem := _not_linear(found)) is not None:
        return problem
    query, key, value, out = (found[name] for name in ATTENTION_PROJECTIONS)
    if len({query.in_features, key.in_features, value.in_features}) != 1:
        return (
            f"q/k/v read different input sizes ({query.in_features}, {key.in_features}, {value.in_features}): "
            "not one projection of one input"
        )
    if len({query.bias is None, key.bias is None, value.bias is None}) != 1:
        with_bias = [name for name in ("q_proj", "k_proj", "v_proj") if found[name].bias is not None]
        return f"only {with_bias} of q/k/v have a bias"
    if key.out_features != value.out_features:
        return f"k_proj and v_proj write different sizes ({key.out_features}, {value.out_features})"
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        return f"no integer head_dim attribute (got {head_dim!r})"
    if query.out_features % head_dim or key.out_features % head_dim:
        return f"q/k/v sizes ({query.out_features}, {key.out_features}) are not whole heads of {head_dim}"
    if out.in_features != query.out_features:
        return f"o_proj reads {out.in_features}, q_proj writes {query.out_features}"
    norms = _children(module, ("q_norm", "k_norm"))
    if len(norms) == 1:
        return f"has {sorted(norms)} but not both q_norm and k_norm"
    for name, norm in norms.items():
        shape = tuple(getattr(getattr(norm, "weight", None), "shape", ()))
        if shape != (head_dim,):
            return f"{name} normalises a {list(shape)} weight, not one head ([{head_dim}])"
    sizes = (query.out_features, key.out_features, value.out_features)
    return Site("", "attention", type(module).__name__, sizes, query.bias is not None, qk_norm=bool(norms))


def mlp_layout(module: nn.Module) -> Site | str | None:
    """The MLP site of ``module`` (with an empty path), the reason it is not fusable, or ``None``.

    ``None``: ``module`` has neither ``gate_proj`` nor ``up_proj``.
    """
    found = _children(module, MLP_PROJECTIONS)
    if "gate_proj" not in found and "up_proj" not in found:
        return None
    missing = [name for name in MLP_PROJECTIONS if name not in found]
    if missing:
        return f"has {sorted(found)} but no {missing}"
    if (problem := _not_linear(found)) is not None:
        return problem
    if not callable(getattr(module, "act_fn", None)):
        return "no act_fn: not a gated MLP of the form down(act(gate(x)) * up(x))"
    gate, up, down = (found[name] for name in MLP_PROJECTIONS)
    if (gate.in_features, gate.out_features) != (up.in_features, up.out_features):
        return f"gate_proj is {gate.in_features}->{gate.out_features}, up_proj {up.in_features}->{up.out_features}"
    if (gate.bias is None) != (up.bias is None):
        return "only one of gate_proj and up_proj has a bias"
    if down.in_features != gate.out_features:
        return f"down_proj reads {down.in_features}, gate/up write {gate.out_features}"
    return Site("", "mlp", type(module).__name__, (gate.out_features, up.out_features), gate.bias is not None)


def inspect_layer(layer: nn.Module) -> tuple[list[Site], dict[str, str]]:
    """The fusable sites of one built module tree, and the classes rejected in it (with why).

    Works on any device (the pack uses the meta device); only shapes and types are read.
    """
    sites: list[Site] = []
    rejected: dict[str, str] = {}
    for path, module in layer.named_modules():
        for layout in (attention_layout, mlp_layout):
            result = layout(module)
            if isinstance(result, Site):
                sites.append(dataclasses.replace(result, path=path))
            elif isinstance(result, str):
                rejected.setdefault(type(module).__name__, f"{path or '<layer>'}: {result}")
    return sites, rejected


def consolidate(layers: Iterable[tuple[list[Site], dict[str, str]]]) -> Detection:
    """Merge the ``inspect_layer`` results of every layer of one model.

    A class is fusable only if every one of its modules is, and if a path holds the same
    sizes in every layer (a converter's pattern names the path, not the layer).
    """
    rejected: dict[str, str] = {}
    by_key: dict[tuple[str, str], Site] = {}
    for index, (sites, layer_rejected) in enumerate(layers):
        for name, reason in layer_rejected.items():
            rejected.setdefault(name, f"layer {index}, {reason}")
        for site in sites:
            seen = by_key.setdefault((site.class_name, site.path), site)
            if seen != site and site.class_name not in rejected:
                rejected[site.class_name] = (
                    f"layer {index}, {site.path}: sizes {list(site.sizes)} (bias {site.bias}) differ from "
                    f"{list(seen.sizes)} (bias {seen.bias}) at the same path in an earlier layer; one converter "
                    "pattern cannot tell the layers apart"
                )
    kinds: dict[str, set[str]] = {}
    for site in by_key.values():
        kinds.setdefault(site.class_name, set()).add(site.kind)
    for name, found in kinds.items():
        if len(found) > 1 and name not in rejected:
            rejected[name] = "has both an attention and an MLP layout"
    return Detection(tuple(site for site in by_key.values() if site.class_name not in rejected), rejected)


_CACHE: dict[tuple[type, str], Detection] = {}
_CACHE_LOCK = threading.Lock()
#: Cached detections kept at most (one per model shape; a process rarely loads more).
CACHE_SIZE = 64


def _config_key(config: Any) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=repr)


def detect(config: Any, layer_class: type[nn.Module]) -> Detection:
    """Build every decoder layer ``layer_class(config, index)`` on the meta device and inspect it.

    Args:
        config: the model's (text) config; ``num_hidden_layers`` gives the layer count.
        layer_class: the family's decoder-layer class.

    Returns:
        The consolidated ``Detection``, cached by ``layer_class`` and the config's content.

    Raises:
        ValueError: the config has no positive ``num_hidden_layers``; pass the text
            config of a decoder model.
    """
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
        raise ValueError(
            f"{type(config).__name__}.num_hidden_layers is {layers!r}; "
            "fused-dense needs the decoder's layer count to find its projections"
        )
    key = (layer_class, _config_key(config))
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
    if cached is not None:
        return cached
    with torch.device("meta"):
        detection = consolidate(inspect_layer(layer_class(config, index)) for index in range(layers))
    with _CACHE_LOCK:
        if len(_CACHE) >= CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = detection
    return detection


def clear_cache() -> None:
    """Forget every cached detection (tests; a process that rebuilds transformers classes)."""
    with _CACHE_LOCK:
        _CACHE.clear()
