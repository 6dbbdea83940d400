"""Finding the projections to fuse by structure: the model built on the meta device, its modules walked.

For a config, the model the load builds (or, when its class cannot be found, the
config's base model) is built on the meta device (no memory, no initialisation) and
every module in it is inspected.  A module is a *candidate* of a kind when it has all of
that kind's parts as child modules:

* **attention**: ``q_proj``, ``k_proj``, ``v_proj``, fused into ``qkv_proj``;
* **MLP**: ``gate_proj``, ``up_proj``, fused into ``gate_up_proj``.

A candidate class is *claimed* when, in every instance, the parts are exactly
``nn.Linear`` (``hfpatch_core.authoring.views.fusable_parts``: one input size, all or no
bias, one dtype), own their parameters (none shared with another module), and the
class's forward gives all parts the same input (``hfpatch_core.authoring.calls.same_input``,
read from the source).  Otherwise it is *refused*, with the first reason found.  Nothing
depends on the model type's name: the classes come from the modules.

The converters' patterns are the instances' paths after the last layer number (one
pattern per such path where all layers have the same sizes, one per layer otherwise), and
each pattern is checked against every tensor name of the built model: a pattern that
would also convert a tensor of another module refuses the class.

Results are cached by the built class and the config's content (a ``to_dict`` dump), so
repeated loads of one model pay for the build once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch.nn as nn

from hfpatch_core.authoring.calls import builds_by_name, same_input
from hfpatch_core.authoring.meta import build_on_meta
from hfpatch_core.authoring.views import fusable_parts

Kind = Literal["attention", "mlp"]

#: Per kind: the fused child's name and the parts it stands for, in row order.
KINDS: dict[Kind, tuple[str, tuple[str, ...]]] = {
    "attention": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "mlp": ("gate_up_proj", ("gate_proj", "up_proj")),
}


@dataclasses.dataclass(frozen=True)
class Site:
    """One fusable module instance.

    Attributes:
        path: the converters' pattern for its parts' parent: its path after the last
            layer number where all layers agree (``"self_attn"``, ``"mlp.shared_expert"``),
            its whole path (without the base model's prefix) otherwise.
        kind: ``"attention"`` or ``"mlp"``.
        class_name: the module's class name (the patch target).
        sizes: the output sizes of the fused parts, in fused order: ``(q, k, v)`` or ``(gate, up)``.
        bias: whether the fused parts have a bias.
        parts: the parts fused, in row order: the kind's parts, or the subset of them that
            the forward provably gives one input (``("k_proj", "v_proj")`` in a
            cross-attention, where ``q_proj`` reads another input and stays itself);
            default: all the kind's parts.
        fused: the fused child's name (``qkv_proj``, ``gate_up_proj``; ``kv_proj`` for
            ``k_proj`` / ``v_proj``); default: the kind's.
    """

    path: str
    kind: Kind
    class_name: str
    sizes: tuple[int, ...]
    bias: bool
    parts: tuple[str, ...] = ()
    fused: str = ""

    def __post_init__(self) -> None:
        if not self.parts:
            object.__setattr__(self, "parts", KINDS[self.kind][1])
        if not self.fused:
            object.__setattr__(self, "fused", fused_name(self.kind, self.parts))


@dataclasses.dataclass(frozen=True)
class Detection:
    """What ``detect`` found in a model.

    Attributes:
        sites: one per (class, kind, pattern) that is fusable, in module order.
        rejected: class name -> why its modules are not fused (the first problem found).
        originals: class name -> the class, for every class in ``sites``.
        instances: class name -> the module names of its instances (``model.layers.0.self_attn``),
            for every class in ``sites``.
    """

    sites: tuple[Site, ...] = ()
    rejected: Mapping[str, str] = dataclasses.field(default_factory=dict)
    originals: Mapping[str, type] = dataclasses.field(default_factory=dict)
    instances: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def classes(self, kind: Kind | None = None) -> dict[str, tuple[Site, ...]]:
        """Fusable class name -> its sites (of ``kind`` only, when given), in module order."""
        found: dict[str, list[Site]] = {}
        for site in self.sites:
            if kind is None or site.kind == kind:
                found.setdefault(site.class_name, []).append(site)
        return {name: tuple(sites) for name, sites in found.items()}

    def kinds(self, class_name: str) -> tuple[Kind, ...]:
        """The kinds fused in ``class_name``, in ``KINDS`` order."""
        present = {site.kind for site in self.sites if site.class_name == class_name}
        return tuple(kind for kind in KINDS if kind in present)

    def groups(self, class_name: str) -> dict[str, tuple[str, ...]]:
        """Fused child name -> the parts it stands for, in ``class_name``, in ``KINDS`` order."""
        found = {site.kind: (site.fused, site.parts) for site in self.sites if site.class_name == class_name}
        return dict(found[kind] for kind in KINDS if kind in found)


def fused_name(kind: Kind, parts: Sequence[str]) -> str:
    """The fused child's name: the kind's (``qkv_proj``) for all its parts, else their stems joined (``kv_proj``)."""
    fused, every = KINDS[kind]
    if tuple(parts) == every:
        return fused
    return "".join(part.removesuffix("_proj") for part in parts) + "_proj"


def fused_parts(cls: type, kind: Kind) -> tuple[tuple[str, ...], str | None]:
    """The parts of ``kind`` that ``cls.forward`` provably gives one input, and the reason when not all.

    All the kind's parts where ``same_input`` proves it; otherwise the largest subset (of
    two or more, in row order, the first found) that it proves (partial fusion: a
    cross-attention's ``k_proj`` / ``v_proj`` on ``current_states``, ``q_proj`` on
    ``hidden_states``); ``()`` with the reason where no two parts share a proven input.
    The parts left out stay the module's own ``nn.Linear``s, untouched.
    """
    every = KINDS[kind][1]
    problem = same_input(cls, every)
    if problem is None:
        return every, None
    for size in range(len(every) - 1, 1, -1):
        for subset in itertools.combinations(every, size):
            if same_input(cls, subset) is None:
                return subset, problem
    return (), problem


def relative(path: str) -> str:
    """The part of ``path`` after its last layer number: ``layers.3.mlp.shared_expert`` -> ``mlp.shared_expert``.

    ``path`` itself where it has no layer number or ends with one.  A converter's pattern
    matches anywhere in a key, and transformers keeps the rest of the key, layer number
    included, as it is.
    """
    names = path.split(".")
    numbered = [index for index, name in enumerate(names) if name.isdigit()]
    if not numbered or numbered[-1] == len(names) - 1:
        return path
    return ".".join(names[numbered[-1] + 1 :])


def candidate_kinds(module: nn.Module) -> tuple[Kind, ...]:
    """The kinds whose parts ``module`` has, all of them, as child modules."""
    return tuple(
        kind
        for kind, (_, parts) in KINDS.items()
        if all(isinstance(module._modules.get(part), nn.Module) for part in parts)
    )


def _regex(pattern: str) -> re.Pattern[str]:
    # as transformers compiles a WeightConverter's source pattern (core_model_loading)
    body = pattern.replace("*.", r".*\.")
    return re.compile(body + r"(?!\w)" if re.search(r"[a-zA-Z0-9]$", body) else body)


def _module_problem(module: nn.Module, fused: str, parts: Sequence[str], counts: Mapping[int, int]) -> str | None:
    if fused in module._modules or fused in module._parameters or fused in vars(module):
        return f"already has a {fused!r}"
    problem = fusable_parts(module, parts)
    if problem is not None:
        return problem
    for part in parts:
        child: nn.Module = getattr(module, part)
        if counts.get(id(child), 0) > 1 or any(counts.get(id(p), 0) > 1 for p in child.parameters()):
            return f"{part} (or its weight) is shared with another module: a fused copy would untie it"
    return None


def inspect_model(model: nn.Module, prefix: str = "") -> Detection:
    """The fusable sites of a built model (any device; only types, shapes and sources are read).

    Args:
        model: the model, built.
        prefix: the base model's attribute name (``"model"``), left out of the patterns.
    """
    counts: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        counts[id(module)] = counts.get(id(module), 0) + 1
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    rejected: dict[str, str] = {}
    classes: dict[str, type] = {}
    instances: dict[tuple[str, Kind], list[tuple[str, tuple[int, ...], bool]]] = {}
    chosen: dict[tuple[str, Kind], tuple[str, ...]] = {}
    paths: dict[tuple[str, Kind], set[str]] = {}
    modules = dict(model.named_modules())
    names = {type(module).__name__ for module in modules.values()}
    lists: dict[str, list[Any]] = {}
    for path, module in modules.items():
        kinds = candidate_kinds(module)
        if not kinds or getattr(type(module), "hfpatch_packed_modules", None):
            continue
        cls, name = type(module), type(module).__name__
        if classes.setdefault(name, cls) is not cls:
            rejected.setdefault(name, f"two classes named {name} ({classes[name].__module__}, {cls.__module__})")
            continue
        where = path.removeprefix(f"{prefix}.") if prefix else path
        problem = (
            _registry_problem(name, names)
            or _builder_problem(path, name, modules)
            or _converted_above(path, kinds, modules, lists)
        )
        if problem is not None:
            rejected.setdefault(name, f"{path or '<model>'}: {problem}")
            continue
        for kind in kinds:
            parts, unproven = fused_parts(cls, kind)
            problem = _module_problem(module, fused_name(kind, parts), parts, counts) if parts else unproven
            if problem is not None and parts and unproven:
                # the partial fusion failed too: say why neither could be made
                problem = f"{unproven}; and fusing only {'/'.join(parts)}: {problem}"
            if problem is not None:
                rejected.setdefault(name, f"{path or '<model>'}: {problem}")
                continue
            chosen[(name, kind)] = parts
            linears: list[nn.Linear] = [getattr(module, part) for part in parts]
            sizes = tuple(linear.out_features for linear in linears)
            instances.setdefault((name, kind), []).append((where, sizes, linears[0].bias is not None))
            paths.setdefault((name, kind), set()).add(path)
    keys = list(model.state_dict().keys())
    sites: list[Site] = []
    for (name, kind), found in instances.items():
        if name in rejected:
            continue
        by_pattern: dict[str, set[tuple[tuple[int, ...], bool]]] = {}
        for where, sizes, bias in found:
            by_pattern.setdefault(relative(where), set()).add((sizes, bias))
        parts = chosen[(name, kind)]
        short = [
            Site(relative(where) if len(by_pattern[relative(where)]) == 1 else where, kind, name, sizes, bias, parts)
            for where, sizes, bias in found
        ]
        # the whole paths where a short pattern would also match another module's tensors
        whole = [Site(where, kind, name, sizes, bias, parts) for where, sizes, bias in found]
        collision: str | None = None
        for candidate in (short, whole):
            unique = list(dict.fromkeys(candidate))
            problems = (_pattern_problem(site, keys, paths[(name, kind)]) for site in unique)
            collision = next((reason for reason in problems if reason is not None), None)
            if collision is None:
                sites.extend(unique)
                break
        if collision is not None:
            rejected.setdefault(name, collision)
    kept = tuple(site for site in sites if site.class_name not in rejected)
    originals = {site.class_name: classes[site.class_name] for site in kept}
    located = {
        name: tuple(sorted({path for (owner, _), found in paths.items() if owner == name for path in found}))
        for name in originals
    }
    return Detection(kept, rejected, originals, located)


def _registry_problem(name: str, names: Iterable[str]) -> str | None:
    """Why a patch of ``name`` would replace another class of the model, or ``None``."""
    # transformers' registry matches a key with re.search where no class has that exact name
    others = sorted(other for other in names if other != name and re.search(name, other))
    if others:
        return (
            f"transformers' patch registry would also replace {others[0]} (its name contains {name!r}), "
            "which this pack does not fuse"
        )
    return None


def _builder_problem(path: str, name: str, modules: Mapping[str, nn.Module]) -> str | None:
    """Why the module at ``path`` would be built as ``name`` whatever the registry says, or ``None``."""
    parent = path.rpartition(".")[0] if "." in path else ""
    while parent and isinstance(modules[parent], (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        parent = parent.rpartition(".")[0] if "." in parent else ""
    owner: type = type(modules[parent])
    if path and not builds_by_name(owner, name):
        return (
            f"{owner.__name__}.__init__ does not build {name} by its name (a table or a factory): "
            "the patch registry could not replace it"
        )
    return None


def _converted_above(
    path: str, kinds: Iterable[Kind], modules: Mapping[str, nn.Module], lists: dict[str, list[Any]]
) -> str | None:
    """Why transformers' own conversion list of a module above ``path`` (or of the module itself)
    builds a part of ``kinds`` from other tensors, or ``None``.

    transformers converts a sub-module's tensors with the list of the sub-module's class, scoped to its
    path (5.25: unlimited_ocr's ``UnlimitedOcrVisionEncoder`` splits the checkpoint's ``qkv_proj`` into
    ``q_proj`` / ``k_proj`` / ``v_proj``); a converter of this pack would have to run after that one,
    which no release supports.  The root model's lists are ``_builtin_conversion_problems``'s."""
    parts = [part for kind in kinds for part in KINDS[kind][1]]
    prefix = ""
    for name in path.split(".") if path else []:
        prefix = f"{prefix}.{name}" if prefix else name
        owner = type(modules[prefix]).__name__
        if owner not in lists:
            lists[owner] = builtin_converters(owner)
        for transform in lists[owner]:
            part = built_part(transform, parts)
            if part is not None:
                return builds_reason(f"{owner!r} (at {prefix})", transform, part)
    return None


def builtin_converters(key: str) -> list[Any]:
    """The converters (not the renamings, which run first and compose) of transformers' own conversion
    list for ``key`` (a model type or a class name); none on a release without the table."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return []
    return [each for each in get_checkpoint_conversion_mapping(key) or () if isinstance(each, WeightConverter)]


