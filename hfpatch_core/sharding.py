"""The plans replacement classes declare, added to a model's parallel plans for its own load.

transformers shards a model by the plans it copies onto the model instance when the
model is built (``_tp_plan``, ``_ep_plan``, ``_fsdp_plan``: the config's
``base_model_*_plan`` and the classes' own, by module path).  A replacement's
parameters are not in them; the replacement declares them instead, relative to itself
(``hfpatch_tp_plan = {"qkv_proj": "colwise"}``, see ``distribution``).  Right after
the model is built and before transformers distributes it, each declared entry is added
under the path of every module of that class, where the model's plan shards that module
at all (a fused MLP the plan leaves whole, such as a MoE's shared expert, stays whole).

Only the new model instance's plan dictionaries change (replaced, never edited in
place): the classes' plans and the config are left as they are, so nothing outlives the
load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .distribution import declared_plan

#: The model attribute holding each parallelism's plan (transformers 5.3 to 5.25).
PLAN_OF_MODEL = {"tp": "_tp_plan", "ep": "_ep_plan", "fsdp": "_fsdp_plan"}

_LAYER_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _wildcard(path: str) -> str:
    """``model.layers.3.self_attn`` -> ``model.layers.*.self_attn``, as transformers' plans spell paths."""
    return _LAYER_NUMBER.sub("*", path)


def add_declared_plans(model: Any, modes: Iterable[str]) -> dict[str, dict[str, str]]:
    """Add the plans that ``model``'s modules' classes declare to its plans for ``modes``.

    Called once the model is built, before transformers distributes it.

    Returns:
        Per parallelism, the entries added (empty when no module declares one).
    """
    modules = [(_wildcard(name), type(module)) for name, module in model.named_modules() if name]
    added: dict[str, dict[str, str]] = {}
    for mode in modes:
        attribute = PLAN_OF_MODEL.get(mode)
        current = getattr(model, attribute, None) if attribute else None
        if attribute is None or not isinstance(current, dict):
            continue
        entries: dict[str, str] = {}
        for path, cls in modules:
            declared = declared_plan(cls, mode)
            if not declared or not any(key.startswith(f"{path}.") for key in current):
                continue
            entries.update({f"{path}.{key}": style for key, style in declared.items()})
        if entries:
            setattr(model, attribute, {**current, **entries})
            added[mode] = entries
    return added
