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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hfpatch_core.authoring import isolated_rng, text_decoder_config

from .scope import _LayerReplay
from .selection import _TOPK, Selection, SelectionMode, _topk_arguments

__all__ = ["Discovery", "RouterFamily", "discover", "modeling_source", "moe_model_types"]

_PROBE_TOKENS = 6
_PROBE_HIDDEN = 16
# what MoE routers are called (not a residual or forget gate): ...Router, ...MoEGate, ...Gating
_ROUTER_NAME = re.compile(r"(Router|Mo[Ee]\w*Gate|Gating)$")


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


class _Refused(Exception):
    """A candidate is not a replayable router; the message says why."""


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
    candidates = list(_candidates(module))
    sites = _sites(module, model_type, config, candidates)
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
            instance = _build(cls, text, sites)[0]
        except _Refused as exc:
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
                accepted.append(_probe(cls, text, sites))
            except _Refused as exc:
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
                and _ROUTER_NAME.search(name)
                and value not in candidates
                and not any(name == rejected_name for rejected_name, _ in rejected)
            ):
                rejected.append((name, _NO_TOPK))
    else:
        for cls in _router_like_sites(sites):
            if cls in inside:
                continue
            if cls not in candidates and not any(cls.__name__ == rejected_name for rejected_name, _ in rejected):
                rejected.append((cls.__name__, _NO_TOPK))
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
    router_like = [(name, reason) for name, reason in rejected if _ROUTER_NAME.search(name)]
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


#: ``{class: [instances on the meta device]}`` of the modules beside experts in a model built on meta.
_Sites = dict[type[nn.Module], list[nn.Module]]

_EXPERT = re.compile("expert", re.IGNORECASE)


