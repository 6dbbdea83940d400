"""hfpatch pack ``qwen-moe``: per-expert ``nn.Linear`` experts and fused-QKV attention.

For ``qwen2_moe`` and ``qwen3_moe`` models this pack replaces

* ``Qwen2MoeExperts`` / ``Qwen3MoeExperts`` (two 3-D expert parameters) with
  ``PerExpertExperts``, one ``nn.Linear`` triple per
  expert, so that quantizers and adapters that swap ``nn.Linear`` reach every expert;
* ``Qwen2MoeAttention`` / ``Qwen3MoeAttention`` with a subclass holding one fused
  ``qkv_proj``.

Its converters make the checkpoint load into those modules and save back in the
original layout: the experts converter removes transformers' built-in fusion of the
per-expert checkpoint tensors (the checkpoint already has the per-expert layout), and
the attention converter concatenates ``q_proj`` / ``k_proj`` / ``v_proj`` with an
exactly reversible, size-aware operation.

Only these two model types are targeted: no other transformers model defines or
imports these four classes (families such as olmoe, deepseek_v2 or qwen3_next share
qwen2_moe's *conversion list* but have classes of their own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import hfpatch_core
from hfpatch_core import Converter, LoadContext, Patch
from hfpatch_core.authoring import ExpertsSlicing, fused_linear_converters, split_converters

from .attention import FusedQKVAttention, Qwen2MoeFusedQKVAttention, Qwen3MoeFusedQKVAttention
from .experts import ExpertMLP, PerExpertExperts

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "ExpertMLP",
    "Family",
    "FusedQKVAttention",
    "PerExpertExperts",
    "Qwen2MoeFusedQKVAttention",
    "Qwen3MoeFusedQKVAttention",
    "__version__",
    "provide_converters",
    "provide_patches",
    "qkv_sizes",
]

#: The source patterns of transformers' built-in expert fusion (one per built-in
#: WeightConverter of qwen2_moe / qwen3_moe), as written in ``conversion_mapping.py``.
BUILTIN_EXPERT_FUSION = ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.down_proj.weight")

_QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")

#: transformers' own layout of the experts (its experts class's, what an unpatched model's
#: ``state_dict()`` and ``save_pretrained(save_original_format=False)`` hold): ``gate_up_proj``
#: ``[E, 2 * I, H]`` (gate rows, then up rows) and ``down_proj`` ``[E, H, I]``, split into the
#: per-expert linears at load only (a save writes the checkpoint's per-expert layout).
STACKED_EXPERTS = {
    "gate_up_proj": (("gate_proj.weight", "up_proj.weight"), ExpertsSlicing(halves="concatenated")),
    "down_proj": (("down_proj.weight",), ExpertsSlicing()),
}


@dataclasses.dataclass(frozen=True)
class Family:
    """What the pack replaces in one model type.

    Attributes:
        experts: the exact class name of the 3-D experts module.
        attention: the exact class name of the attention module.
        fused_attention: its fused-QKV replacement.
        bias_attribute: the config attribute that gives q/k/v their bias.
    """

    experts: str
    attention: str
    fused_attention: type[FusedQKVAttention]
    bias_attribute: str


#: The model types this pack patches.
FAMILIES: dict[str, Family] = {
    "qwen2_moe": Family("Qwen2MoeExperts", "Qwen2MoeAttention", Qwen2MoeFusedQKVAttention, "qkv_bias"),
    "qwen3_moe": Family("Qwen3MoeExperts", "Qwen3MoeAttention", Qwen3MoeFusedQKVAttention, "attention_bias"),
}


def qkv_sizes(config: Any) -> tuple[int, int, int]:
    """``(num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)`` for ``config``.

    ``head_dim`` is ``config.head_dim`` where the config sets it, else
    ``hidden_size // num_attention_heads`` (the attention classes' own rule).
    """
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


@hfpatch_core.hookimpl
def provide_patches(context: LoadContext) -> list[Patch]:
    """The experts patch for a qwen2_moe / qwen3_moe load, and the attention patch when the config is known.

    Without a config the q/k/v sizes are unknown, so the attention converter cannot be
    built; the attention patch is then left out too (it would not load a checkpoint
    without its converter).  The experts patch needs no sizes.
    """
    family = FAMILIES.get(context.model_type or "")
    if family is None:
        return []
    patches = [Patch(family.experts, PerExpertExperts)]
    if context.config is not None:
        patches.append(Patch(family.attention, family.fused_attention))
    return patches


@hfpatch_core.hookimpl
def provide_converters(context: LoadContext) -> list[Converter]:
    """The conversions the patches need, keyed by the model type.

    * experts: it ``replaces`` transformers' built-in fusion of
      ``mlp.experts.*.{gate,up,down}_proj.weight`` so that those checkpoint tensors load,
      unchanged, into ``PerExpertExperts`` (and save unchanged); a checkpoint in
      transformers' own stacked layout (``STACKED_EXPERTS``) is split into them at load;
    * attention (only with a config, which gives the sizes): q/k/v weights, and biases
      where the config gives them, concatenated into ``qkv_proj`` by
      ``SizedConcatenate``, which ``save_pretrained``
      reverses to an exact split; a quantized checkpoint's tensors (compressed-tensors'
      ``weight_packed``, ``weight_scale``, ``input_scale``, ...) likewise
      (``fused_linear_converters``).
    """
    model_type = context.model_type or ""
    family = FAMILIES.get(model_type)
    if family is None:
        return []
    stacked = tuple(split_converters("mlp.experts", STACKED_EXPERTS, load_only=True))
    converters = [Converter(model_type, stacked, replaces=BUILTIN_EXPERT_FUSION)]
    config = context.config
    if config is not None:
        bias = bool(getattr(config, family.bias_attribute, False))
        fusions = fused_linear_converters("self_attn", _QKV_PROJECTIONS, "qkv_proj", qkv_sizes(config), bias=bias)
        converters.append(Converter(model_type, tuple(fusions)))
    return converters
