"""hfpatch pack ``fused-dense``: one ``qkv_proj`` and one ``gate_up_proj``, in every model that has the projections.

Found by structure, for every model type alike (``hfpatch_pack_fused_dense.detection``):
the load's model is built on the meta device from its config and walked; every class
whose modules have ``q_proj`` / ``k_proj`` / ``v_proj`` (an attention) or ``gate_proj`` /
``up_proj`` (a gated MLP) as plain ``nn.Linear`` on one input, as its forward's source
shows, is replaced by a subclass (``hfpatch_pack_fused_dense.modules``) in which those
projections are views of one fused ``nn.Linear``-like projection: the family's own
forward runs unchanged, and the fused matmul is computed once per input.  A class it
cannot fuse exactly is refused, with the reason (``refusals``).

The converters concatenate the checkpoint's q/k/v (and gate/up) tensors with
``hfpatch_core.authoring.SizedConcatenate``, which ``save_pretrained`` reverses to an
exact split: checkpoints load as published and save back with the same tensor names,
shapes and values.

Every claim has priority -1: a pack written for a family (``qwen-moe`` on the qwen2_moe /
qwen3_moe attention) wins the classes it also claims, and this pack keeps the others.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any

import hfpatch_core
from hfpatch_core import Converter, LoadContext, PackWarning, Patch, Refusal
from hfpatch_core.authoring import (
    conversion_key,
    conversion_lists,
    fused_linear_converters,
    fused_quantization_problem,
    text_decoder_config,
)

from .detection import Detection, Site, builds_reason, built_part, builtin_converters, detect, model_class_for
from .modules import FusedDense, fused_class

__version__ = "0.1.0"

__all__ = [
    "PRIORITY",
    "SAMPLE_MODEL_TYPES",
    "SCOPED_SUB_MODELS",
    "FusedDense",
    "Fusion",
    "__version__",
    "converter_key",
    "detection_for",
    "fusions_for",
    "provide_converters",
    "provide_model_types",
    "provide_patches",
    "refusals",
]

#: The priority of every patch and converter: a pack written for one family wins its classes.
PRIORITY = -1

#: Where ``hfpatch check`` / ``hfpatch verify`` look when asked for the pack as a whole (the
#: pack decides from a config, so it names some model types to build one from); it is not
#: what the pack applies to, which is every model with the structure.
SAMPLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One class this pack replaces in one load: the patch and the converter it needs.

    Attributes:
        original: the class replaced.
        replacement: its fused subclass.
        sites: where its modules sit, with their sizes.
    """

    original: type
    replacement: type
    sites: tuple[Site, ...]

    @property
    def patch(self) -> Patch:
        """The exact-name patch of ``original`` with ``replacement``, at ``PRIORITY``."""
        return Patch(self.original.__name__, self.replacement, priority=PRIORITY)

    def converter(self, model_type: str) -> Converter:
        """``SizedConcatenate`` of the parts into the fused tensor, per site, for weights and biases (and a
        quantized checkpoint's tensors: ``fused_linear_converters``)."""
        transforms = [
            converter
            for site in self.sites
            for converter in fused_linear_converters(site.path, site.parts, site.fused, site.sizes, bias=site.bias)
        ]
        return Converter(model_type, tuple(transforms), priority=PRIORITY, patch_targets=(self.original.__name__,))


def detection_for(config: Any, model_class_name: str | None = None) -> Detection:
    """The structural detection for ``config`` (cached), on the class ``model_class_name`` if given.

    Raises:
        LookupError: no transformers model class builds from ``config``.
        Exception: whatever building the model on the meta device raises.
    """
    model_class = model_class_for(config, model_class_name)
    if model_class is None:
        raise LookupError(f"no transformers model class for {type(config).__name__}")
    return detect(config, model_class)


def _builtin_conversion_problems(keys: Iterable[str | None], detection: Detection) -> dict[str, str]:
    """Classes whose parts transformers' own conversion lists ``keys`` build from other tensors.

    Some model types publish fused checkpoints that transformers splits into ``q_proj`` /
    ``k_proj`` / ``v_proj`` (or ``gate_proj`` / ``up_proj``) while loading (a
    ``WeightConverter``); a converter of this pack would have to run after that one, which
    no release supports.  Renamings (``c_fc_0`` to ``gate_proj``) run before converters
    and compose.  ``keys``: every list the load reads (``hfpatch_core.authoring.conversion_lists``:
    in a composite model the outer model's too, which transformers applies to every
    sub-model: kimi_k25's splits its vision tower's ``wqkv``).
    """
    problems: dict[str, str] = {}
    for key in dict.fromkeys(key for key in keys if key):
        for transform in builtin_converters(key):
            for name in detection.originals:
                for parts in detection.groups(name).values():
                    part = built_part(transform, parts)
                    if part is not None:
                        problems.setdefault(name, builds_reason(repr(key), transform, part))
    return problems