def _model_class(module: Any, model_type: str) -> type[nn.Module] | None:
    """The base model class of ``model_type`` (its causal LM where it has none)."""
    from transformers.models.auto import modeling_auto

    for mapping in (modeling_auto.MODEL_MAPPING_NAMES, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        name = mapping.get(model_type)
        found = getattr(module, name, None) if isinstance(name, str) else None
        if isinstance(found, type) and issubclass(found, nn.Module):
            return found
    return None


def _expert_counts(config: Any) -> set[int]:
    configs = [config, text_decoder_config(config)]
    return {
        count
        for item in configs
        for count in (getattr(item, name, None) for name in _EXPERT_COUNTS)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0
    }


def _holds_experts(holder: nn.Module, instance: nn.Module, counts: set[int]) -> bool:
    """Whether ``holder`` directly holds experts besides ``instance``: a child named or typed like experts,
    an embedding with one row per expert (product-key experts), or a parameter of stacked experts."""
    for name, child in holder.named_children():
        if child is instance:
            continue
        if _EXPERT.search(name) or _EXPERT.search(type(child).__name__):
            return True
        if isinstance(child, nn.Embedding) and child.num_embeddings in counts:
            return True
    return any(
        _EXPERT.search(name) or (parameter.dim() >= 3 and parameter.shape[0] in counts)
        for name, parameter in holder.named_parameters(recurse=False)
    )


#: The decoder layers of the first, shallow build ``_sites`` tries (a default config has up to ~80:
#: building them all on meta was most of what probing a model type cost, issue 52.5). Enough for
#: the dense layers some models start with (``first_k_dense_replace``) and MoE every other layer.
_SHALLOW_LAYERS: int | None = 6


def _sites(module: Any, model_type: str, config: Any, candidates: list[type[nn.Module]]) -> _Sites | None:
    """Where ``candidates`` sit in ``model_type``'s model built on the meta device from ``config``: the
    instances in an MoE block beside its experts (themselves a block holding experts, or their parent).

    The model is built first with its first ``_SHALLOW_LAYERS`` decoder layers only (from the config
    the whole model would be built from: shrunk, else as it is). That answer is taken as the whole
    model's when every class that can be a site (each candidate, each class of the module named like
    a router) is built in it: the later layers are built by the same classes from the same config,
    so they add no class, and each class's first instance is the same one. Otherwise (a class the
    first layers do not build) the whole model is built. ``provide_model_types``'s answer is the
    whole build's on transformers 5.25 and 5.3 (tests/test_shallow_discovery.py).

    ``None`` when the model cannot be built on meta (then every candidate class is probed).
    """
    model_class = _model_class(module, model_type)
    if model_class is None:
        return None
    counts = _expert_counts(config)
    attempts = (_shrunk(config), config)
    shallow = tuple(_shallow(attempt) for attempt in attempts)
    if all(attempt is not None for attempt in shallow):
        found, built = _sites_in(model_class, shallow, candidates, counts)
        if found is not None and {*candidates, *_router_named(module)} <= built:
            return found
    return _sites_in(model_class, attempts, candidates, counts)[0]


def _shallow(config: Any) -> Any:
    """A copy of ``config`` with ``_SHALLOW_LAYERS`` decoder layers (its per-layer settings, computed for
    every layer, kept), or ``None`` when it has no more (or no top-level layer count)."""
    layers = getattr(config, "num_hidden_layers", None)
    if _SHALLOW_LAYERS is None or not isinstance(layers, int) or layers <= _SHALLOW_LAYERS:
        return None
    shallow = copy.deepcopy(config)
    try:
        shallow.num_hidden_layers = _SHALLOW_LAYERS
    except Exception:  # a config that validates the count against its other settings: build it whole
        return None
    return shallow


def _router_named(module: Any) -> list[type[nn.Module]]:
    """The ``nn.Module`` classes of ``module``'s namespace named like a router (``_ROUTER_NAME``)."""
    return [
        value
        for name, value in vars(module).items()
        if isinstance(value, type) and issubclass(value, nn.Module) and _ROUTER_NAME.search(name)
    ]


def _sites_in(
    model_class: type[nn.Module], attempts: tuple[Any, ...], candidates: list[type[nn.Module]], counts: set[int]
) -> tuple[_Sites | None, set[type]]:
    """``_sites`` in the model built on meta from the first of ``attempts`` that builds (``None``: none
    does), and the classes of every module built."""
    from hfpatch_core.authoring import build_on_meta

    model = None
    for attempt in attempts:
        try:
            model = build_on_meta(model_class, attempt)
            break
        except Exception:  # some models do not build on meta or from a shrunk config: try the next, else probe classes
            continue
    if model is None:
        return None, set()
    parents: dict[nn.Module, nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(child, parent)
    found: _Sites = {}
    for instance in model.modules():
        cls = type(instance)
        if cls not in candidates and not _ROUTER_NAME.search(cls.__name__):
            continue
        holders = [instance] + ([parents[instance]] if instance in parents else [])
        if any(_holds_experts(holder, instance, counts) for holder in holders):
            found.setdefault(cls, []).append(instance)
    return found, {type(instance) for instance in model.modules()}


def _router_like_sites(sites: _Sites) -> list[type[nn.Module]]:
    return [cls for cls in sites if _ROUTER_NAME.search(cls.__name__)]


def _candidates(module: Any) -> Iterator[type[nn.Module]]:
    from transformers import PreTrainedModel

    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, nn.Module)
            and not issubclass(value, PreTrainedModel)
            and value.__module__ == module.__name__
            and "topk" in _forward_source(value)
        ):
            yield value


def _forward_source(cls: type) -> str:
    """The source of ``cls.forward`` and of the methods it calls on ``self``."""
    seen: set[str] = set()
    parts: list[str] = []
    pending = ["forward"]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        function = getattr(cls, name, None)
        if not callable(function):
            continue
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            continue
        parts.append(source)
        pending.extend(re.findall(r"self\.(\w+)\(", source))
    return "\n".join(parts)


def _shrunk(config: Any) -> Any:
    """A copy of ``config`` with the sizes that only make the probe slow made small."""
    shrunk = copy.deepcopy(config)
    for name, value in list(vars(shrunk).items()):
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if name == "hidden_size" or name.endswith("intermediate_size") or name in ("d_model", "n_embd"):
            setattr(shrunk, name, min(value, _PROBE_HIDDEN))
    return shrunk


