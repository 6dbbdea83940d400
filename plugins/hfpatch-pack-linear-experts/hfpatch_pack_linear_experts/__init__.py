"""hfpatch pack ``linear-experts``: every MoE experts module as one ``nn.Linear`` per expert and projection.

transformers 5 stores routed experts as 3-D parameters behind ``use_experts_implementation``;
quantizers, PEFT and calibration hooks that work on ``nn.Linear`` never see them.  For any
model, this pack finds the experts classes structurally (``discovery``: the classes whose
forward is the decorator's, read through the decorator's metadata and the parameters'
shapes, never a table of class names) and replaces each with a drop-in holding
``experts.<e>.<gate>/<up>/<down>`` ``nn.Linear`` modules, named as transformers' own
conversion mapping names the per-expert checkpoint tensors (``gate_proj``, mixtral's
``w1``/``w3``/``w2``).

Converters: per-expert checkpoints load unchanged into the per-expert modules (the
converter ``replaces`` transformers' stacking ``MergeModulelist`` converters, so no stacked
copy is made), and save unchanged: what vanilla transformers writes.  Families whose
checkpoints store the experts 3-D (no stacking converter) get one converter per 3-D tensor
(``conversion``): split into the per-expert modules at load, stacked back on save; each
expert's tensors are views of the loaded 3-D tensor, and gate/up stored interleaved
(gpt_oss) stay one per-expert ``gate_up_proj``, so that no weight is copied.

A class whose eager forward is not the per-expert loop, or whose layout the pack cannot
convert exactly, is refused: no patch, and a ``Refusal`` with the reason (``hfpatch explain`` / ``check``).

Sharded loads (tensor, expert parallelism, FSDP2): each derived class declares how its
per-expert linears shard, derived from the model's own plans for the 3-D experts
(``sharding``), or why it cannot (refused before any weight is read).

Priority: ``PRIORITY`` (-1), below ``qwen-moe`` (0): with both installed, qwen-moe keeps
qwen2_moe / qwen3_moe's experts and this pack the other families.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import hfpatch_core
from hfpatch_core import Converter, LoadContext, Patch, Refusal
from hfpatch_core.authoring import conversion_key, conversion_lists, text_decoder_config
from hfpatch_core.authoring.experts import (
    ExpertsSlicing,
    LoadOnlySplitConverter,
    SplitExperts,
    SplitExpertsConverter,
    StackExperts,
    split_converters,
)
from hfpatch_core.conversion import source_patterns_of, target_patterns_of

from .discovery import Candidate, Discovery, discover, per_expert_names
from .experts import DEFAULT_NAMES, ExpertLinears, Layout, LinearExperts, linear_experts_class

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_NAMES",
    "PACK",
    "PRIORITY",
    "Candidate",
    "Discovery",
    "ExpertLinears",
    "ExpertsSlicing",
    "Layout",
    "LinearExperts",
    "LoadOnlySplitConverter",
    "SplitExperts",
    "SplitExpertsConverter",
    "StackExperts",
    "__version__",
    "discover",
    "discovery_for",
    "linear_experts_class",
    "per_expert_names",
    "provide_converters",
    "provide_patches",
    "split_converters",
]

PACK = "linear-experts"

#: The priority of every patch and converter: below the default 0, so that a pack made
#: for one family (qwen-moe for qwen2_moe / qwen3_moe) wins the classes both claim.
PRIORITY = -1


def discovery_for(context: LoadContext) -> Discovery:
    """What the pack replaces and refuses in the model of ``context`` (nothing without a config)."""
    if context.config is None or context.model_type is None:
        return Discovery()
    found = _own_classes(context, discover(context.config, context.model_type, context.model_class_name))
    converted = _converted_by_the_composite(context, found)
    if not converted:
        return found
    return Discovery(
        tuple(c for c in found.candidates if c.original.__name__ not in converted), {**found.refused, **converted}
    )


def _own_classes(context: LoadContext, found: Discovery) -> Discovery:
    """``found`` without the classes a composite model builds in a sub-model load of another modeling
    module (kimi_k25's deepseek_v3 text model): that load claims them, or refuses them with its reason,
    with its own converters; claimed here, they would be replaced with the composite's."""
    config = context.config
    text = text_decoder_config(config)
    if context.parent is not None or text is config or not found.candidates:
        return found
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(context.model_type or "")
    module = f"transformers.models.{name}.modeling_{name}"
    return Discovery(tuple(c for c in found.candidates if c.original.__module__ == module), found.refused)


def _converted_by_the_composite(context: LoadContext, found: Discovery) -> dict[str, str]:
    """The experts classes of a composite model whose tensors another conversion list of the load
    converts, other than the stacking the pack replaces (kimi_k25 stacks its text model's
    per-expert weights in its own list, inkling2's text model re-interleaves ``w13_weight``), with
    the reason they are refused.

    transformers applies the composite's list unscoped and before a sub-model's (and each
    sub-model's scoped to it), so the converters of the load that claims the experts (the
    split into per-expert linears, or the removal of the stacking) would not see the
    tensors as the checkpoint stores them: the per-expert linears would be left random.
    """
    root = context.root
    config = root.config
    text = text_decoder_config(config)
    if (root is context and text is config) or not found.candidates:
        return {}
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a release without the table converts nothing by key
        return {}
    if root is context:  # the composite claims: its sub-models' lists apply to the tensors too
        keys = [root.model_class_name, root.model_type, *_sub_model_keys(root.model_type or "", config)]
    else:
        # the lists of the load that claims are its own (a head's base model, built in a load of its own
        # inside the head's, reads the same model type's list): only another model's count
        own = {context.model_type, conversion_key(context)}
        keys = [key for key in conversion_lists(context) if key not in own]
    # converters only: a renaming of legacy names (aria's experts.fc1) leaves the tensors as they are;
    # and transformers' own (the outer load registered this pack's split where it claims the class)
    transforms = [
        t
        for key in dict.fromkeys(keys)
        if key
        for t in get_checkpoint_conversion_mapping(key) or ()
        if getattr(t, "operations", None) and not type(t).__module__.startswith(__name__)
    ]
    refused = {}
    for candidate in found.candidates:
        for transform in transforms:
            sources = source_patterns_of(transform)
            patterns = [*sources, *target_patterns_of(transform)]
            # a claim in the composite's own load replaces its stacking in every list the load reads; a
            # sub-model's claim replaces it in the sub-model's list only, not in the composite's
            replaced = root is context and set(sources) & set(candidate.stacking)
            if replaced or not any(_EXPERTS.search(p) for p in patterns):
                continue
            refused[candidate.original.__name__] = (
                f"the composite model's conversion lists ({', '.join(k for k in dict.fromkeys(keys) if k)}) "
                f"convert its experts' tensors ({patterns[0]!r}) where the pack's converters do not "
                "reach them: the per-expert linears would not receive them"
            )
            break
    return refused


#: A pattern about experts' tensors (``mlp.experts.gate_up_proj``, ``experts\\.(\\d+)\\.w1``), not ``shared_experts``.
_EXPERTS = re.compile(r"(?<![A-Za-z_])experts(?![A-Za-z_])")


def _sub_model_keys(model_type: str, config: Any) -> list[str]:
    """The conversion list keys of a composite model's sub-models: each one's model type, and the
    class of the composite's modeling module built from its config (``UnlimitedOcrTextModel``:
    transformers looks a class's list up first)."""
    import inspect

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        module = None
    keys = []
    for sub in _sub_configs(config):
        keys.append(str(getattr(sub, "model_type", "")))
        for cls_name, cls in inspect.getmembers(module, inspect.isclass) if module is not None else ():
            if getattr(cls, "config_class", None) is type(sub):
                keys.append(cls_name)
    return [key for key in keys if key]


def _sub_configs(config: Any) -> list[Any]:
    """The sub-configs of a composite config (its text, vision, audio configs)."""
    names = getattr(type(config), "sub_configs", None) or {}
    return [sub for name in names if (sub := getattr(config, name, None)) is not None]


@hfpatch_core.hookimpl
def provide_patches(context: LoadContext) -> list[Patch | Refusal]:
    """One exact-name patch per experts class found, at ``PRIORITY``; a ``Refusal`` with the reason per
    experts class it cannot convert exactly (``hfpatch explain`` and ``check`` show it).

    Without a config the experts cannot be built, so nothing is returned (``hfpatch
    check`` then asks with a config of each model type).
    """
    found = discovery_for(context)
    refusals = [Refusal(name, reason) for name, reason in found.refused.items()]
    return [*(Patch(c.original.__name__, c.replacement, priority=PRIORITY) for c in found.candidates), *refusals]


@hfpatch_core.hookimpl
def provide_converters(context: LoadContext) -> list[Converter]:
    """Per experts class: remove transformers' stacking of the per-expert tensors, which then load
    unchanged into the per-expert modules (no stacked copy is made), and save unchanged, while the
    stacked layout transformers' own model holds (``save_original_format=False``, an unpatched
    model's ``state_dict``) is split at load only (``LoadOnlySplitConverter``); or, for
    checkpoints storing the experts 3-D, split each 3-D tensor at load and stack it back on save.
    Tied to the classes' patches, so that a class another pack wins keeps transformers' conversion."""
    load_key = conversion_key(context)
    converters: list[Converter] = []
    # (list, transformers' stacking patterns) -> (class, its load-only split converters) per class they stack
    removals: dict[tuple[str, tuple[str, ...]], list[tuple[str, tuple[SplitExpertsConverter, ...]]]] = {}
    for candidate in discovery_for(context).candidates:
        target = candidate.original.__name__
        # the list transformers converts these experts with (a sub-model class's, dots3_note_text's) else the load's
        model_type = candidate.list_key or load_key
        if candidate.stored_3d:
            transforms = tuple(
                t for path in candidate.paths for t in split_converters(path, _split_parameters(candidate.layout))
            )
            converters.append(
                Converter(
                    model_type, transforms, replaces=candidate.stacking, priority=PRIORITY, patch_targets=(target,)
                )
            )
        else:
            # the per-expert checkpoint loads unchanged; the stacked layout transformers' own model
            # holds (its state dict, save_pretrained(save_original_format=False)) is split at load
            transforms = tuple(
                t
                for path in candidate.paths
                for t in split_converters(path, _split_parameters(candidate.layout), load_only=True)
            )
            removals.setdefault((model_type, candidate.stacking), []).append((target, transforms))
    for (key, patterns), entries in removals.items():
        converters.append(
            Converter(
                key,
                tuple(t for _, transforms in entries for t in transforms),
                replaces=patterns,
                priority=PRIORITY,
                patch_targets=tuple(target for target, _ in entries),
            )
        )
    return converters


def _split_parameters(layout: Layout) -> dict[str, tuple[tuple[str, ...], ExpertsSlicing]]:
    """Per 3-D parameter of ``layout``: the per-expert tensors it is cut into, and how (``split_converters``)."""
    gate, up, down = layout.names
    if layout.joined:
        first: tuple[str, tuple[str, ...], str | None] = ("gate_up_proj", (up,), None)
    elif gate is not None:
        first = ("gate_up_proj", (gate, up), "concatenated")
    else:
        first = ("up_proj", (up,), None)
    parameters: dict[str, tuple[tuple[str, ...], ExpertsSlicing]] = {}
    for name, modules, cut in (first, ("down_proj", (down,), None)):
        parameters[name] = (tuple(f"{m}.weight" for m in modules), ExpertsSlicing(layout.is_transposed, cut))
        if layout.has_bias:
            parameters[f"{name}_bias"] = (tuple(f"{m}.bias" for m in modules), ExpertsSlicing(False, cut))
    return parameters
