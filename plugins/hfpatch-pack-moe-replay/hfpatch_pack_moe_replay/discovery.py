"""Which module of a model type routes, and whether its selection can be replayed exactly.

No table of class names: for a model type, the candidates are the ``nn.Module`` classes of
its modeling module whose forward (or a method it calls on ``self``) computes a ``topk``.
Each is built on the CPU from a copy of the config with the hidden size shrunk (the expert
count, top-k and group settings kept), given random weights and run on a probe input
while ``SelectionMode``-like probes watch its ``topk`` calls. A candidate is a router whose
selection can be replayed when:

* exactly one ``topk`` call picks the largest ``k`` along the last dimension of a
  ``(tokens, experts)`` tensor as wide as the linear map of the hidden states it scores
  (group-limited routers first pick groups with narrower calls);
* replaying its own selection gives its outputs bit for bit, and forcing another
  selection changes them, with gradients reaching the router's weights;
* the routing weights it returns for a forced selection are what one of the known rules
  computes for those experts from its logits: a softmax (renormalised or not), a sigmoid
  (renormalised or not; a correction bias used only to select, group limits), either
  scaled by a constant; a softmax over the selected logits (gpt-oss); the sigmoid of the
  selected logits scattered over the experts (llama4);
* its forward is deterministic in training mode (no jitter).

A module that contains an accepted router is not one itself. A model type is refused, with
the reason, when no class is an accepted router, or when a class named like a router
(``...Router``, ``...MoEGate``, ``...Gating``) is not one (hash routing, a sparse mixer): replaying some of
its MoE layers only would not give the rollout's routing.

``sites`` finds the candidates and where they sit in the model, ``probe`` probes one; this
module decides for the model type, and keeps the answer per config.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from typing import Any

import torch.nn as nn

from hfpatch_core.authoring import isolated_rng, text_decoder_config

from .probe import NO_TOPK, Refused, build, probe_router
from .selection import Selection
from .sites import ROUTER_NAME, candidate_classes, router_like_sites, router_sites

__all__ = ["Discovery", "RouterFamily", "discover", "modeling_source", "moe_model_types"]


@dataclasses.dataclass(frozen=True)
class RouterFamily:
    """One router class of a model type, and what it computes.

    Attributes:
        router_class: the transformers class that selects the experts.
        selection: its selection ``topk`` (experts, top-k) for the config it was probed with.
        rule: what it computes, in words (``"softmax top-k, renormalised"``).
    """

    router_class: type[nn.Module]
    selection: Selection
    rule: str


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What ``discover`` found for one model type.

    Attributes:
        model_type: the model type.
        routers: the router classes the pack replays (empty when refused).
        refused: why the model type cannot be replayed exactly, or ``None``.
        candidate: the class the refusal is about (a router-like class that failed the
            probes), ``None`` when the model type has no such class (not a top-k MoE model,
            or its classes could not be built).
    """

    model_type: str
    routers: tuple[RouterFamily, ...]
    refused: str | None = None
    candidate: str | None = None

    @property
    def replayable(self) -> bool:
        """Whether the pack replays this model type."""
        return bool(self.routers) and self.refused is None


_lock = threading.RLock()


_cache: dict[tuple[str, str], Discovery] = {}


def modeling_module(model_type: str) -> Any:
    """The installed transformers' modeling module of ``model_type`` (``None`` when there is none)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None


def moe_model_types() -> list[str]:
    """The model types of the installed transformers' causal-LM mapping whose modeling module
    has a top-k over experts: every one is replayed or refused with a reason (``discover``).

    The modules' source files are read, not imported: importing the ~300 modeling modules of
    the mapping took most of a cold ``hfpatch list`` (issue 52.5), and only the MoE ones are
    imported later, by ``discover``. A module whose file is found but does not import is
    listed; ``discover`` refuses it (no modeling module)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        source = modeling_source(model_type)
        if source is not None and "topk" in source and "expert" in source.lower():
            found.append(model_type)
    return found


def modeling_source(model_type: str) -> str | None:
    """The source of ``model_type``'s modeling module, read from its file as ``import_module`` would
    find it, without importing it (``None`` when there is no such file)."""
    import importlib.machinery

    import transformers.models
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    for entry in transformers.models.__path__:
        spec = importlib.machinery.PathFinder.find_spec(f"modeling_{name}", [f"{entry}/{name}"])
        if spec is not None and spec.origin is not None and spec.origin.endswith(".py"):
            try:
                with open(spec.origin, encoding="utf-8") as file:
                    return file.read()
            except OSError:
                return None
    return None


