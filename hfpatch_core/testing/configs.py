"""Tiny configs: a model type's default config shrunk, for every family.

``tiny_config(model_type)`` builds the default config anew with its size fields shrunk
(``SHRINK``, ``sizes``), and what depends on them kept consistent by the rules of
``attention_sizes`` (heads, head dims, latent attention, rope sections) and ``layer_kinds``
(layer counts and per-layer patterns, sparse layers, state-space sizes); ``_OVERRIDES`` holds the
model types no rule fits, each with its reason.  ``TINY_DECODER`` is a tiny decoder's fields, for
a test suite's explicit configs.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ..errors import HfPatchError
from .attention_sizes import follow_heads, head_dims, latent_attention, rope_sections
from .layer_kinds import shrink_layers, sparse_experts, state_space
from .sizes import (
    SHRINK,
    changed,
    derived_fields,
    follow_hidden,
    follow_vocabulary,
    init_fields,
    is_int,
    read_field,
    size_of,
    special_tokens,
    text_config,
)

#: A tiny decoder's config fields, for a test suite's explicit configs: ``LlamaConfig(**TINY_DECODER)``,
#: ``Qwen2MoeConfig(**TINY_DECODER, num_experts=4, ...)``, ``{**TINY_DECODER, "vocab_size": 300}``.
#: Grouped-query attention (4 heads, 2 key/value heads), two layers, untied embeddings, token
#: ids 0 (padding), 1 and 2.  ``initializer_range`` is 0.2, ten times transformers' default, so
#: that logits and routing are far from uniform: a permuted head, expert or half, or a missing
#: scale, moves the logits by far more than the fp32 tolerance.  What the first-party packs'
#: suites build their cases from (``tiny_checkpoints`` saves them).
TINY_DECODER: Mapping[str, Any] = MappingProxyType(
    {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 160,
        "max_position_embeddings": 128,
        "initializer_range": 0.2,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
)

#: A QSA token indexer of a tiny qwen4_exp model (one key head, as the config requires).
_QSA_INDEXER: Mapping[str, int] = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 64,
    "indexer_compress_ratio": 16,
}

#: The latent attention of dots3_note's sliding-window layers, as small as SHRINK makes the others.
_SLIDING_LATENT_ATTENTION: Mapping[str, int] = {
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 4,
    "swa_q_lora_rank": 32,
    "swa_kv_lora_rank": 16,
    "swa_head_dim": 16,
    "swa_qk_nope_head_dim": 8,
    "swa_v_head_dim": 16,
}

#: A musicgen config: its sub-configs (which 5.3 requires) and one codebook.
_MUSICGEN: Mapping[str, Any] = {
    "text_encoder": {"model_type": "t5"},
    "audio_encoder": {"model_type": "encodec"},
    "decoder": {"num_codebooks": 1},
}

#: Per-type settings where no generic rule works; each says why.  A callable gets the default
#: config and returns the settings (where they differ between transformers releases).
_OVERRIDES: Mapping[str, Mapping[str, Any] | Callable[[Any], Mapping[str, Any]]] = {
    # the default config leaves layer_types None, which the model indexes per layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # the default config leaves the expert counts None (every real checkpoint sets them)
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # attention_types is run-length coded ([[kinds, repeats]]), not a per-layer list
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # its default layer_types lists attention and MLP blocks apart (two entries a layer, as released
    # config.json files do), which the config halves: unset, it is derived from the layer count
    "dory": {"layer_types": None},
    # its causal LM requires a decoder (the default config is an encoder), and the axial position
    # embedding dims must add up to the hidden size (their defaults add up to 256)
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32]},
    # the default config has no attention layer (every layer Mamba), and the forward needs one for its
    # mask; the kinds are named "mamba"/"attention" up to 5.x, "linear_attention"/"full_attention" after
    "granitemoehybrid": lambda defaults: {
        "layer_types": ["mamba", "attention"]
        if "mamba" in (getattr(defaults, "layers_block_type", None) or ["mamba"])
        else ["linear_attention", "full_attention"]
    },
    # the default config has no rope parameters, which the model reads per layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # the default config is invalid: an assistant's text model has no per-layer inputs
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # the model reads attn_config.rope_theta, which the default attention config does not set, and
    # clamps the projections to clip_qkv (None: "clamp: at least one of min or max must not be None");
    # up to 5.3 its router reads ffn_hidden_size as the hidden size (as large in released checkpoints)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}, "ffn_config": {"ffn_hidden_size": 64}},
    # the cache of transformers 5.25 reads num_hidden_layers, which BltConfig has not (its layers are
    # counted per part): without a cache, the forward runs
    "blt": {"use_cache": False},
    # the shared transformer block of a zamba model is tied across its hybrid layers, which needs two:
    # the first three layers are mamba, mamba, hybrid, and every later one hybrid with period 1
    "zamba": lambda defaults: {
        "num_hidden_layers": 4,
        "attn_layer_period": 1,
        "attn_layer_offset": 0,
        "use_mamba_kernels": False,  # transformers 5.3 requires the CUDA kernels unless told not to use them
        **({"layers_block_type": None} if "layers_block_type" in init_fields(type(defaults)) else {}),
    },
    # the causal LM is the decoder, whose input ids hold one row per codebook (a batch of text token
    # rows is one codebook each); up to 5.3, the config has no default sub-configs
    "musicgen": _MUSICGEN,
    "musicgen_melody": _MUSICGEN,
    # up to 5.3, the forward reads the rotary embedding that only use_mem_rope builds
    "zamba2": {"use_mem_rope": True},
    # with query/key heads half the value heads' size, the cached recurrent state has the wrong shape
    # ("matC_old has wrong shape"): the same size runs
    "xlstm": {"qk_dim_factor": 1.0},
    # the sliding-window layers take their sizes from swa_* arguments (not fields: no rule sees them)
    "dots3_note_text": _SLIDING_LATENT_ATTENTION,
    "dots3_note": {"text_config": _SLIDING_LATENT_ATTENTION},
    # the default config has indexed attention layers but no indexer (its sizes are None): a small one
    "qwen4_exp_text": _QSA_INDEXER,
    "qwen4_exp": {"text_config": _QSA_INDEXER},
    # the forward refuses to run without a language (the default config names none)
    "xmod": {"default_language": "en_XX"},
}


class TinyCheckpointError(HfPatchError, ValueError):
    """A model type whose default config cannot be shrunk: pass an explicit config."""


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The default config of ``model_type`` shrunk (``SHRINK``), then ``overrides``.

    Every sub-config is shrunk too (a composite model's text, vision and audio configs,
    recursively), and what depends on the sizes is kept consistent: per-layer patterns
    (``layer_types``, ``layers_block_type``, ...) cut to the new layer count with one
    layer of each kind kept, layer index lists (``attn_layer_indices``, ...) cut to it,
    every layer of a MoE model sparse (``first_k_dense_replace``, ``decoder_sparse_step``,
    ``mlp_only_layers``, ``moe_layer_freq``, ...), the latent attention dims of MLA models,
    ``head_dim``, and token ids inside the shrunk vocabulary.
    """
    from .._pipeline.model_types import config_for_model, unknown_model_type

    unknown = unknown_model_type(model_type)
    if unknown is not None:
        raise TinyCheckpointError(unknown)
    try:
        try:
            defaults = config_for_model(model_type)
        except Exception:
            # a default config that does not validate (gemma4_assistant): built with the override
            fixed = _OVERRIDES.get(model_type)
            if not isinstance(fixed, Mapping):
                raise
            defaults = config_for_model(model_type, **copy.deepcopy(dict(fixed)))  # (5.3 pops from it)
        fixes = _OVERRIDES.get(model_type, {})
        return shrunk(defaults, {**(fixes(defaults) if callable(fixes) else fixes), **overrides})
    except Exception as exc:
        raise TinyCheckpointError(
            f"the shrunk default {model_type!r} config is invalid ({type(exc).__name__}: {exc}); "
            "pass an explicit config: tiny_checkpoint(MyConfig(...))"
        ) from exc


