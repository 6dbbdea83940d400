"""Tiny configs and checkpoints: a model type's default config shrunk, saved with random weights.

``tiny_config(model_type)`` shrinks the size fields of a default config (``SHRINK``);
``tiny_checkpoint(model_type_or_config)`` saves a small random model of it with
``save_pretrained`` (safetensors), deterministic from a seed.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeGuard

import torch
import torch.nn as nn

from ..authoring.meta import meta_init_skipped
from ..errors import HfPatchError

#: Values ``tiny_checkpoint`` gives the size fields of a default config (and of each of its
#: sub-configs), where present and larger.
SHRINK: Mapping[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "max_window_layers": 2,
    "sliding_window": 64,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
    "n_inner": 128,
    "d_model": 64,
    "num_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "ffn_hidden_size": 128,
    "ffn_dim": 128,
    "mlp_dim": 128,
    "num_kv_heads": 2,
    "emb_dim": 64,
    "embed_dim": 64,
    "n_heads": 4,
    "n_layers": 2,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,
    # multi-head latent attention (deepseek_v2/v3 and their kin): kept consistent in _latent_attention
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
}

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

#: The fields that count a model's layers: a list as long as one of them is a per-layer pattern.
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "encoder_layers", "n_layers")

#: Fields that keep the first layers of a MoE model dense: 0 (or 1) makes every layer sparse.
_ALL_SPARSE: Mapping[str, int] = {
    "first_k_dense_replace": 0,
    "first_k_dense": 0,
    "num_dense_layers": 0,
    "moe_layer_start_index": 0,
    "decoder_sparse_step": 1,
    "moe_layer_freq": 1,
    "sparse_step": 1,
    "expert_interval": 1,
}

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
        **({"layers_block_type": None} if "layers_block_type" in _init_fields(type(defaults)) else {}),
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

#: The folder that holds the checkpoints ``tiny_checkpoint`` saves without a directory: one per
#: process, removed when the process exits (by the process that made it, not a forked child).
_scratch: dict[int, Path] = {}


def _remove(path: Path, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _scratch_directory() -> Path:
    pid = os.getpid()
    path = _scratch.get(pid)
    if path is None or not path.is_dir():
        path = _scratch[pid] = Path(tempfile.mkdtemp(prefix="hfpatch-tiny-"))
        atexit.register(_remove, path, pid)
    return path


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
    from transformers import AutoConfig

    from .._pipeline.model_types import unknown_model_type

    unknown = unknown_model_type(model_type)
    if unknown is not None:
        raise TinyCheckpointError(unknown)
    try:
        try:
            defaults = AutoConfig.for_model(model_type)
        except Exception:
            # a default config that does not validate (gemma4_assistant): built with the override
            fixed = _OVERRIDES.get(model_type)
            if not isinstance(fixed, Mapping):
                raise
            defaults = AutoConfig.for_model(model_type, **copy.deepcopy(dict(fixed)))  # (5.3 pops from it)
        fixes = _OVERRIDES.get(model_type, {})
        return _shrunk(defaults, {**(fixes(defaults) if callable(fixes) else fixes), **overrides})
    except Exception as exc:
        raise TinyCheckpointError(
            f"the shrunk default {model_type!r} config is invalid ({type(exc).__name__}: {exc}); "
            "pass an explicit config: tiny_checkpoint(MyConfig(...))"
        ) from exc


def _init_fields(cls: type) -> set[str]:
    """The names a config class takes at construction (its dataclass fields, or ``__init__``'s parameters)."""
    if dataclasses.is_dataclass(cls):
        return {field.name for field in dataclasses.fields(cls) if field.init}
    parameters = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}


