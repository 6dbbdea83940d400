"""Finding the experts classes of a model, structurally, and deciding for each: replaced or refused.

For a load's config the model class is built on the meta device (no memory), and every
module whose class declares itself through ``use_experts_implementation`` (its forward is
the decorator's) is an experts module.  For each such class:

1. the decorator's metadata (``has_gate``, ``has_bias``, ``is_transposed``,
   ``is_concatenated``, ``has_post_expert_norm``) says which 3-D parameters it holds, and
   the module must hold exactly those (anything else would be lost);
2. the per-expert names come from transformers' own conversion mapping for the model type:
   the ``WeightConverter`` that stacks per-expert checkpoint tensors into the class's 3-D
   parameter (``MergeModulelist``) names them in its source patterns
   (``mlp.experts.*.gate_proj.weight``, ``.experts.*.w1.weight``); where there is none, the
   checkpoint stores the experts 3-D and the class is refused (transformers' loader cannot
   split one tensor into per-expert targets);
3. a probe runs the class's own eager forward and the per-expert forward on the same
   random experts (the model's sizes, 3 experts) and routing, in float32 and bfloat16: the
   per-expert forward must give the eager result (float32 within 1e-5 relative), summing in
   the dtype that gives bfloat16's result closest; otherwise the class is refused;
4. how the per-expert linears shard in transformers' sharded loads is derived from the
   meta model's own plans for the class's 3-D experts (``sharding.plans_for``).

A refused class is left to transformers, with the reason (``Discovery.refused``), which
the pack's hooks return as a ``Refusal`` and ``hfpatch explain`` / ``check`` show.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import transformers

from hfpatch_core.authoring import text_decoder_config

from .experts import (
    DEFAULT_NAMES,
    Layout,
    LinearExperts,
    decorator_metadata,
    eager_forward,
    is_declared_experts,
    linear_experts_class,
)
from .sharding import model_plans, plans_for

__all__ = ["Candidate", "Discovery", "discover", "per_expert_names"]

#: Relative float32 tolerance of the probe (|eager - per-expert| / max |eager|).
PROBE_RTOL = 1e-5

#: The intermediate size of the probe's experts, tried before the model's own: three experts of
#: a real model's sizes are hundreds of MiB (deepseek_v3's: 0.5 GiB in float32), allocated during
#: every load; the forward's structure, which the probe checks, does not depend on it.
PROBE_INTERMEDIATE = 8


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One experts class the pack replaces in a load.

    Attributes:
        original: the transformers class.
        replacement: its per-expert drop-in.
        paths: the attribute path of its modules in the experts' parent (``"mlp.experts"``),
            what the converters' patterns start with.
        stacking: the source patterns, as written, of transformers' converters that this
            pack's converters make obsolete for the load: those that stack this class's
            per-expert checkpoint tensors (the tensors load unchanged), or, for a
            checkpoint storing the experts 3-D, those that only realign its 3-D tensors
            (5.3's ``Force16BytesAlignment``).
        stored_3d: the checkpoint stores the experts 3-D: the pack's converters split each
            3-D tensor into the per-expert modules at load and stack them back on save
            (``conversion.split_converters``).
        list_key: the conversion list transformers converts these experts with
            (``conversion_list_key``), where the converters go; empty: the load's own.
    """

    original: type[nn.Module]
    replacement: type[LinearExperts]
    paths: tuple[str, ...]
    stacking: tuple[str, ...]
    stored_3d: bool = False
    list_key: str = ""

    @property
    def layout(self) -> Layout:
        return self.replacement.layout


@dataclasses.dataclass(frozen=True)
class Discovery:
    """The experts classes of one model: those replaced, and those refused with why."""

    candidates: tuple[Candidate, ...] = ()
    refused: dict[str, str] = dataclasses.field(default_factory=dict)