def _instantiate(cls: type[nn.Module], config: Any) -> nn.Module:
    errors = []
    for args, kwargs in (((config,), {}), ((config, 0), {}), ((config,), {"layer_idx": 0})):
        try:
            with torch.device("cpu"):
                return cls(*args, **kwargs)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    raise _Refused(f"it cannot be built from the config alone ({errors[0]})")


#: The most parameters a router taken out of a model built on meta may have to be probed.
_MAX_PROBE_PARAMETERS = 20_000_000


def _build(cls: type[nn.Module], config: Any, sites: _Sites | None) -> tuple[nn.Module, int | None]:
    """A CPU instance of ``cls`` to probe, and its input width (``None``: the shrunk config's hidden size).

    Built from the shrunk config like the model builds it; a class whose constructor takes
    other arguments (sizes passed by its MoE block) is taken instead from the model built
    on meta (``_sites``), its memory allocated on the CPU.
    """
    try:
        return _instantiate(cls, _shrunk(config)), None
    except _Refused:
        if not sites or cls not in sites:
            raise
    meta = sites[cls][0]
    if sum(parameter.numel() for parameter in meta.parameters()) > _MAX_PROBE_PARAMETERS:
        raise _Refused(
            f"it cannot be built from the config alone and its instance has over {_MAX_PROBE_PARAMETERS:,} parameters"
        )
    instance = copy.deepcopy(meta).to_empty(device="cpu")
    with torch.no_grad():
        for buffer in instance.buffers():
            buffer.zero_()
    widths = [int(sub.in_features) for sub in instance.modules() if isinstance(sub, nn.Linear)]
    return instance, (widths[0] if widths else None)


@dataclasses.dataclass
class _Call:
    shape: tuple[int, ...]
    k: Any
    dim: Any
    largest: Any


