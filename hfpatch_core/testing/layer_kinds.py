"""The layers a tiny config builds: how many, of which kind (per-layer patterns of hybrid models, every
layer of a MoE model sparse, the routing of fewer experts) and a Mamba layer's state-space sizes (rules
of ``configs.shrunk``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .sizes import changed, is_int, size_of

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


def state_space(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Mamba layers: heads x head dim = expand x hidden, with a small state."""
    hidden = size_of(values, current, "hidden_size")
    for heads, head_dim, expand, state in (
        ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_state"),
        ("num_heads", "head_dim", "expand", "state_size"),
    ):
        if not all(name in names for name in (heads, head_dim, expand)) or not is_int(hidden):
            continue
        factor = current.get(expand)
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not is_int(current.get(heads)):
            continue
        values[head_dim] = 16
        values[heads] = max(1, int(factor * hidden) // 16)
        if "mamba_d_ssm" in names and is_int(current.get("mamba_d_ssm")):
            values["mamba_d_ssm"] = values[heads] * 16  # the state-space width, set apart (falcon_h1)
        if state in names and is_int(current.get(state)) and current[state] > 16:
            values[state] = 16
        groups = next((g for g in ("mamba_n_groups", "n_groups") if g in names), None)
        if groups is not None and is_int(current.get(groups)) and values[heads] % current[groups]:
            values[groups] = 1


def sparse_experts(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Every layer sparse where the config allows, and routing settings that fit the fewer experts."""
    for name, sparse in _ALL_SPARSE.items():
        value = current.get(name) if name in names else None
        if is_int(value) and value != sparse:
            values[name] = sparse
    for name in ("mlp_only_layers", "dense_layers"):
        if name in names and isinstance(current.get(name), list) and current.get(name):
            values[name] = []
    experts = next(
        (
            size_of(values, current, name)
            for name in ("num_experts", "num_local_experts", "n_routed_experts")
            if is_int(size_of(values, current, name))
        ),
        None,
    )
    if experts is None:
        return
    for name in ("n_group", "topk_group", "num_expert_group", "topk_groups"):
        if name in names and is_int(current.get(name)) and current[name] > 1:
            values[name] = 1
    per_token = size_of(values, current, "num_experts_per_tok")
    if ("num_experts_per_tok" in names and per_token is None) or (is_int(per_token) and per_token > experts):
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


def shrink_layers(values: dict[str, Any], current: Mapping[str, Any], names: set[str]) -> None:
    """Per-layer patterns cut to the new layer count; layer index lists cut to it; periods within it."""
    counts = {
        current[name]: values[name]
        for name in _LAYER_COUNTS
        if name in values and is_int(current.get(name)) and values[name] != current[name]
    }
    if not counts:
        return
    old, new = max(counts.items())
    # layer counts that add up to the whole (dory: input + recurrent + output layers): one layer each
    parts = [n for n in names if n.endswith("_layers") and n not in _LAYER_COUNTS and is_int(current.get(n))]
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
            all(is_int(entry) for entry in value)
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
        elif is_int(value) and name.endswith("_layers") and name not in _LAYER_COUNTS:
            if changed(values, current, name):
                continue
            if "shared" in name and 0 < value < old:
                # layers that reuse the key/values of an earlier layer of their kind (gemma3n): after
                # one layer of each kind, where the new count leaves room
                values[name] = max(0, new - len(kinds))
            elif value == old:
                values[name] = new  # every layer (gemma4 assistants share every layer's key/values)
    for name in names:
        sparse = any(part in name for part in ("expert", "moe", "sparse"))
        if name.endswith("_period") and is_int(current.get(name)) and current[name] > (1 if sparse else new):
            offset = name.removesuffix("_period") + "_offset"
            values[name] = 1 if sparse else new
            if offset in names and is_int(current.get(offset)):
                values[offset] = 0 if sparse else new - 1