def built_part(transform: Any, parts: Iterable[str]) -> str | None:
    """The first of ``parts`` that converter ``transform`` builds (names in a target pattern), or ``None``."""
    targets = [str(pattern) for pattern in getattr(transform, "target_patterns", None) or ()]
    return next((part for part in parts for target in targets if re.search(rf"(?<!\w){part}(?!\w)", target)), None)


def builds_reason(where: str, transform: Any, part: str) -> str:
    """Why a class is refused: transformers' own converter (of the list ``where`` names) builds ``part``."""
    sources = list(getattr(transform, "source_patterns", []))
    return (
        f"transformers' own conversion for {where} builds {part} from the checkpoint's {sources}: "
        "a second conversion cannot follow it"
    )


def _pattern_problem(site: Site, keys: Iterable[str], paths: set[str]) -> str | None:
    """Why ``site``'s converter patterns would convert other tensors than the parts of the modules at ``paths``."""
    fused, parts = site.fused, site.parts
    for name in (*parts, fused):
        pattern = f"{site.path}.{name}.weight"
        regex = _regex(pattern)
        for key in keys:
            if regex.search(key) and not (key.rsplit(".", 2)[0] in paths and key.rsplit(".", 2)[1] in parts):
                return f"the converter pattern {pattern!r} would also convert {key!r}"
    return None