def _read(config: Any, name: str) -> Any:
    # per-layer configs (gemma4, dots3_note) raise on a global read of a per-layer field: the global value
    # as stored, where there is one
    try:
        return getattr(config, name, None)
    except Exception:
        return vars(config).get(name)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrunk(config: Any, overrides: Mapping[str, Any], text_hidden: int | None = None) -> Any:
    """``config`` built anew with its sizes (and its sub-configs') shrunk, then ``overrides``.

    Built anew, not edited, so that the fields a config derives from its sizes follow
    them; a sub-config keeps what its parent chose for it (``to_diff_dict``).  ``text_hidden``:
    the hidden size of the text model next to this sub-config, which its outputs project to."""
    from transformers import PretrainedConfig

    cls = type(config)
    names = _init_fields(cls)
    current = {name: _read(config, name) for name in names}
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
    derived = _derived(cls)
    for name in [name for name in values if name in derived and _is_int(values[name])]:
        del values[name]
    own = dict(overrides)
    text = _text_config(config)
    beside = _read(text, "hidden_size") if text is not None and text is not config else None
    for name, value in current.items():
        if isinstance(value, PretrainedConfig):
            inner = own.pop(name, None)
            if not isinstance(inner, PretrainedConfig):
                # (an override names a sub-config's model type for the parent to build it by: not a field)
                fixes = {key: v for key, v in (inner or {}).items() if key != "model_type"}
                inner = _shrunk(value, fixes, beside if value is not text else None)
            # before configs were dataclasses (5.3), some composite configs take a sub-config as a dict only
            # (only what differs from the sub-config's defaults: dbrx's sub-configs refuse the base fields)
            values[name] = inner if dataclasses.is_dataclass(cls) else inner.to_diff_dict()
    for name, small in SHRINK.items():
        value = current.get(name) if name in names else None
        if _is_int(value) and value > small:
            values[name] = small
    mha = current.get("num_key_value_heads") == current.get("num_attention_heads")
    if _is_int(current.get("kv_lora_rank")) and mha:
        # MLA expands its latent keys to every head: as many key/value heads as heads
        values["num_key_value_heads"] = _size(values, current, "num_attention_heads")
    _follow_hidden(values, current, names)
    if _is_int(text_hidden) and text_hidden >= 256:
        # an encoder's (vision, audio) output projected to the text model's width (dots3_note's
        # adapter_out_dim, qwen2_vl's out_hidden_size): the shrunk text width
        for name in names:
            if "out" in name and current.get(name) == text_hidden and not _changed(values, current, name):
                values[name] = SHRINK["hidden_size"]
    _follow_vocabulary(values, current, names)
    _latent_attention(values, current, names)
    _head_dim(values, current, names)
    _rope_sections(values, current, cls)
    _follow_heads(values, current, names, derived)
    _state_space(values, current, names)
    _experts(values, current, names)
    _layers(values, current, names)
    _tokens(values, current, names, config)
    values.update(own)
    return cls(**values)


