"""Where a model type's router candidates sit: the classes that compute a ``topk``, and the ones beside experts.

``discovery`` asks two things of a model type's modeling module before it probes a class
(``probe``): which of its ``nn.Module`` classes compute a ``topk`` in their forward (or a method
it calls on ``self``), and which of those sit in an MoE block beside its experts in the model
built on the meta device (a top-k elsewhere, beam search of a QA head or an attention mask,
selects no expert). A class named like a router (``ROUTER_NAME``) that computes no top-k is
found here too: ``discovery`` refuses the model type for it.
"""

from __future__ import annotations

import copy
import inspect
import linecache
import re
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from hfpatch_core.authoring import text_decoder_config

__all__ = [
    "EXPERT_COUNTS",
    "ROUTER_NAME",
    "SHALLOW_LAYERS",
    "Sites",
    "candidate_classes",
    "router_like_sites",
    "router_sites",
    "shrunk_config",
]

_PROBE_HIDDEN = 16


# what MoE routers are called (not a residual or forget gate): ...Router, ...MoEGate, ...Gating
ROUTER_NAME = re.compile(r"(Router|Mo[Ee]\w*Gate|Gating)$")


EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


#: ``{class: [instances on the meta device]}`` of the modules beside experts in a model built on meta.
Sites = dict[type[nn.Module], list[nn.Module]]


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
        for count in (getattr(item, name, None) for name in EXPERT_COUNTS)
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


#: The decoder layers of the first, shallow build ``router_sites`` tries (a default config has up to ~80:
#: building them all on meta was most of what probing a model type cost, issue 52.5). Enough for
#: the dense layers some models start with (``first_k_dense_replace``) and MoE every other layer.
SHALLOW_LAYERS: int | None = 6


def router_sites(module: Any, model_type: str, config: Any, candidates: list[type[nn.Module]]) -> Sites | None:
    """Where ``candidates`` sit in ``model_type``'s model built on the meta device from ``config``: the
    instances in an MoE block beside its experts (themselves a block holding experts, or their parent).

    The model is built first with its first ``SHALLOW_LAYERS`` decoder layers only (from the config
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
    attempts = (shrunk_config(config), config)
    shallow = tuple(_shallow(attempt) for attempt in attempts)
    if all(attempt is not None for attempt in shallow):
        found, built = _sites_in(model_class, shallow, candidates, counts)
        if found is not None and {*candidates, *_router_named(module)} <= built:
            return found
    return _sites_in(model_class, attempts, candidates, counts)[0]


def _shallow(config: Any) -> Any:
    """A copy of ``config`` with ``SHALLOW_LAYERS`` decoder layers (its per-layer settings, computed for
    every layer, kept), or ``None`` when it has no more (or no top-level layer count)."""
    layers = getattr(config, "num_hidden_layers", None)
    if SHALLOW_LAYERS is None or not isinstance(layers, int) or layers <= SHALLOW_LAYERS:
        return None
    shallow = copy.deepcopy(config)
    try:
        shallow.num_hidden_layers = SHALLOW_LAYERS
    except Exception:  # a config that validates the count against its other settings: build it whole
        return None
    return shallow


def _router_named(module: Any) -> list[type[nn.Module]]:
    """The ``nn.Module`` classes of ``module``'s namespace named like a router (``ROUTER_NAME``)."""
    return [
        value
        for name, value in vars(module).items()
        if isinstance(value, type) and issubclass(value, nn.Module) and ROUTER_NAME.search(name)
    ]


def _sites_in(
    model_class: type[nn.Module], attempts: tuple[Any, ...], candidates: list[type[nn.Module]], counts: set[int]
) -> tuple[Sites | None, set[type]]:
    """``router_sites`` in the model built on meta from the first of ``attempts`` that builds (``None``: none
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
    found: Sites = {}
    for instance in model.modules():
        cls = type(instance)
        if cls not in candidates and not ROUTER_NAME.search(cls.__name__):
            continue
        holders = [instance] + ([parents[instance]] if instance in parents else [])
        if any(_holds_experts(holder, instance, counts) for holder in holders):
            found.setdefault(cls, []).append(instance)
    return found, {type(instance) for instance in model.modules()}


def router_like_sites(sites: Sites) -> list[type[nn.Module]]:
    return [cls for cls in sites if ROUTER_NAME.search(cls.__name__)]


def candidate_classes(module: Any) -> Iterator[type[nn.Module]]:
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
        source = _function_lines(function)
        if source is None:
            continue
        parts.append(source)
        pending.extend(re.findall(r"self\.(\w+)\(", source))
    return "\n".join(parts)


def _function_lines(function: Any) -> str | None:
    """The lines of ``function``'s source that its code spans (``None``: no Python source).

    ``inspect.getsource`` finds a function's end by tokenizing from its first line, which took
    a second of a cold ``hfpatch list`` (each MoE modeling module's classes read for every config
    discovered, issue 52.5); the code object already records the last line of every expression
    in it, nested functions' included. Trailing comments are left out, which a search for
    ``topk`` and ``self.method(`` calls does not need."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return None
    lines = linecache.getlines(code.co_filename)
    if not lines:
        return None
    last, pending = code.co_firstlineno, [code]
    while pending:
        current = pending.pop()
        if hasattr(current, "co_positions"):  # 3.11: where each expression ends
            ends = [end for _, end, _, _ in current.co_positions()]
        else:  # 3.10: the line each instruction is on
            ends = [line for _, _, line in current.co_lines()]
        last = max([last, *(end for end in ends if end is not None)])
        pending.extend(const for const in current.co_consts if inspect.iscode(const))
    return "".join(lines[code.co_firstlineno - 1 : last])


def shrunk_config(config: Any) -> Any:
    """A copy of ``config`` with the sizes that only make the probe slow made small, in the
    sub-configs it holds too (dbrx's MoE block reads its sizes from ``config.ffn_config``: probed
    unshrunk, its 88M parameters were half of a cold ``hfpatch list``'s probing, issue 52.5)."""
    shrunk = copy.deepcopy(config)
    _shrink(shrunk)
    return shrunk


def _shrink(config: Any) -> None:
    from transformers import PretrainedConfig

    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _shrink(value)
        elif isinstance(value, bool) or not isinstance(value, int):
            continue
        elif name == "hidden_size" or name.endswith("intermediate_size") or name in ("d_model", "n_embd"):
            setattr(config, name, min(value, _PROBE_HIDDEN))