class _Watch(TorchFunctionMode):
    """Notes every ``topk`` call and every linear map's output in a forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.topk: list[_Call] = []
        self.linear: list[torch.Tensor] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _TOPK:
            source, k, dim, largest = _topk_arguments(args, kwargs)
            self.topk.append(_Call(tuple(source.shape), k, dim, largest))
        elif func in (F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and isinstance(
            result, torch.Tensor
        ):
            self.linear.append(result.detach())
        return result


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [item for item in output if isinstance(item, torch.Tensor)]
    return []


def _run(
    instance: nn.Module,
    hidden: torch.Tensor,
    mode: TorchFunctionMode | None = None,
    extra: dict[str, Any] | None = None,
) -> list[torch.Tensor]:
    with mode if mode is not None else contextlib.nullcontext():
        return _tensors(instance(hidden, **(extra or {})))


_NO_TOPK = "it selects experts without a top-k over their scores (hash routing, a sparse mixer, ...)"
_EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def _extra_arguments(instance: nn.Module, config: Any, generator: torch.Generator) -> dict[str, Any]:
    """The forward arguments besides the hidden states that a router takes from its MoE block: a
    per-expert bias (the correction bias some blocks own and pass in)."""
    parameters = list(inspect.signature(instance.forward).parameters.values())[1:]
    counts = [getattr(config, name, None) for name in _EXPERT_COUNTS]
    experts = next((count for count in counts if isinstance(count, int)), 0)
    extra: dict[str, Any] = {}
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        needed = parameter.default is inspect.Parameter.empty or parameter.default is None
        if needed and "bias" in parameter.name and experts:
            extra[parameter.name] = torch.rand(experts, generator=generator) * 0.5
    return extra


def _probe(cls: type[nn.Module], config: Any, sites: _Sites | None = None) -> tuple[RouterFamily, nn.Module]:
    shrunk = _shrunk(config)
    instance, width = _build(cls, config, sites)
    hidden_size = width if width is not None else getattr(shrunk, "hidden_size", None)
    if not isinstance(hidden_size, int):
        raise _Refused("its config has no hidden_size")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in instance.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
        for name, buffer in instance.named_buffers():
            if buffer.is_floating_point() and "bias" in name:
                buffer.copy_(torch.rand(buffer.shape, generator=generator).to(buffer.dtype) * 0.5)
    instance.eval()
    hidden: torch.Tensor | None = None
    watch = _Watch()
    errors = []
    extra = _extra_arguments(instance, shrunk, generator)
    for shape in ((_PROBE_TOKENS, hidden_size), (1, _PROBE_TOKENS, hidden_size)):
        candidate = torch.randn(shape, generator=generator)
        watch = _Watch()
        try:
            with torch.no_grad():
                _run(instance, candidate, watch, extra)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        hidden = candidate
        break
    if hidden is None:
        raise _Refused(f"its forward does not run on hidden states alone ({errors[0]})")
    selection = _selection_of(watch)
    logits = [out for out in watch.linear if out.shape[-1] == selection.width]
    if not logits:
        raise _Refused(
            f"its top-{selection.top_k} over {selection.width} experts scores no linear map of the hidden states"
        )
    logits_value = logits[0].reshape(-1, selection.width)

    with torch.no_grad():
        captured: list[torch.Tensor] = []
        live = _run(instance, hidden, _Capture(selection, captured), extra)
        (own,) = captured
        replayed = _run(instance, hidden, SelectionMode(instance, selection, _replay(own), record=False), extra)
        if len(live) != len(replayed) or not all(torch.equal(a, b) for a, b in zip(live, replayed, strict=True)):
            raise _Refused("replaying its own selection does not give its outputs bit for bit")
        if selection.width == 1:
            # one expert: every token selects it, so any recorded routing is the live one
            return RouterFamily(cls, selection, "a single expert, selected by every token"), instance
        forced_indices = (own + 1) % selection.width
        forcing = SelectionMode(instance, selection, _replay(forced_indices), record=False)
        forced = _run(instance, hidden, forcing, extra)
        if all(torch.equal(a, b) for a, b in zip(live, forced, strict=True)):
            raise _Refused("its outputs do not depend on the selected experts")
        instance.train()
        # two seeds of the probe's own (torch.manual_seed would also queue them for a CUDA not started yet)
        with isolated_rng(1):
            first = _run(instance, hidden, None, extra)
        with isolated_rng(2):
            second = _run(instance, hidden, None, extra)
        instance.eval()
        if not all(torch.equal(a, b) for a, b in zip(first, second, strict=True)):
            raise _Refused("its forward is random in training mode (jitter or sampling), so no selection is replayable")
    rule = _rule(forced, logits_value, forced_indices, instance, selection)
    if any(call.shape[0] == _PROBE_TOKENS and call.shape[-1] < selection.width for call in watch.topk):
        rule += "; group-limited"
    weights = [p for p in instance.parameters() if p.dim() == 2 and p.shape[0] == selection.width]
    instance.zero_grad(set_to_none=True)
    outputs = _run(instance, hidden, SelectionMode(instance, selection, _replay(forced_indices), record=False), extra)
    total = sum((out.float().sum() for out in outputs if out.requires_grad), torch.zeros(()))
    if total.requires_grad:
        total.backward()
    if not weights or not any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in weights):
        raise _Refused("no gradient reaches its router weights through a replayed selection")
    return RouterFamily(cls, selection, rule), instance


class _Capture(TorchFunctionMode):
    """Keeps the indices of a live forward's selection."""

    def __init__(self, selection: Selection, captured: list[torch.Tensor]) -> None:
        super().__init__()
        self.selection, self.captured = selection, captured

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _TOPK and self.selection.matches(args, kwargs):
            self.captured.append(result[1].clone())
        return result


def _replay(indices: torch.Tensor) -> _LayerReplay:
    return _LayerReplay(0, "probe", indices, None)


def _selection_of(watch: _Watch) -> Selection:
    rows = [
        call
        for call in watch.topk
        if len(call.shape) == 2
        and call.shape[0] == _PROBE_TOKENS
        and call.dim in (-1, 1)
        and bool(call.largest)
        and isinstance(call.k, int)
    ]
    if not rows:
        raise _Refused("no top-k over a (tokens, experts) tensor in its forward (hash routing, a sparse mixer, ...)")
    width = max(call.shape[1] for call in rows)
    widest = [call for call in rows if call.shape[1] == width]
    if len({call.k for call in widest}) > 1 or len(widest) > 1:
        raise _Refused(f"it computes {len(widest)} top-k over its {width} experts, so the selection is ambiguous")
    return Selection(width, int(widest[0].k))


