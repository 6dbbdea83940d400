"""The sizes of a tiny config: ``SHRINK``, the fields that follow the hidden size and the vocabulary,
token ids inside the shrunk vocabulary, and the readers of a config's fields every shrinking rule
(``attention_sizes``, ``layer_kinds``, ``configs``) asks with."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, TypeGuard

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
    # multi-head latent attention (deepseek_v2/v3 and their kin): kept consistent in
    # attention_sizes.latent_attention
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
}


def init_fields(cls: type) -> set[str]:
    """The names a config class takes at construction (its dataclass fields, or ``__init__``'s parameters)."""
    if dataclasses.is_dataclass(cls):
        return {field.name for field in dataclasses.fields(cls) if field.init}
    parameters = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}


def read_field(config: Any, name: str) -> Any:
    """A config's field ``name``, ``None`` where it has none."""
    # per-layer configs (gemma4, dots3_note) raise on a global read of a per-layer field: the global value
    # as stored, where there is one
    try:
        return getattr(config, name, None)
    except Exception:
        return vars(config).get(name)


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is a size (an ``int``, not a ``bool``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def derived_fields(cls: type) -> set[str]:
    """The fields of a config class whose default is ``None``: the config derives them from others."""
    if dataclasses.is_dataclass(cls):
        return {field.name for field in dataclasses.fields(cls) if field.init and field.default is None}
    parameters = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {p.name for p in parameters if p.default is None}


def changed(values: Mapping[str, Any], current: Mapping[str, Any], name: str) -> bool:
    """Whether a rule (or ``SHRINK``) already set ``name``."""
    return name in values and values[name] != current.get(name)


def size_of(values: Mapping[str, Any], current: Mapping[str, Any], name: str) -> Any:
    """``name`` as a rule (or ``SHRINK``) set it, else as the default config has it."""
    return values.get(name, current.get(name))


def text_config(config: Any) -> Any:
    """A config's text config (itself where it is one), ``None`` where it has no single one."""
    try:
        return config.get_text_config()
    except Exception:
        return None


def follow_hidden(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Fields that equal the hidden size by default (``embedding_dim``, ``attention_hidden_size``,
    ``adapter_input_size``, ...) shrink with it; a missing key/value head count means one per head."""
    old, new = current.get("hidden_size"), values.get("hidden_size")
    if is_int(old) and is_int(new) and old >= 256:
        for name in names:
            if name in SHRINK or name.endswith(("_token_id", "_token_index")):
                continue
            if is_int(current.get(name)) and current[name] == old and values.get(name, old) == old:
                values[name] = new
    if "num_key_value_heads" in names and current.get("num_key_value_heads") is None:
        heads = size_of(values, current, "num_attention_heads")
        if is_int(heads):
            values["num_key_value_heads"] = heads


def follow_vocabulary(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Other vocabulary sizes (``unpadded_vocab_size``, hashed byte-group vocabularies) at most the
    shrunk one: an unpadded vocabulary larger than the padded one gives a negative size."""
    old, new = current.get("vocab_size"), values.get("vocab_size")
    if not (is_int(old) and is_int(new)):
        return
    for name in names:
        if "vocab" in name and name not in SHRINK and is_int(current.get(name)) and current[name] > new:
            values[name] = new


def special_tokens(values: dict[str, Any], current: Mapping[str, Any], names: set[str], config: Any) -> None:
    """Token ids inside the shrunk vocabulary: the special ones at its top, each its own."""
    vocab = size_of(values, current, "vocab_size")
    if not is_int(vocab):
        text = next((v for k, v in values.items() if k == "text_config" and hasattr(v, "vocab_size")), None)
        vocab = getattr(text, "vocab_size", None)
        if not is_int(vocab):
            return
    taken: dict[int, int] = {}
    for name in sorted(names):
        if not name.endswith(("_token_id", "_token_index", "_token_ids")):
            continue
        value = current.get(name)
        if is_int(value) and value >= vocab:
            values[name] = taken.setdefault(value, vocab - 1 - len(taken))
        elif isinstance(value, list) and value and all(is_int(v) for v in value) and max(value) >= vocab:
            values[name] = [taken.setdefault(v, vocab - 1 - len(taken)) if v >= vocab else v for v in value]
