"""hfpatch pack ``fused-dense``: one ``qkv_proj`` and one ``gate_up_proj`` per decoder layer.

For the dense decoder families llama, mistral, qwen2 and qwen3 (and the dense parts of
qwen2_moe / qwen3_moe) this pack replaces

* the attention class with a subclass whose q/k/v projections are one ``nn.Linear``
  (``qkv_proj``): one matmul instead of three;
* the SiLU-gated MLP class with a subclass whose gate/up projections are one
  ``nn.Linear`` (``gate_up_proj``): one matmul instead of two.

Which classes, at which module paths and with which sizes, is found **structurally**:
for each load, the family's decoder layers are built on the meta device from the
load's config and inspected (``hfpatch_pack_fused_dense.detection``); only classes
whose every instance has the expected projection layout are patched.  The family table
(``FAMILIES``) says which decoder layer to build and which attention forward each
family has, since a fused forward must reproduce the original one.

The converters concatenate the checkpoint's q/k/v (and gate/up) tensors with
``hfpatch_core.conversion.SizedConcatenate``, which ``save_pretrained`` reverses to
an exact split: checkpoints load as published and save back with the same tensor names,
shapes and values.

Composition with ``qwen-moe``: both packs fuse the qwen2_moe / qwen3_moe attention; this
pack claims those two attention classes (and their converters) at priority -1, so
``qwen-moe`` wins them when both are enabled, and this pack still fuses the shared-expert
and dense MLPs, which ``qwen-moe`` does not touch.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from transformers.core_model_loading import WeightConverter

import hfpatch_core
from hfpatch_core import Converter, LoadContext, Patch
from hfpatch_core.authoring import SizedConcatenate, probes

from .detection import Detection, Site, detect
from .modules import (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    AttentionFlavor,
    FusedGateUpMLP,
    FusedQKVAttention,
    fused_attention_class,
    fused_mlp_class,
)

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "Family",
    "FusedGateUpMLP",
    "FusedQKVAttention",
    "Fusion",
    "__version__",
    "detect_for",
    "fusions_for",
    "provide_converters",
    "provide_model_types",
    "provide_patches",
]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model type the pack fuses.

    Attributes:
        decoder_layer: the decoder-layer class in
            ``transformers.models.<model_type>.modeling_<model_type>``, built on the meta
            device to find the projections.
        attention: the attention class whose forward ``flavor`` reproduces.
        mlp: the gated MLP class (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``).
        flavor: the attention forward's family-specific parts.
        attention_priority: the priority of the attention patch and its converter
            (-1 where another first-party pack fuses the same attention).
    """

    decoder_layer: str
    attention: str
    mlp: str
    flavor: AttentionFlavor
    attention_priority: int = 0


#: The model types this pack patches.
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", LLAMA),
    "mistral": Family("MistralDecoderLayer", "MistralAttention", "MistralMLP", MISTRAL),
    "qwen2": Family("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", QWEN2),
    "qwen3": Family("Qwen3DecoderLayer", "Qwen3Attention", "Qwen3MLP", QWEN3),
    # qwen-moe fuses these attentions too (same layout): it wins them, see the module docstring
    "qwen2_moe": Family("Qwen2MoeDecoderLayer", "Qwen2MoeAttention", "Qwen2MoeMLP", LLAMA, attention_priority=-1),
    "qwen3_moe": Family("Qwen3MoeDecoderLayer", "Qwen3MoeAttention", "Qwen3MoeMLP", QWEN3, attention_priority=-1),
}