def _rule(
    outputs: list[torch.Tensor],
    logits: torch.Tensor,
    indices: torch.Tensor,
    instance: nn.Module,
    selection: Selection,
) -> str:
    """What the router computes for the forced ``indices``, matched against the known rules."""
    scores = logits.float()
    rules: dict[str, Callable[[], torch.Tensor]] = {
        "softmax top-k": lambda: F.softmax(scores, dim=-1).gather(1, indices),
        "sigmoid top-k": lambda: torch.sigmoid(scores).gather(1, indices),
        "softmax over the selected logits (gpt-oss)": lambda: F.softmax(logits.gather(1, indices).float(), dim=-1),
    }
    notes = []
    if any(
        "bias" in name and buffer.shape == (selection.width,) and bool(buffer.abs().sum() > 0)
        for name, buffer in [*instance.named_buffers(), *instance.named_parameters()]
        if name.rpartition(".")[2] != "bias"
    ):
        notes.append("a correction bias used only to select")
    # a learned scale per expert applied to the selected weights (gemma4's per_expert_scale)
    per_expert_scales = [
        (name.rpartition(".")[2], tensor.detach())
        for name, tensor in [*instance.named_parameters(), *instance.named_buffers()]
        if tensor.shape == (selection.width,) and "bias" not in name.rpartition(".")[2] and tensor.is_floating_point()
    ]
    for output in _in_token_order(outputs, indices):
        flat = output.detach().float().reshape(-1, output.shape[-1])
        # a router that returns bf16 weights rounds them: compare at that precision
        rtol, atol = (1e-4, 1e-6) if output.dtype in (torch.float32, torch.float64) else (1e-2, 1e-3)
        if flat.shape == (indices.shape[0], selection.width):
            dense = torch.full_like(scores, float("-inf")).scatter(1, indices, logits.gather(1, indices).float())
            if torch.allclose(flat, torch.sigmoid(dense), rtol=rtol, atol=atol):
                return _label("sigmoid of the selected logits, scattered over the experts (llama4)", notes)
            continue
        if flat.shape != indices.shape:
            continue
        for name, rule in rules.items():
            base = rule()
            for renormalised in (False, True):
                candidate = base / (base.sum(dim=-1, keepdim=True) + (1e-20 if "sigmoid" in name else 0.0))
                candidate = candidate if renormalised else base
                for per_expert_name, per_expert in [("", None), *per_expert_scales]:
                    scaled = candidate if per_expert is None else candidate * per_expert.float()[indices]
                    scale = float(flat.sum() / scaled.sum())
                    if torch.allclose(flat, scaled * scale, rtol=rtol, atol=atol):
                        words = [name + (", renormalised" if renormalised and "selected" not in name else "")]
                        if per_expert is not None:
                            words.append(f"times the selected experts' {per_expert_name}")
                        if abs(scale - 1.0) > 1e-6:
                            words.append(f"scaled by {scale:g}")
                        return _label(", ".join(words), notes)
    raise _Refused(
        "the routing weights it returns for a forced selection match none of the rules the pack knows (softmax or "
        "sigmoid top-k, renormalised or not, scaled; gpt-oss; llama4)"
    )


def _in_token_order(outputs: list[torch.Tensor], indices: torch.Tensor) -> list[torch.Tensor]:
    """``outputs``, plus each flat one that another output permutes (weights grouped by expert, as
    jetmoe's gating returns them with the permutation) put back in ``(tokens, top_k)`` order."""
    found = list(outputs)
    count = indices.numel()
    orders = [
        out
        for out in outputs
        if out.dim() == 1
        and out.numel() == count
        and not out.is_floating_point()
        and torch.equal(out.sort().values, torch.arange(count))
    ]
    for output in outputs:
        if output.dim() == 1 and output.numel() == count and output.is_floating_point():
            for order in orders:
                restored = torch.empty_like(output)
                restored[order] = output
                found.append(restored.reshape(indices.shape))
    return found


def _label(rule: str, notes: list[str]) -> str:
    return rule + "".join(f"; {note}" for note in notes)