def _config_key(config: Any) -> str:
    try:
        return str(config.to_json_string(use_diff=False))
    except Exception:  # a config that does not serialise: probe it every time
        return repr(id(config))


def discover(model_type: str, config: Any = None) -> Discovery:
    """Find and probe ``model_type``'s routers (cached per config).

    Args:
        model_type: a model type of the installed transformers.
        config: the config the model is built with (default: the model type's default
            config); its expert count, top-k and routing flags are kept for the probe.
    """
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.for_model(model_type)
        except Exception as exc:
            return Discovery(model_type, (), f"its default config cannot be built ({type(exc).__name__}: {exc})")
    key = (model_type, _config_key(config))
    with _lock:
        found = _cache.get(key)
        if found is None:
            # probes build and run modules on the CPU: on generators of their own, never the caller's
            # (discover also runs outside hooks: routers_of at a rollout's first record)
            with isolated_rng():
                found = _cache[key] = _discover(model_type, config)
        return found


def _discover(model_type: str, config: Any) -> Discovery:
    module = modeling_module(model_type)
    if module is None:
        return Discovery(model_type, (), "transformers has no modeling module for it")
    text = text_decoder_config(config)
    candidates = list(candidate_classes(module))
    sites = router_sites(module, model_type, config, candidates)
    if sites is not None:
        # only a module that sits in an MoE block beside its experts is a router candidate: a
        # top-k elsewhere (beam search of a QA head, an attention mask) selects no expert
        candidates = [cls for cls in candidates if cls in sites]
    accepted: list[tuple[RouterFamily, nn.Module]] = []
    rejected: list[tuple[str, str]] = []
    # the innermost first: a module holding an accepted router (its MoE block) is not probed
    deferred = []
    for cls in candidates:
        try:
            instance = build(cls, text, sites)[0]
        except Refused as exc:
            rejected.append((cls.__name__, str(exc)))
            continue
        inner = any(isinstance(sub, other) for other in candidates if other is not cls for sub in instance.modules())
        deferred.append((inner, cls, instance))
    for inner in (False, True):
        for is_inner, cls, instance in deferred:
            if is_inner != inner:
                continue
            modules = list(instance.modules()) if inner else []
            if any(isinstance(sub, family.router_class) for family, _ in accepted for sub in modules):
                continue
            try:
                selection, rule, probed = probe_router(cls, text, sites)
                accepted.append((RouterFamily(cls, selection, rule), probed))
            except Refused as exc:
                rejected.append((cls.__name__, str(exc)))
    # a scoring module inside an accepted router (5.3's hunyuan gate, whose MoE block selects) is replayed with it
    inside = {type(sub) for _, instance in accepted for sub in instance.modules()}
    if sites is None:
        # the model could not be built to look: a class named like a router that computes no top-k refuses
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, nn.Module)
                and value not in inside
                and value.__module__ == module.__name__
                and ROUTER_NAME.search(name)
                and value not in candidates
                and not any(name == rejected_name for rejected_name, _ in rejected)
            ):
                rejected.append((name, NO_TOPK))
    else:
        for cls in router_like_sites(sites):
            if cls in inside:
                continue
            if cls not in candidates and not any(cls.__name__ == rejected_name for rejected_name, _ in rejected):
                rejected.append((cls.__name__, NO_TOPK))
    # a module holding an accepted router (the MoE block around it) is not a router itself
    routers = [
        family
        for family, instance in accepted
        if not any(
            isinstance(sub, other.router_class)
            for other, _ in accepted
            if other is not family
            for sub in instance.modules()
        )
    ]
    router_like = [(name, reason) for name, reason in rejected if ROUTER_NAME.search(name)]
    if routers and router_like:
        name, reason = router_like[0]
        return Discovery(
            model_type,
            (),
            f"{name} routes some MoE layers without a replayable top-k ({reason}), so replaying only the other "
            f"layers' routers ({', '.join(family.router_class.__name__ for family in routers)}) would not give the "
            "rollout's routing",
            candidate=name,
        )
    if routers:
        return Discovery(model_type, tuple(routers))
    if rejected:
        detail = "; ".join(f"{name}: {reason}" for name, reason in (router_like or rejected)[:3])
        candidate = (router_like or rejected)[0][0]
        return Discovery(
            model_type, (), f"no class of it selects experts with a replayable top-k ({detail})", candidate=candidate
        )
    if sites is not None and not candidates:
        return Discovery(model_type, (), "no module of it selects experts with a top-k in this configuration")
    return Discovery(model_type, (), "no class of it computes a top-k (not a top-k MoE model)")