_PARTS = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
_FUSED = {"attention": "qkv_proj", "mlp": "gate_up_proj"}


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One class this pack replaces in one load: the patch and the converter it needs.

    Attributes:
        original: the transformers class replaced.
        replacement: its fused subclass.
        sites: where its modules sit in a decoder layer, with their sizes.
        priority: the priority of the patch and of the converter.
    """

    original: type
    replacement: type
    sites: tuple[Site, ...]
    priority: int = 0

    @property
    def patch(self) -> Patch:
        """The exact-name patch of ``original`` with ``replacement``, at ``priority``."""
        return Patch(self.original.__name__, self.replacement, priority=self.priority)

    def converter(self, model_type: str) -> Converter:
        """``SizedConcatenate`` of the parts into the fused tensor, per site, for weights and biases."""
        transforms = []
        for site in self.sites:
            prefix = f"{site.path}." if site.path else ""
            for suffix in ("weight", "bias") if site.bias else ("weight",):
                # operations= by keyword: the third positional field differs between 5.3 and later
                transforms.append(
                    WeightConverter(
                        source_patterns=[f"{prefix}{part}.{suffix}" for part in _PARTS[site.kind]],
                        target_patterns=f"{prefix}{_FUSED[site.kind]}.{suffix}",
                        operations=[SizedConcatenate(dim=0, sizes=site.sizes)],
                    )
                )
        return Converter(model_type, tuple(transforms), priority=self.priority, patch_targets=(self.original.__name__,))


def _submodel_conversions_supported() -> bool:
    # transformers 5.3 applies the root model type's conversions only (see hfpatch's README)
    return probes.class_keys_supported()


def detect_for(model_type: str, config: Any) -> Detection:
    """The structural detection for ``config`` of a covered ``model_type`` (cached).

    Raises:
        KeyError: ``model_type`` is not in ``FAMILIES``.
        ValueError: see ``hfpatch_pack_fused_dense.detection.detect``.
    """
    return detect(config, getattr(_modeling(model_type), FAMILIES[model_type].decoder_layer))


def _modeling(model_type: str) -> Any:
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def fusions_for(context: LoadContext) -> list[Fusion]:
    """What the pack replaces for one load, in target-name order; empty when it has nothing to do.

    Nothing for a model type outside ``FAMILIES``, for a context without a config
    (the sizes are unknown, and a fused class would not load a checkpoint without its
    sized converter), and for a sub-model (a composite model's text model) on a
    transformers release that cannot run a sub-model's conversions (5.3).
    """
    family = FAMILIES.get(context.model_type or "")
    if family is None or context.config is None or context.model_type is None:
        return []
    if context.parent is not None and not _submodel_conversions_supported():
        return []
    modeling = _modeling(context.model_type)
    detection = detect_for(context.model_type, context.config)
    fusions = []
    attention = detection.classes("attention").get(family.attention, ())
    if attention and all(site.qk_norm == family.flavor.qk_norm for site in attention):
        original = getattr(modeling, family.attention)
        replacement = fused_attention_class(original, family.flavor)
        fusions.append(Fusion(original, replacement, attention, family.attention_priority))
    mlp = detection.classes("mlp").get(family.mlp, ())
    if mlp:
        original = getattr(modeling, family.mlp)
        fusions.append(Fusion(original, fused_mlp_class(original), mlp))
    return sorted(fusions, key=lambda fusion: fusion.original.__name__)


@hfpatch_core.hookimpl
def provide_model_types() -> list[str]:
    """The model types of ``FAMILIES``: ``hfpatch check`` and ``verify`` check the pack on these.

    The pack decides from the config (the sizes come from it), so asked with
    ``config=None`` it returns nothing; this says where to look instead.
    """
    return list(FAMILIES)


@hfpatch_core.hookimpl
def provide_patches(context: LoadContext) -> list[Patch]:
    """The fused attention and MLP classes for a load of a covered family (see ``fusions_for``)."""
    return [fusion.patch for fusion in fusions_for(context)]


@hfpatch_core.hookimpl
def provide_converters(context: LoadContext) -> list[Converter]:
    """One converter per replaced class, keyed by the model type, with that class's priority.

    One per class rather than one for all, each naming its patch in ``patch_targets``:
    when another pack wins one class (qwen-moe on the MoE attention, or any pack
    replacing the MLP), only that class's converter is left out with it.
    """
    model_type = context.model_type or ""
    return [fusion.converter(model_type) for fusion in fusions_for(context)]