_CACHE: dict[tuple[type, str], Detection] = {}
_CACHE_LOCK = threading.Lock()
#: Cached detections kept at most (one per model shape; a process rarely loads more).
CACHE_SIZE = 64


def _config_key(config: Any) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=repr)


def model_class_for(config: Any, class_name: str | None = None) -> type[nn.Module] | None:
    """The class a load builds: transformers' class ``class_name`` if it exists, else the config's base model."""
    import transformers
    from transformers.models.auto import modeling_auto

    if class_name:
        found: Any = getattr(transformers, class_name, None)
        config_class = getattr(found, "config_class", None) if isinstance(found, type) else None
        if isinstance(config_class, type) and issubclass(found, nn.Module) and isinstance(config, config_class):
            model_class: type[nn.Module] = found
            return model_class
    for mapping in (modeling_auto.MODEL_MAPPING, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING):
        try:
            built: Any = mapping[type(config)]
        except (KeyError, ValueError):
            continue
        if isinstance(built, type) and issubclass(built, nn.Module):
            return built
    return None


def detect(config: Any, model_class: type[nn.Module]) -> Detection:
    """Build ``model_class(config)`` on the meta device and inspect it (``inspect_model``).

    Args:
        config: the load's config (not changed: a copy is built).
        model_class: the class to build.

    Returns:
        The ``Detection``, cached by ``model_class`` and the config's content.

    Raises:
        Exception: whatever building the model on the meta device raises.
    """
    key = (model_class, _config_key(config))
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
    if cached is not None:
        return cached
    model = build_on_meta(model_class, config)
    detection = inspect_model(model, getattr(model, "base_model_prefix", "") or "")
    with _CACHE_LOCK:
        if len(_CACHE) >= CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = detection
    return detection


def clear_cache() -> None:
    """Forget every cached detection (tests; a process that rebuilds transformers classes)."""
    with _CACHE_LOCK:
        _CACHE.clear()