def _follow_hidden(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Fields that equal the hidden size by default (``embedding_dim``, ``attention_hidden_size``,
    ``adapter_input_size``, ...) shrink with it; a missing key/value head count means one per head."""
    old, new = current.get("hidden_size"), values.get("hidden_size")
    if _is_int(old) and _is_int(new) and old >= 256:
        for name in names:
            if name in SHRINK or name.endswith(("_token_id", "_token_index")):
                continue
            if _is_int(current.get(name)) and current[name] == old and values.get(name, old) == old:
                values[name] = new
    if "num_key_value_heads" in names and current.get("num_key_value_heads") is None:
        heads = _size(values, current, "num_attention_heads")
        if _is_int(heads):
            values["num_key_value_heads"] = heads


def _follow_vocabulary(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Other vocabulary sizes (``unpadded_vocab_size``, hashed byte-group vocabularies) at most the
    shrunk one: an unpadded vocabulary larger than the padded one gives a negative size."""
    old, new = current.get("vocab_size"), values.get("vocab_size")
    if not (_is_int(old) and _is_int(new)):
        return
    for name in names:
        if "vocab" in name and name not in SHRINK and _is_int(current.get(name)) and current[name] > new:
            values[name] = new


def _derived(cls: type) -> set[str]:
    """The fields of a config class whose default is ``None``: the config derives them from others."""
    if dataclasses.is_dataclass(cls):
        return {field.name for field in dataclasses.fields(cls) if field.init and field.default is None}
    parameters = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {p.name for p in parameters if p.default is None}


def _follow_heads(values: dict[str, Any], current: Mapping[str, Any], names: set[str], derived: set[str]) -> None:
    """Other attention head counts and head dims follow the attention's: equal to the old head count (or
    key/value head count, or head dim) they take the new one; an indexer's heads, larger than the new
    head count, the query heads of one key/value head (it scores with at most those); hidden sizes of
    other parts shrink.
    A field the config derives (``derived``: default ``None``) is left for it to derive."""
    heads, kv = _size(values, current, "num_attention_heads"), _size(values, current, "num_key_value_heads")
    old_heads, old_kv = current.get("num_attention_heads"), current.get("num_key_value_heads")
    head_dim, old_head_dim = values.get("head_dim"), current.get("head_dim")
    for name in names:
        value = current.get(name)
        if name in SHRINK or name in derived or not _is_int(value) or _changed(values, current, name):
            continue
        if name.endswith("heads") and _is_int(heads) and _is_int(old_heads) and old_heads != heads:
            # (other heads, linear attention's or Mamba's, keep their own counts)
            if name.endswith("attention_heads") and value == old_heads:
                values[name] = heads
            elif name.endswith("key_value_heads") and _is_int(kv) and value >= min(kv, old_kv or kv):
                values[name] = kv  # (at most as many as the query heads it serves)
            elif "index" in name and value > heads:
                values[name] = max(1, heads // kv) if _is_int(kv) and kv else 1
        elif name.endswith("head_dim") and _is_int(head_dim) and value == old_head_dim != head_dim:
            values[name] = head_dim
        elif "hidden_size" in name and value >= 256:
            values[name] = SHRINK["hidden_size"]


def _state_space(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Mamba layers: heads x head dim = expand x hidden, with a small state."""
    hidden = _size(values, current, "hidden_size")
    for heads, head_dim, expand, state in (
        ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_state"),
        ("num_heads", "head_dim", "expand", "state_size"),
    ):
        if not all(name in names for name in (heads, head_dim, expand)) or not _is_int(hidden):
            continue
        factor = current.get(expand)
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not _is_int(current.get(heads)):
            continue
        values[head_dim] = 16
        values[heads] = max(1, int(factor * hidden) // 16)
        if "mamba_d_ssm" in names and _is_int(current.get("mamba_d_ssm")):
            values["mamba_d_ssm"] = values[heads] * 16  # the state-space width, set apart (falcon_h1)
        if state in names and _is_int(current.get(state)) and current[state] > 16:
            values[state] = 16
        groups = next((g for g in ("mamba_n_groups", "n_groups") if g in names), None)
        if groups is not None and _is_int(current.get(groups)) and values[heads] % current[groups]:
            values[groups] = 1


def _changed(values: Mapping[str, Any], current: Mapping[str, Any], name: str) -> bool:
    """Whether a rule (or ``SHRINK``) already set ``name``."""
    return name in values and values[name] != current.get(name)


def _size(values: Mapping[str, Any], current: Mapping[str, Any], name: str) -> Any:
    return values.get(name, current.get(name))


def _latent_attention(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """MLA (``kv_lora_rank``): the query/key head is the no-position part plus the rotary part,
    and ``head_dim`` (where the config has one) is the rotary part's size, as in deepseek_v3."""
    if not _is_int(current.get("kv_lora_rank")):
        return
    if "q_lora_rank" in names and current.get("q_lora_rank") is None:
        values.pop("q_lora_rank", None)  # no query compression in this model: stays so
    rope, nope = _size(values, current, "qk_rope_head_dim"), _size(values, current, "qk_nope_head_dim")
    if "qk_head_dim" in names and _is_int(rope) and _is_int(nope):
        values["qk_head_dim"] = rope + nope
    old_head, old_rope = current.get("head_dim"), current.get("qk_rope_head_dim")
    if "head_dim" in names and _is_int(old_head) and _is_int(rope):
        if old_head == old_rope:
            values["head_dim"] = rope
        elif _is_int(nope) and _is_int(old_rope) and old_head == old_rope + (current.get("qk_nope_head_dim") or 0):
            values["head_dim"] = rope + nope
    values["_mla"] = True


def _head_dim(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """``head_dim`` = hidden / heads (unless MLA set it); a partial rotary dim keeps its fraction."""
    mla = values.pop("_mla", False)
    hidden = next((_size(values, current, n) for n in ("hidden_size", "n_embd", "d_model") if current.get(n)), None)
    heads = _size(values, current, "num_attention_heads") or _size(values, current, "n_head")
    if not (_is_int(hidden) and _is_int(heads) and heads):
        return
    old_hidden = current.get("hidden_size") or current.get("n_embd") or current.get("d_model")
    old_heads = current.get("num_attention_heads") or current.get("n_head")
    new_head = hidden // heads
    # a Mamba2 head_dim is the state-space head's (_state_space)
    state_space = "expand" in names
    unset = current.get("head_dim") is None  # hunyuan, ministral: the model reads it unset
    if "head_dim" in names and not mla and not state_space and (_is_int(current.get("head_dim")) or unset):
        values["head_dim"] = new_head
    for name in ("d_head", "d_kv", "attention_head_size"):
        if name in names and _is_int(current.get(name)):
            values[name] = new_head
    old_head = current.get("head_dim") if _is_int(current.get("head_dim")) else None
    if old_head is None and _is_int(old_hidden) and _is_int(old_heads) and old_heads:
        old_head = old_hidden // old_heads
    rotary = current.get("rotary_dim")
    if "rotary_dim" in names and _is_int(rotary) and old_head:
        head = values.get("head_dim", new_head)
        values["rotary_dim"] = max(2, (rotary * head // old_head) // 2 * 2)
    if old_head:
        values["_head"] = values.get("head_dim", new_head)


def _rope_sections(values: dict[str, Any], current: Mapping[str, Any], cls: type) -> None:
    """Multimodal rope sections (qwen2_vl's ``mrope_section`` [16, 24, 24]) add up to half the rotary
    dims of a head: they shrink with the head, each kept at least 1, their sum scaled exactly.  A
    config that leaves them to the model's default (``[16, 24, 24]`` in qwen2_5_vl's modeling code;
    the config declares the key in ``ignore_keys_at_rope_validation``) gets them at that default's
    proportions of the shrunk head's rotary dims."""
    head = values.pop("_head", None)
    rope = current.get("rope_parameters")
    declared = "mrope_section" in (getattr(cls, "ignore_keys_at_rope_validation", None) or ()) or _names(
        cls, "mrope_section"
    )
    if head is None or not isinstance(rope, dict) or not (declared or "mrope_section" in rope):
        return
    sections = rope.get("mrope_section")
    partial = rope.get("partial_rotary_factor", current.get("partial_rotary_factor")) or 1.0
    total = max(3, int(head * float(partial)) // 2)
    if not isinstance(sections, list) or not sections or not all(map(_is_int, sections)):
        sections = [16, 24, 24]
    scaled = [max(1, section * total // sum(sections)) for section in sections]
    scaled[-1] += total - sum(scaled)
    if scaled[-1] >= 1 and scaled != sections:
        values["rope_parameters"] = {**rope, **values.get("rope_parameters", {}), "mrope_section": scaled}


def _names(cls: type, key: str) -> bool:
    """Whether the source of config class ``cls`` names ``key`` (up to 5.3 the rope keys a config leaves
    to its model are an argument of ``__init__``'s validation call, not a class attribute)."""
    try:
        return key in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


def _experts(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Every layer sparse where the config allows, and routing settings that fit the fewer experts."""
    for name, sparse in _ALL_SPARSE.items():
        value = current.get(name) if name in names else None
        if _is_int(value) and value != sparse:
            values[name] = sparse
    for name in ("mlp_only_layers", "dense_layers"):
        if name in names and isinstance(current.get(name), list) and current.get(name):
            values[name] = []
    experts = next(
        (
            _size(values, current, name)
            for name in ("num_experts", "num_local_experts", "n_routed_experts")
            if _is_int(_size(values, current, name))
        ),
        None,
    )
    if experts is None:
        return
    for name in ("n_group", "topk_group", "num_expert_group", "topk_groups"):
        if name in names and _is_int(current.get(name)) and current[name] > 1:
            values[name] = 1
    per_token = _size(values, current, "num_experts_per_tok")
    if ("num_experts_per_tok" in names and per_token is None) or (_is_int(per_token) and per_token > experts):
        values["num_experts_per_tok"] = min(2, experts)  # None: the default routes nowhere


#: The most layer kinds a tiny model keeps one layer each of (more than the shrunk layer count).
_MOST_KINDS = 4


def _is_pattern(value: Any, count: int) -> bool:
    """Whether ``value`` is a per-layer pattern of layer kinds (names) for ``count`` layers."""
    return isinstance(value, list) and len(value) == count and all(isinstance(entry, str) for entry in value)


def _kinds(pattern: list[Any]) -> list[Any]:
    """The layer kinds a shrunk pattern keeps: every kind, except dense layers where there are sparse ones."""
    kinds = list(dict.fromkeys(map(_hashable, pattern)))
    return [kind for kind in kinds if kind not in ("dense", "mlp")] if "dense" in kinds else kinds


def _pattern(pattern: list[Any], count: int) -> list[Any]:
    """The first ``count`` entries of a per-layer pattern, with a layer of each kind kept where they fit,
    and MoE layers in place of dense ones (every layer sparse)."""
    kinds = list(dict.fromkeys(map(_hashable, pattern)))
    sparse = _kinds(pattern)
    if "dense" in kinds and sparse:
        pattern = [sparse[0] if _hashable(kind) == "dense" else kind for kind in pattern]
        kinds = sparse
    shrunk = list(pattern[:count])
    missing = [kind for kind in kinds if kind not in map(_hashable, shrunk)]
    if len(kinds) <= count:
        position = count - 1
        for kind in missing:
            # replace a kind that is there more than once, from the end
            while position >= 0 and list(map(_hashable, shrunk)).count(_hashable(shrunk[position])) < 2:
                position -= 1
            if position < 0:
                break
            shrunk[position] = next(entry for entry in pattern if _hashable(entry) == kind)
            position -= 1
    return shrunk


def _hashable(value: Any) -> Any:
    return repr(value) if isinstance(value, (list, dict)) else value


def _layers(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Per-layer patterns cut to the new layer count; layer index lists cut to it; periods within it."""
    counts = {
        current[name]: values[name]
        for name in _LAYER_COUNTS
        if name in values and _is_int(current.get(name)) and values[name] != current[name]
    }
    if not counts:
        return
    old, new = max(counts.items())
    # layer counts that add up to the whole (dory: input + recurrent + output layers): one layer each
    parts = [n for n in names if n.endswith("_layers") and n not in _LAYER_COUNTS and _is_int(current.get(n))]
    if len(parts) > 1 and sum(current[n] for n in parts) == old:
        for name in parts:
            values[name] = min(1, current[name])
        new = sum(values[name] for name in parts)
        counts = dict.fromkeys(counts, new)
        for name in _LAYER_COUNTS:
            if name in values and current.get(name) == old:
                values[name] = new
    # more kinds of layer than layers (nemotron_h: mamba, attention, moe): as many layers as kinds
    most = max((len(_kinds(current[n])) for n in names if _is_pattern(current.get(n), old)), default=0)
    if new < most <= _MOST_KINDS:
        new = most
        counts = dict.fromkeys(counts, new)
        for name in _LAYER_COUNTS:
            if name in values and current.get(name) == old:
                values[name] = new
    for name in names:
        value = current.get(name)
        if not isinstance(value, list) or not value:
            continue
        if name in values and (not isinstance(values[name], list) or len(values[name]) != len(value)):
            continue  # already set to fit (by a rule above)
        if len(value) in counts:
            values[name] = _pattern(value, counts[len(value)])
        elif (
            all(_is_int(entry) for entry in value)
            and max(value) < old
            and any(part in name for part in ("layer", "index", "indices", "indexes"))
        ):
            kept = [entry for entry in value if entry < new]
            values[name] = kept or [new - 1]
    kinds = {
        _hashable(kind)
        for name in names
        if name.endswith("_types") and isinstance(values.get(name), list)
        for kind in values[name]
    }
    for name in names:
        value = current.get(name)
        if isinstance(value, list) and value and name.endswith("_types") and new < len(value) < old:
            # a pattern that repeats over the layers (recurrent_gemma's block_types): its first
            # layers, with one of each kind
            values[name] = _pattern(value, new)
        elif value is None and "indices" in name and any(part in name for part in ("attn", "attention")):
            # no attention layer by default (bamba): the forward needs one for its mask
            values[name] = [new - 1]
        elif _is_int(value) and name.endswith("_layers") and name not in _LAYER_COUNTS:
            if _changed(values, current, name):
                continue
            if "shared" in name and 0 < value < old:
                # layers that reuse the key/values of an earlier layer of their kind (gemma3n): after
                # one layer of each kind, where the new count leaves room
                values[name] = max(0, new - len(kinds))
            elif value == old:
                values[name] = new  # every layer (gemma4 assistants share every layer's key/values)
    for name in names:
        sparse = any(part in name for part in ("expert", "moe", "sparse"))
        if name.endswith("_period") and _is_int(current.get(name)) and current[name] > (1 if sparse else new):
            offset = name.removesuffix("_period") + "_offset"
            values[name] = 1 if sparse else new
            if offset in names and _is_int(current.get(offset)):
                values[offset] = 0 if sparse else new - 1


def _tokens(values: dict[str, Any], current: Mapping[str, Any], names: set[str], config: Any) -> None:
    """Token ids inside the shrunk vocabulary: the special ones at its top, each its own."""
    vocab = _size(values, current, "vocab_size")
    if not _is_int(vocab):
        text = next((v for k, v in values.items() if k == "text_config" and hasattr(v, "vocab_size")), None)
        vocab = getattr(text, "vocab_size", None)
        if not _is_int(vocab):
            return
    taken: dict[int, int] = {}
    for name in sorted(names):
        if not name.endswith(("_token_id", "_token_index", "_token_ids")):
            continue
        value = current.get(name)
        if _is_int(value) and value >= vocab:
            values[name] = taken.setdefault(value, vocab - 1 - len(taken))
        elif isinstance(value, list) and value and all(_is_int(v) for v in value) and max(value) >= vocab:
            values[name] = [taken.setdefault(v, vocab - 1 - len(taken)) if v >= vocab else v for v in value]


def _causal_lm_class(config: Any) -> type[nn.Module]:
    from .._pipeline.model_types import model_class_for

    return model_class_for(config)


def _text_config(config: Any) -> Any:
    try:
        return config.get_text_config()
    except Exception:
        return None


def _config_for(model_class: Any, config: Any) -> Any:
    """The config ``model_class`` is built from: ``config``, or its text sub-config where the class
    takes that (emu3, llama4, qwen3_5: a text-only causal LM of a composite model type)."""
    wanted = getattr(model_class, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return config
    try:
        text = config.get_text_config()
    except Exception:  # several text configs (musicgen: text encoder and decoder): the one of the class
        text = None
    if isinstance(text, wanted):
        return text
    # not a text config a load reads out of the composite one: the checkpoint keeps the sub-config
    inner = [getattr(config, name, None) for name in getattr(type(config), "sub_configs", {})]
    return next((sub for sub in inner if isinstance(sub, wanted)), config)


def _built_from(config: Any) -> tuple[type[nn.Module], Any, bool]:
    """The class ``tiny_checkpoint`` builds for ``config``, the config it builds it from, and whether
    the checkpoint keeps the composite config (a text-only causal LM of a composite model type).

    A composite model whose full model needs a library that is not installed (gemma3n's vision
    tower needs timm and PIL) gives its text model's causal LM, saved with its text config alone:
    a checkpoint of the text model, which loads without the library."""
    from .._scope import vanilla

    model_class = _causal_lm_class(config)
    own = _config_for(model_class, config)
    text = _text_config(config)
    if own is config and text is not None and text is not config:
        try:
            with vanilla(), torch.device("meta"), meta_init_skipped():
                model_class(own)
        except ImportError:
            return _causal_lm_class(text), text, False
    return model_class, own, own is not config and text is own


#: The most parameters a tiny checkpoint of a model type has (what ``check_tiny_checkpoint`` holds it to).
TINY_PARAMETERS = 20_000_000

#: Above this, ``tiny_checkpoint`` refuses a model type's shrunk config before building anything.
_MOST_PARAMETERS = 100_000_000


def parameter_count(config: Any) -> int:
    """The parameters of the causal LM ``tiny_checkpoint`` builds from ``config``, counted on the meta device."""
    from .._scope import vanilla

    model_class, own, _ = _built_from(config)
    with vanilla(), torch.device("meta"), meta_init_skipped():
        model = model_class(own)
    return sum(parameter.numel() for parameter in model.parameters())


def check_tiny_checkpoint(model_type: str) -> str | None:
    """Why ``tiny_checkpoint(model_type)`` gives no working checkpoint, or ``None`` when it does.

    Working: the shrunk config builds a causal LM of at most ``TINY_PARAMETERS`` parameters,
    which saves, loads again with ``AutoModelForCausalLM`` (or the class the checkpoint names where
    that maps none: ``causal_lm_loader``; no weight missing, unexpected or mismatched) and gives
    finite logits for a left-padded batch of text tokens.

    Returns:
        ``None``, or ``"<stage>: <error>"`` with stage ``config``, ``size``, ``save``,
        ``load`` or ``forward``.
    """
    from .._scope import vanilla
    from .models import causal_lm_loader, text_token_ids

    stage = "config"
    try:
        config = tiny_config(model_type)
        stage = "size"
        count = parameter_count(config)
        if count > TINY_PARAMETERS:
            return f"size: {count:,} parameters (at most {TINY_PARAMETERS:,})"
        with tempfile.TemporaryDirectory(prefix="hfpatch-tiny-") as directory:
            stage = "save"
            path = tiny_checkpoint(config, Path(directory) / "checkpoint")
            stage = "load"
            with vanilla():
                loaded: Any = causal_lm_loader(path).from_pretrained(path, output_loading_info=True)
            model, info = loaded
            wrong = {kind: sorted(map(str, info.get(kind) or ())) for kind in ("missing_keys", "unexpected_keys")}
            wrong["mismatched_keys"] = sorted(str(entry[0]) for entry in info.get("mismatched_keys") or ())
            problems = [f"{kind.replace('_', ' ')} {', '.join(keys[:3])}" for kind, keys in wrong.items() if keys]
            if problems:
                return f"load: {'; '.join(problems)}"
            stage = "forward"
            tokens = text_token_ids(model.config)
            ids = tokens[torch.randint(0, len(tokens), (2, 10), generator=torch.Generator().manual_seed(0))]
            mask = torch.ones_like(ids)
            mask[1, :3] = 0
            with torch.no_grad():
                logits = model.eval()(input_ids=ids, attention_mask=mask).logits
            if not torch.isfinite(logits).all():
                return "forward: logits not finite"
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc, TinyCheckpointError) and exc.__cause__ is not None else exc
        message = " ".join(str(cause).split())
        return f"{stage}: {type(cause).__name__}: {message[:300]}"
    return None


def tiny_checkpoint(
    model_type_or_config: Any, directory: str | Path | None = None, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Save a small random checkpoint of a model type (or of an explicit config).

    Args:
        model_type_or_config: ``"llama"``, ``"qwen2_moe"``, ... or a config object.
        directory: where to save; the caller owns it.  Default: a new folder in a
            temporary directory that is removed, with everything in it, when this
            process exits (pass a directory to keep the checkpoint longer).
        seed: the random seed of the weights.
        config_overrides: config fields to set after shrinking.

    Raises:
        TinyCheckpointError: the shrunk default config does not build a model; pass a config.
    """
    if isinstance(model_type_or_config, str):
        config = tiny_config(model_type_or_config, **config_overrides)
        try:
            count = parameter_count(config)
        except Exception as exc:
            raise TinyCheckpointError(
                f"could not build a tiny {model_type_or_config!r} model from its shrunk default config "
                f"({type(exc).__name__}: {exc}); pass an explicit config: tiny_checkpoint(MyConfig(...))"
            ) from exc
        if count > _MOST_PARAMETERS:  # counted on the meta device: nothing that size is ever built
            raise TinyCheckpointError(
                f"the shrunk default {model_type_or_config!r} config still has {count:,} parameters (a tiny "
                f"checkpoint has at most {TINY_PARAMETERS:,}); pass an explicit config: tiny_checkpoint(MyConfig(...))"
            )
    else:
        config = model_type_or_config
        for name, value in config_overrides.items():
            setattr(config, name, value)
    target = Path(directory) if directory is not None else Path(tempfile.mkdtemp(dir=_scratch_directory()))
    from .._scope import vanilla

    try:
        with vanilla():
            torch.manual_seed(seed)
            model_class, own, composite = _built_from(config)
            model: Any = model_class(own)
            model.save_pretrained(target)
            if composite:
                # the checkpoint keeps the composite config, as a released one does: a load reads
                # the text config out of it
                config.save_pretrained(target)
    except Exception as exc:
        raise TinyCheckpointError(
            f"could not build a tiny {getattr(config, 'model_type', config)!r} checkpoint from its shrunk default "
            f"config ({type(exc).__name__}: {exc}); pass an explicit config: tiny_checkpoint(MyConfig(...))"
        ) from exc
    return target


@contextlib.contextmanager
def source_checkpoint(checkpoint_or_model_type: str | Path) -> Iterator[Path]:
    """The checkpoint directory given, or a tiny checkpoint of the model type given (removed
    afterwards): what the equivalence and training checks compare on."""
    source = Path(checkpoint_or_model_type)
    if source.is_dir():
        yield source
        return
    with tempfile.TemporaryDirectory(prefix="hfpatch-tiny-") as directory:
        yield tiny_checkpoint(str(checkpoint_or_model_type), Path(directory) / "checkpoint")