def refusals(config: Any, model_class_name: str | None = None) -> dict[str, str]:
    """Class name -> why the pack does not fuse it, for a load of ``config``.

    Every class with ``q_proj`` / ``k_proj`` / ``v_proj`` or ``gate_proj`` / ``up_proj``
    children that the pack leaves alone is here, with the reason: parts that are not
    plain ``nn.Linear`` on one input, a bias on some parts only, a forward that gives
    the parts different inputs (a cross-attention) or reaches them through a helper,
    converter patterns that would touch another module, a quantized checkpoint whose
    quantization the fused projection cannot hold (another method than compressed-tensors, or
    a config that quantizes the parts differently).  A model that cannot be built on the meta
    device is one entry named after the config class.

    Args:
        config: the load's config.
        model_class_name: the class the load builds (default: the config's base model).
    """
    try:
        detection = detection_for(config, model_class_name)
    except Exception as exc:  # any model may fail to build on the meta device in its own way
        return {type(config).__name__: f"cannot build the model on the meta device ({type(exc).__name__}: {exc})"}
    composite = (
        {name: COMPOSITE.format(name=name) for name in detection.originals}
        if _composite(config) and not SCOPED_SUB_MODELS
        else {}
    )
    return {
        **detection.rejected,
        **_builtin_conversion_problems([getattr(config, "model_type", None), model_class_name], detection),
        **composite,
        **_quantization_problems(config, detection),
    }


#: Why a quantized checkpoint of a composite model is left alone.
QUANTIZED_COMPOSITE = (
    "a quantized checkpoint of a composite model: its quantizer matches the outer model's module names, "
    "which a sub-model's load does not know"
)


def _quantized(config: Any) -> bool:
    """Whether ``config`` is a quantized checkpoint's (``quantization_config``: compressed-tensors, GPTQ, ...)."""
    return getattr(config, "quantization_config", None) is not None


def _quantization_problems(config: Any, detection: Detection) -> dict[str, str]:
    """Class name -> why a quantized checkpoint's instances of it do not load fused (none for another config).

    A compressed-tensors checkpoint loads fused where its quantization config quantizes
    every part of a fused projection, in every instance, as it quantizes the fused one
    (``hfpatch_core.authoring.fused_quantization_problem``); the converters then fuse the
    parts' whole tensor families.
    """
    if not _quantized(config):
        return {}
    if _composite(config):
        return dict.fromkeys(detection.originals, QUANTIZED_COMPOSITE)
    problems: dict[str, str] = {}
    for name in detection.originals:
        for path in detection.instances.get(name, ()):
            for fused, parts in detection.groups(name).items():
                problem = fused_quantization_problem(config, f"{path}.{fused}", [f"{path}.{part}" for part in parts])
                if problem is not None:
                    problems.setdefault(name, f"{path}: {problem}")
    return problems


def _scoped_sub_models() -> bool:
    """Whether the installed transformers converts each sub-model's weights with that sub-model's
    own list, scoped to its prefix (5.25: ``conversion_mapping.extract_weight_conversions_for_model``);
    5.3 reads the root model type's list only."""
    try:
        from transformers import conversion_mapping
    except ImportError:  # a release without conversion lists
        return False
    return hasattr(conversion_mapping, "extract_weight_conversions_for_model")


#: Whether a composite model's sub-models are claimed in their own loads (see ``fusions_for``).
SCOPED_SUB_MODELS = _scoped_sub_models()

#: Why the classes of a composite model are left alone where transformers reads the root model
#: type's list only (5.3): a converter keyed by the outer model type, unscoped, would also match
#: another sub-model's tensors of the same names (gemma3's text and vision attentions).
COMPOSITE = (
    "a composite model: its {name} sits in a sub-model (the text or vision model) whose weights "
    "transformers converts with that sub-model's own conversion lists, which the pack's converters, "
    "keyed by the outer model type, do not reach"
)


def _composite(config: Any) -> bool:
    """Whether ``config`` holds the configs of sub-models (an image-text model, ...)."""
    text = text_decoder_config(config)
    return text is not config or bool(getattr(config, "sub_configs", None))