def _model_class(config: Any, class_name: str | None) -> type[nn.Module] | None:
    model_class = getattr(transformers, class_name, None) if class_name else None
    if isinstance(model_class, type) and issubclass(model_class, nn.Module):
        return model_class
    from transformers import AutoModelForCausalLM

    mapping: Any = AutoModelForCausalLM._model_mapping
    try:
        found: type[nn.Module] = mapping[type(config)]
        return found
    except KeyError:
        return None


_cache: dict[tuple[str, str, str], Discovery] = {}
_lock = threading.Lock()


def discover(config: Any, model_type: str, class_name: str | None = None) -> Discovery:
    """What the pack does to a model of ``config`` (cached by model class and config content).

    A model that cannot be built on the meta device is refused as a whole (keyed by its
    class name, with the error), never skipped in silence.
    """
    model_class = _model_class(config, class_name)
    if model_class is None:
        return Discovery()
    try:
        key = (model_class.__qualname__, model_type, config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        key = (model_class.__qualname__, model_type, json.dumps(repr(config)))
    with _lock:
        if key in _cache:
            return _cache[key]
    found = _discover(config, model_type, model_class)
    with _lock:
        _cache[key] = found
    return found


def _discover(config: Any, model_type: str, model_class: type[nn.Module]) -> Discovery:
    import warnings

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_class(config)
    except Exception as exc:  # the experts cannot be found: said, not skipped in silence
        return Discovery(
            refused={
                model_class.__name__: f"{model_class.__name__}({type(config).__name__}) does not build on the meta "
                f"device, so its experts cannot be found ({type(exc).__name__}: {exc})"
            }
        )
    instances: dict[type, list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        if is_declared_experts(type(module)):
            instances.setdefault(type(module), []).append((path, module))
    candidates = []
    refused: dict[str, str] = _undeclared_experts(model, config, instances)
    plans = model_plans(model)
    for cls, found in instances.items():
        result = _decide(cls, found, model_type, plans)
        if isinstance(result, str):
            refused[cls.__name__] = result
        else:
            candidates.append(result)
    return Discovery(tuple(sorted(candidates, key=lambda c: c.original.__name__)), refused)


#: Config fields that count a model's routed experts (mixtral's num_local_experts, deepseek's n_routed_experts, ...).
_EXPERT_COUNT = re.compile(r"^(num|n)_(local_|routed_)?experts$|^moe_num_experts$")


def _undeclared_experts(model: nn.Module, config: Any, declared: Mapping[type, Any]) -> dict[str, str]:
    """Experts classes transformers does not declare through ``use_experts_implementation`` (dbrx,
    jetmoe, llama4's text experts), found by what they hold: parameters with one slice per routed
    expert (3-D, or as dbrx's, 2-D with every expert's rows one after another).  The pack reads an
    experts class's layout (gated, transposed, concatenated) from that declaration, so it refuses
    these with the reason instead of calling them not applicable."""
    text = text_decoder_config(config)
    counts = {
        value
        for source in (config, text, getattr(config, "ffn_config", None))
        if source is not None
        for name, value in vars(source).items()
        if _EXPERT_COUNT.match(name) and isinstance(value, int) and not isinstance(value, bool) and value > 1
    }
    refused: dict[str, str] = {}
    for path, module in model.named_modules():
        cls = type(module)
        if cls in declared or cls.__name__ in refused or not counts:
            continue
        own = list(module.named_parameters(recurse=False))
        stacked = [name for name, parameter in own if parameter.dim() == 3 and parameter.shape[0] in counts]
        # dbrx keeps each projection of every expert in one 2-D parameter, the experts' rows one after another
        flattened = [
            name
            for name, parameter in own
            if parameter.dim() == 2 and any(parameter.shape[0] % count == 0 for count in counts)
        ]
        if not stacked and len(flattened) >= 2 and len(flattened) == len(own):
            stacked = flattened
        if stacked:
            refused[cls.__name__] = (
                f"{path}: holds its experts' weights stacked ({', '.join(stacked)}: one slice per expert) but "
                "transformers does not declare it through use_experts_implementation, whose layout (gated, transposed, "
                "concatenated) the pack reads: not split into per-expert linears yet"
            )
    return refused


def _attribute_path(path: str) -> str:
    """The experts' path under their decoder layer, as checkpoint patterns name it (``mlp.experts``)."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if len(parts) >= 2 else path


def _decide(
    cls: type[nn.Module], found: list[tuple[str, nn.Module]], model_type: str, plans: dict[str, dict[str, str]]
) -> Candidate | str:
    meta = decorator_metadata(cls)
    if not meta["has_gate"] and getattr(cls, "_apply_gate", moe_default_gate()) is not moe_default_gate():
        return "it defines its own _apply_gate without a gate, which the eager loop does not call"
    base = Layout(
        has_gate=meta["has_gate"],
        has_bias=meta["has_bias"],
        is_transposed=meta["is_transposed"],
        is_concatenated=meta["is_concatenated"],
        has_post_expert_norm=meta["has_post_expert_norm"],
        custom_gate=cls._apply_gate is not moe_default_gate(),  # type: ignore[attr-defined]
        accumulate_fp32=False,
        names=DEFAULT_NAMES,
    )
    for path, module in found:
        problem = _parameter_problem(module, base)
        if problem is not None:
            return f"{path}: {problem}"
    paths = tuple(dict.fromkeys(_attribute_path(path) for path, _ in found))
    names = per_expert_names(model_type, base)
    stored_3d = names is None
    if names is None:
        realigning = stored_3d_conversion(model_type, base)
        if isinstance(realigning, str):
            return realigning
        names = realigning, DEFAULT_NAMES
    if isinstance(names, str):
        return names
    stacking, chosen = names
    if stored_3d and base.has_gate and not base.is_concatenated:
        # interleaved gate/up, as stored: one linear each expert, read in place (split halves would be copies)
        layout = dataclasses.replace(base, names=(None, "gate_up_proj", chosen[2]), joined=True)
    else:
        layout = dataclasses.replace(base, names=chosen if base.has_gate else (None, chosen[1], chosen[2]))
    probe = _probe(cls, found[0][1], layout)
    if isinstance(probe, str):
        return probe
    sharding = plans_for(probe, stored_3d, (path for path, _ in found), plans)
    key = conversion_list_key(model_type)
    replacement = linear_experts_class(cls, probe, sharding.attributes())
    return Candidate(cls, replacement, paths, stacking, stored_3d, key if key != model_type else "")


def moe_default_gate() -> Any:
    from transformers.integrations import moe

    return moe._default_apply_gate


def _parameter_problem(module: nn.Module, layout: Layout) -> str | None:
    own = {name for name, _ in module.named_parameters(recurse=False)}
    expected = set(layout.parameters)
    if own != expected:
        missing, extra = sorted(expected - own), sorted(own - expected)
        return (
            f"the decorator's metadata (has_gate={layout.has_gate}, has_bias={layout.has_bias}) says its experts "
            f"are {sorted(expected)}, but it holds {sorted(own)} (missing {missing}, unknown {extra}); a per-expert "
            "layout would lose or invent weights"
        )
    shapes = {name: tuple(getattr(module, name).shape) for name in expected}
    first = shapes[layout.parameters[0]]
    down = shapes["down_proj"]
    if len(first) != 3 or len(down) != 3 or first[0] != down[0]:
        return f"its expert parameters are not [experts, rows, columns] tensors of one expert count: {shapes}"
    hidden, rows = (first[1], first[2]) if layout.is_transposed else (first[2], first[1])
    down_out, down_in = (down[2], down[1]) if layout.is_transposed else (down[1], down[2])
    intermediate = rows // 2 if layout.has_gate else rows
    if (layout.has_gate and rows % 2) or down_out != hidden or down_in != intermediate:
        return f"its expert shapes do not chain (up {first}, down {down}, transposed={layout.is_transposed})"
    return None


#: transformers' operations that only realign a stacked or 3-D experts tensor for its kernels (5.3's
#: gpt_oss, ernie4_5_moe, solar_open): nothing to reproduce for per-expert modules.
_REALIGNING = frozenset({"Force16BytesAlignment"})

_STACKED = re.compile(r"experts\.\*\.(?P<name>\w+)\.weight$")


def _unescape(pattern: str) -> str:
    return pattern.replace("\\", "")


def conversion_list_key(model_type: str) -> str:
    """The key of the conversion list transformers reads for ``model_type``'s experts: the model type's,
    or where it has none the list transformers keeps for its base model class (dots3_note_text's
    experts are stacked by the ``Dots3NoteTextModel`` list, which a load reaches through that sub-model)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    try:
        if get_checkpoint_conversion_mapping(model_type) is not None:
            return model_type
        base = MODEL_MAPPING_NAMES.get(model_type)
        if isinstance(base, str) and get_checkpoint_conversion_mapping(base) is not None:
            return base
    except Exception:  # a release without the table
        pass
    return model_type


def per_expert_names(model_type: str, layout: Layout) -> tuple[tuple[str, ...], tuple[str, str, str]] | str | None:
    """``(stacking source patterns, (gate, up, down) names)`` for ``model_type``'s experts, from transformers'
    conversion mapping: the first source pattern of each stacking converter (what ``replaces`` names), and
    the per-expert names its source patterns give (``DEFAULT_NAMES[0]`` for the gate of an ungated class).

    Returns ``None`` when the mapping stacks nothing (the checkpoints store the experts 3-D), and a
    reason (a string) when it stacks the experts in a way a per-expert layout cannot load unchanged
    (another operation than stacking and concatenating, or one projection but not the other).
    """
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    try:
        transforms = get_checkpoint_conversion_mapping(conversion_list_key(model_type)) or []
    except Exception:
        transforms = []
    first = "gate_up_proj" if layout.has_gate else "up_proj"
    found: dict[str, tuple[str, ...]] = {}
    written: list[str] = []
    for transform in transforms:
        if not isinstance(transform, WeightConverter):
            continue
        if not any(isinstance(op, MergeModulelist) for op in transform.operations):
            continue
        from hfpatch_core.authoring import source_patterns_of, target_patterns_of

        targets = [_unescape(t) for t in target_patterns_of(transform)]
        sources = source_patterns_of(transform)
        for parameter in (first, "down_proj"):
            if len(targets) == 1 and targets[0].endswith(f"experts.{parameter}") and parameter not in found:
                extra = [
                    op
                    for op in transform.operations
                    if not isinstance(op, MergeModulelist | Concatenate) and type(op).__name__ not in _REALIGNING
                ]
                if extra:
                    return (
                        f"transformers' conversion for {model_type} builds {parameter} with "
                        f"{[type(op).__name__ for op in extra]} besides stacking; the per-expert checkpoint "
                        "tensors cannot load unchanged"
                    )
                names = []
                for source in sources:
                    match = _STACKED.search(_unescape(source))
                    if match is None:
                        return f"transformers' conversion for {model_type} stacks {source!r}, not one expert's weight"
                    names.append(match["name"])
                found[parameter] = tuple(names)
                written.append(sources[0])  # one pattern names the whole built-in converter
    if not found:
        return None
    if set(found) != {first, "down_proj"}:
        return f"transformers' conversion for {model_type} stacks {sorted(found)} but not both {first} and down_proj"
    ups, downs = found[first], found["down_proj"]
    if len(ups) != (2 if layout.has_gate else 1) or len(downs) != 1:
        return f"transformers' conversion for {model_type} stacks {list(ups)} into {first}: not one tensor per part"
    gate, up = (ups[0], ups[1]) if layout.has_gate else (DEFAULT_NAMES[0], ups[0])
    return tuple(written), (gate, up, downs[0])


def _renamings_apply_after_converters_on_save() -> bool:
    """Whether the installed ``save_pretrained`` runs a converter's reverse before the renamings' reverse.

    transformers 5.3 renames a key first, then converts it: a per-expert key is never the
    name a renaming of the 3-D tensor knows, so the stacked tensor would keep the model's name.
    """
    import inspect

    from transformers import core_model_loading

    return "reverse" in inspect.signature(core_model_loading.rename_source_key).parameters


def stored_3d_conversion(model_type: str, layout: Layout) -> tuple[str, ...] | str:
    """For experts whose checkpoints are 3-D: the source patterns of transformers' converters the split makes
    obsolete (they only realign the tensor), or why the split cannot reproduce transformers' conversion."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    from hfpatch_core.authoring import source_patterns_of, target_patterns_of

    try:
        transforms = get_checkpoint_conversion_mapping(conversion_list_key(model_type)) or []
    except Exception:
        transforms = []
    names = {f"experts.{parameter}" for parameter in layout.parameters}
    obsolete: list[str] = []
    for transform in transforms:
        targets = [re.sub(r"\(\?.+?\)|\$$", "", _unescape(t)) for t in target_patterns_of(transform)]
        hit = sorted(name for name in names for target in targets if target.endswith(name))
        if not hit:
            continue
        if isinstance(transform, WeightConverter):
            operations = [type(op).__name__ for op in transform.operations]
            if not set(operations) <= _REALIGNING:
                return (
                    f"transformers' conversion for {model_type} builds the 3-D experts tensor(s) {hit} with "
                    f"{operations}; splitting it into per-expert modules would not load what vanilla loads"
                )
            obsolete.append(source_patterns_of(transform)[0])
        elif isinstance(transform, WeightRenaming) and not _renamings_apply_after_converters_on_save():
            return (
                f"its checkpoints store the experts 3-D under another name ({source_patterns_of(transform)} -> {hit}), "
                "and this transformers release reverses renamings before converters on save: split into per-expert "
                "modules, they would be saved under the model's name, not the checkpoint's (later releases "
                "reverse converters first)"
            )
    return tuple(obsolete)


# --- the probe ----------------------------------------------------------------------------


def _probe(cls: type[nn.Module], template: nn.Module, layout: Layout) -> Layout | str:
    """``layout`` with the summing dtype that reproduces ``cls``'s eager forward, or why none does.

    Probed first with experts of intermediate size ``PROBE_INTERMEDIATE`` (the model's hidden size
    and modules otherwise); a class whose forward fails or differs there (one that reads its
    configured intermediate size, say) is probed again at the model's own sizes, which decide.
    """
    try:
        small: Layout | str = _probe_at(cls, template, layout, PROBE_INTERMEDIATE)
    except Exception as exc:  # any failure at the small size defers to the model's sizes
        small = repr(exc)
    return small if not isinstance(small, str) else _probe_at(cls, template, layout, None)


def _probe_at(cls: type[nn.Module], template: nn.Module, layout: Layout, intermediate: int | None) -> Layout | str:
    try:
        original, values = _probe_original(template, layout, intermediate)
    except Exception as exc:  # a module the probe cannot materialise is not known to be exact
        return f"its eager forward could not be probed ({type(exc).__name__}: {exc})"
    forward = eager_forward(cls)
    generator = torch.Generator().manual_seed(0)
    tokens, held = 7, values[layout.parameters[0]].shape[0]
    hidden = original_hidden(values, layout)
    states = torch.randn(tokens, hidden, generator=generator)
    index = torch.stack([torch.randperm(held, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=generator)
    results: dict[bool, tuple[float, float]] = {}
    reference: dict[torch.dtype, torch.Tensor] = {}
    for accumulate in (False, True):
        candidate = dataclasses.replace(layout, accumulate_fp32=accumulate)
        ours = _probe_replacement(cls, original, values, candidate)
        differences = []
        for dtype in (torch.float32, torch.bfloat16):
            original.to(dtype)
            ours.to(dtype)
            with torch.no_grad():
                if dtype not in reference:
                    reference[dtype] = forward(original, states.to(dtype), index, weights.to(dtype))
                got = ours(states.to(dtype), index, weights.to(dtype))
            expected = reference[dtype]
            if got.shape != expected.shape or got.dtype != expected.dtype:
                return f"its eager forward returns {tuple(expected.shape)} {expected.dtype}, not per-token outputs"
            scale = float(expected.float().abs().max()) or 1.0
            differences.append(float((got.float() - expected.float()).abs().max()) / scale)
        results[accumulate] = (differences[0], differences[1])
    accumulate = min(results, key=lambda key: (results[key][0] > PROBE_RTOL, results[key][1]))
    fp32 = results[accumulate][0]
    if fp32 > PROBE_RTOL:
        return (
            f"its eager forward is not the per-expert loop: on a probe it differs from it by {fp32:.2e} "
            f"(relative, float32); only classes whose eager forward is use_experts_implementation's reference "
            "loop (gate/up, gating, down, optional post-expert norm, times the routing weight) are replaced"
        )
    return dataclasses.replace(layout, accumulate_fp32=accumulate)


def original_hidden(values: dict[str, torch.Tensor], layout: Layout) -> int:
    first = values[layout.parameters[0]]
    return int(first.shape[1] if layout.is_transposed else first.shape[2])


def _probe_shape(name: str, shape: tuple[int, ...], layout: Layout, intermediate: int | None) -> tuple[int, ...]:
    """The probe's shape of the 3-D parameter (or bias) ``name`` of ``shape``: 3 experts at most, and the
    intermediate dimension ``intermediate`` (doubled for gate/up) unless ``None``."""
    experts = min(3, shape[0])
    if intermediate is None:
        return (experts, *shape[1:])
    rows = 2 * intermediate if name.startswith("gate_up_proj") else intermediate
    if name == "down_proj_bias":
        return (experts, shape[1])
    if name.endswith("_bias"):
        return (experts, rows)
    # the intermediate dimension is the output of gate/up and the input of down: [E, out, in], or [E, in, out]
    first_is_intermediate = layout.is_transposed == (name == "down_proj")
    return (experts, rows, shape[2]) if first_is_intermediate else (experts, shape[1], rows)


def _probe_original(
    template: nn.Module, layout: Layout, intermediate: int | None = None
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A copy of the meta ``template`` on the CPU with 3 random experts (of intermediate size
    ``intermediate`` if given, its sizes otherwise)."""
    generator = torch.Generator().manual_seed(1)
    original = copy.copy(template)
    original._parameters = dict(template._parameters)
    original._buffers = dict(template._buffers)
    original._modules = {name: copy.deepcopy(child) for name, child in template._modules.items()}
    for name, buffer in original._buffers.items():
        if buffer is not None and buffer.is_meta:
            raise ValueError(f"buffer {name!r} has no value on the meta device")
    for child in original._modules.values():
        if child is not None:
            child.to_empty(device="cpu")
            with torch.no_grad():
                for parameter in child.parameters():
                    parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
    values = {}
    for name in layout.parameters:
        shape = _probe_shape(name, tuple(template.get_parameter(name).shape), layout, intermediate)
        fan_in = shape[-2] if layout.is_transposed else shape[-1]
        scale = 1.0 / fan_in**0.5 if not name.endswith("_bias") else 0.1
        values[name] = torch.randn(shape, generator=generator) * scale
        original._parameters[name] = nn.Parameter(values[name].clone(), requires_grad=False)
    return original, values


def _probe_replacement(
    cls: type[nn.Module], original: nn.Module, values: dict[str, torch.Tensor], layout: Layout
) -> nn.Module:
    replacement = linear_experts_class(cls, layout)
    ours: Any = copy.copy(original)
    ours._parameters = dict(original._parameters)
    ours._buffers = dict(original._buffers)
    ours._modules = {name: copy.deepcopy(child) for name, child in original._modules.items()}
    ours.__class__ = replacement
    num_experts = original.num_experts
    ours._linearize(torch.device("cpu"), values)
    ours.num_experts = num_experts  # the routing's expert count (the probe holds 3 of them)
    result: nn.Module = ours
    return result
