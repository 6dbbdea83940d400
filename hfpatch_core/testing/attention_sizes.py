"""The attention a tiny config builds: head counts, head dims, the latent dims of MLA models and
multimodal rope sections, consistent with the shrunk hidden size (rules of ``configs.shrunk``)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from .sizes import SHRINK, changed, is_int, size_of


def follow_heads(values: dict[str, Any], current: Mapping[str, Any], names: set[str], derived: set[str]) -> None:
    """Other attention head counts and head dims follow the attention's: equal to the old head count (or
    key/value head count, or head dim) they take the new one; an indexer's heads, larger than the new
    head count, the query heads of one key/value head (it scores with at most those); hidden sizes of
    other parts shrink.
    A field the config derives (``derived``: default ``None``) is left for it to derive."""
    heads, kv = size_of(values, current, "num_attention_heads"), size_of(values, current, "num_key_value_heads")
    old_heads, old_kv = current.get("num_attention_heads"), current.get("num_key_value_heads")
    head_dim, old_head_dim = values.get("head_dim"), current.get("head_dim")
    for name in names:
        value = current.get(name)
        if name in SHRINK or name in derived or not is_int(value) or changed(values, current, name):
            continue
        if name.endswith("heads") and is_int(heads) and is_int(old_heads) and old_heads != heads:
            # (other heads, linear attention's or Mamba's, keep their own counts)
            if name.endswith("attention_heads") and value == old_heads:
                values[name] = heads
            elif name.endswith("key_value_heads") and is_int(kv) and value >= min(kv, old_kv or kv):
                values[name] = kv  # (at most as many as the query heads it serves)
            elif "index" in name and value > heads:
                values[name] = max(1, heads // kv) if is_int(kv) and kv else 1
        elif name.endswith("head_dim") and is_int(head_dim) and value == old_head_dim != head_dim:
            values[name] = head_dim
        elif "hidden_size" in name and value >= 256:
            values[name] = SHRINK["hidden_size"]


def latent_attention(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """MLA (``kv_lora_rank``): the query/key head is the no-position part plus the rotary part,
    and ``head_dim`` (where the config has one) is the rotary part's size, as in deepseek_v3."""
    if not is_int(current.get("kv_lora_rank")):
        return
    if "q_lora_rank" in names and current.get("q_lora_rank") is None:
        values.pop("q_lora_rank", None)  # no query compression in this model: stays so
    rope, nope = size_of(values, current, "qk_rope_head_dim"), size_of(values, current, "qk_nope_head_dim")
    if "qk_head_dim" in names and is_int(rope) and is_int(nope):
        values["qk_head_dim"] = rope + nope
    old_head, old_rope = current.get("head_dim"), current.get("qk_rope_head_dim")
    if "head_dim" in names and is_int(old_head) and is_int(rope):
        if old_head == old_rope:
            values["head_dim"] = rope
        elif is_int(nope) and is_int(old_rope) and old_head == old_rope + (current.get("qk_nope_head_dim") or 0):
            values["head_dim"] = rope + nope
    values["_mla"] = True


def head_dims(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """``head_dim`` = hidden / heads (unless MLA set it); a partial rotary dim keeps its fraction."""
    mla = values.pop("_mla", False)
    hidden = next((size_of(values, current, n) for n in ("hidden_size", "n_embd", "d_model") if current.get(n)), None)
    heads = size_of(values, current, "num_attention_heads") or size_of(values, current, "n_head")
    if not (is_int(hidden) and is_int(heads) and heads):
        return
    old_hidden = current.get("hidden_size") or current.get("n_embd") or current.get("d_model")
    old_heads = current.get("num_attention_heads") or current.get("n_head")
    new_head = hidden // heads
    # a Mamba2 head_dim is the state-space head's (state_space)
    state_space = "expand" in names
    unset = current.get("head_dim") is None  # hunyuan, ministral: the model reads it unset
    if "head_dim" in names and not mla and not state_space and (is_int(current.get("head_dim")) or unset):
        values["head_dim"] = new_head
    for name in ("d_head", "d_kv", "attention_head_size"):
        if name in names and is_int(current.get(name)):
            values[name] = new_head
    old_head = current.get("head_dim") if is_int(current.get("head_dim")) else None
    if old_head is None and is_int(old_hidden) and is_int(old_heads) and old_heads:
        old_head = old_hidden // old_heads
    rotary = current.get("rotary_dim")
    if "rotary_dim" in names and is_int(rotary) and old_head:
        head = values.get("head_dim", new_head)
        values["rotary_dim"] = max(2, (rotary * head // old_head) // 2 * 2)
    if old_head:
        values["_head"] = values.get("head_dim", new_head)


def rope_sections(values: dict[str, Any], current: Mapping[str, Any], cls: type) -> None:
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
    if not isinstance(sections, list) or not sections or not all(map(is_int, sections)):
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