def _own_classes(detection: Detection, model_class: type | None) -> set[str]:
    """The fusable classes of ``detection`` defined in ``model_class``'s modeling module.

    A composite model builds its sub-models (``AutoModel.from_config(config.text_config)``)
    in loads of their own, whose classes come from their own modeling modules: each load
    claims the classes of its own module, with converters in its own list (see ``fusions_for``).
    """
    module = getattr(model_class, "__module__", None)
    return {name for name, original in detection.originals.items() if original.__module__ == module}


#: The conversion list a load's converters join (``hfpatch_core.authoring.conversion_key``); the
#: pack's name for it before core had it.
converter_key = conversion_key


def fusions_for(context: LoadContext) -> list[Fusion]:
    """What the pack replaces for one load, in target-name order; empty when it has nothing to do.

    Nothing without a config (the sizes are unknown), nor where the model cannot be built
    on the meta device.  A composite model (an image-text model) builds each sub-model in
    a load of its own: where transformers converts a sub-model's weights with that
    sub-model's own list, scoped to its prefix (5.25), each load claims the classes of its
    own modeling module, the outer load those of the outer model's, with converters whose
    patterns are relative to the sub-model (``converter_key`` names the list).  Where it
    reads the root model type's list only (5.3) a composite model is left alone (its
    sub-models' tensors of one name would meet in one unscoped list), and a sub-model's
    load returns nothing.
    """
    if context.config is None or context.model_type is None:
        return []
    composite = context.parent is not None or _composite(context.config)
    if composite and (not SCOPED_SUB_MODELS or _quantized(context.root.config)):
        return []  # a quantized one: refusals() of the outer load says why (QUANTIZED_COMPOSITE)
    try:
        detection = detection_for(context.config, context.model_class_name)
    except Exception:  # refusals() gives the reason; the model loads as in transformers
        return []
    own = (
        _own_classes(detection, model_class_for(context.config, context.model_class_name))
        if composite
        else set(detection.originals)
    )
    refused = {
        **_builtin_conversion_problems(conversion_lists(context), detection),
        **_quantization_problems(context.config, detection),
    }
    quantizable = _quantized(context.config)
    fusions = [
        Fusion(
            original,
            fused_class(original, detection.groups(name), quantizable=quantizable),
            detection.classes()[name],
        )
        for name, original in detection.originals.items()
        if name not in refused and name in own
    ]
    return sorted(fusions, key=lambda fusion: fusion.original.__name__)


@hfpatch_core.hookimpl
def provide_model_types() -> list[str]:
    """``SAMPLE_MODEL_TYPES``: where ``hfpatch check`` and ``verify`` check the pack by default.

    The pack decides from the config (the sizes come from it), so asked with
    ``config=None`` it returns nothing; this says where to look instead.
    """
    return list(SAMPLE_MODEL_TYPES)


@hfpatch_core.hookimpl
def provide_patches(context: LoadContext) -> list[Patch | Refusal]:
    """The fused classes for a load (see ``fusions_for``), and a ``Refusal`` with the reason for each
    candidate the pack leaves alone (``refusals``), which ``hfpatch explain`` and ``check`` show."""
    patches: list[Patch | Refusal] = [fusion.patch for fusion in fusions_for(context)]
    if context.config is not None and context.model_type is not None and context.parent is None:
        refused = refusals(context.config, context.model_class_name)
        patches += [Refusal(name, reason) for name, reason in sorted(refused.items())]
        if not _quantized(context.config):
            return patches
        try:
            detection = detection_for(context.config, context.model_class_name)
        except Exception:  # refused above, with the reason
            return patches
        for name, reason in sorted(_quantization_problems(context.config, detection).items()):
            # a quantized checkpoint's class left as it loads is not what a user who selected the
            # pack expects: said, not only recorded in the plan
            warnings.warn(f"hfpatch: pack 'fused-dense' leaves {name} unfused: {reason}.", PackWarning, stacklevel=2)
    return patches


@hfpatch_core.hookimpl
def provide_converters(context: LoadContext) -> list[Converter]:
    """One converter per replaced class, keyed by the model type.

    One per class rather than one for all, each naming its patch in ``patch_targets``:
    when another pack wins one class (qwen-moe on the MoE attention, or any pack
    replacing the MLP), only that class's converter is left out with it.
    """
    key = converter_key(context)
    return [fusion.converter(key) for fusion in fusions_for(context)]