def shrunk(config: Any, overrides: Mapping[str, Any], text_hidden: int | None = None) -> Any:
    """``config`` built anew with its sizes (and its sub-configs') shrunk, then ``overrides``.

    Built anew, not edited, so that the fields a config derives from its sizes follow
    them; a sub-config keeps what its parent chose for it (``to_diff_dict``).  ``text_hidden``:
    the hidden size of the text model next to this sub-config, which its outputs project to."""
    from transformers import PretrainedConfig

    cls = type(config)
    names = init_fields(cls)
    current = {name: read_field(config, name) for name in names}
    try:
        chosen = config.to_diff_dict()
    except Exception:
        chosen = {}
    values: dict[str, Any] = {
        name: value
        for name, value in chosen.items()
        if name in names and not isinstance(value, dict) and name not in ("transformers_version", "architectures")
    }
    # sizes the config derives from others (default None: zamba's attention_hidden_size = 2 x hidden)
    # are derived anew from the shrunk ones, unless a rule below sets them
    derived = derived_fields(cls)
    for name in [name for name in values if name in derived and is_int(values[name])]:
        del values[name]
    own = dict(overrides)
    text = text_config(config)
    beside = read_field(text, "hidden_size") if text is not None and text is not config else None
    for name, value in current.items():
        if isinstance(value, PretrainedConfig):
            inner = own.pop(name, None)
            if not isinstance(inner, PretrainedConfig):
                # (an override names a sub-config's model type for the parent to build it by: not a field)
                fixes = {key: v for key, v in (inner or {}).items() if key != "model_type"}
                inner = shrunk(value, fixes, beside if value is not text else None)
            # before configs were dataclasses (5.3), some composite configs take a sub-config as a dict only
            # (only what differs from the sub-config's defaults: dbrx's sub-configs refuse the base fields)
            values[name] = inner if dataclasses.is_dataclass(cls) else inner.to_diff_dict()
    for name, small in SHRINK.items():
        value = current.get(name) if name in names else None
        if is_int(value) and value > small:
            values[name] = small
    mha = current.get("num_key_value_heads") == current.get("num_attention_heads")
    if is_int(current.get("kv_lora_rank")) and mha:
        # MLA expands its latent keys to every head: as many key/value heads as heads
        values["num_key_value_heads"] = size_of(values, current, "num_attention_heads")
    follow_hidden(values, current, names)
    if is_int(text_hidden) and text_hidden >= 256:
        # an encoder's (vision, audio) output projected to the text model's width (dots3_note's
        # adapter_out_dim, qwen2_vl's out_hidden_size): the shrunk text width
        for name in names:
            if "out" in name and current.get(name) == text_hidden and not changed(values, current, name):
                values[name] = SHRINK["hidden_size"]
    follow_vocabulary(values, current, names)
    latent_attention(values, current, names)
    head_dims(values, current, names)
    rope_sections(values, current, cls)
    follow_heads(values, current, names, derived)
    state_space(values, current, names)
    sparse_experts(values, current, names)
    shrink_layers(values, current, names)
    special_tokens(values, current, names, config)
    values.update(own)
    return cls(**values)
