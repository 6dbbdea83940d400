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

hfpatch's own styles (``distribution.HFPATCH_STYLES``) are applied here, never handed
to transformers: ``{"*": "local_experts"}`` (``keep_local_experts``) cuts a module list
of experts to this rank's experts under expert parallelism.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from .._pipeline.parallel import HFPATCH_STYLES, LOCAL_EXPERTS, declared_plan

#: The model attribute holding each parallelism's plan (transformers 5.3 to 5.25).
PLAN_OF_MODEL = {"tp": "_tp_plan", "ep": "_ep_plan", "fsdp": "_fsdp_plan"}

_LAYER_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _wildcard(path: str) -> str:
    """``model.layers.3.self_attn`` -> ``model.layers.*.self_attn``, as transformers' plans spell paths."""
    return _LAYER_NUMBER.sub("*", path)


def add_declared_plans(
    model: Any, modes: Iterable[str], *, expert_mesh: Callable[[], Any] | None = None
) -> dict[str, dict[str, str]]:
    """Add the plans that ``model``'s modules' classes declare to its plans for ``modes``.

    Called once the model is built, before transformers distributes it.  Under expert
    parallelism, also cuts the module lists of experts that declare ``local_experts``
    (``keep_local_experts``, with ``expert_mesh``).

    Returns:
        Per parallelism, the entries added (empty when no module declares one).

    Raises:
        ValueError: see ``keep_local_experts``.
    """
    modes = tuple(modes)
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
            entries.update({f"{path}.{key}": style for key, style in declared.items() if style not in HFPATCH_STYLES})
        if entries:
            # first: transformers 5.3 matches a weight against the plan's keys in order, and the
            # model's rule for the replaced module (``layers.*.mlp.experts``) would match first
            setattr(model, attribute, {**entries, **{key: current[key] for key in current if key not in entries}})
            added[mode] = entries
    if "ep" in modes:
        keep_local_experts(model, expert_mesh)
    return added


#: The transformers style that sends each token to the rank of its expert, with the expert's
#: local number: the only one a module list cut to this rank's experts can run under.
_DISPATCH = "ep_dispatch_experts"


def keep_local_experts(model: Any, expert_mesh: Callable[[], Any] | None) -> dict[str, tuple[int, ...]]:
    """Cut each module list of experts declaring ``{"*": "local_experts"}`` to this rank's experts.

    transformers' expert parallelism gives expert-parallel rank ``r`` of ``n`` the experts
    ``r * E / n`` to ``(r + 1) * E / n - 1`` (its ``grouped_gemm`` style shards the 3-D
    experts so), sets the module's ``num_experts`` to ``E / n`` and, by the module's
    ``ep_dispatch_experts`` rule, calls the module's forward with local expert numbers
    (``E / n`` marking a route to another rank's expert).  For a module list of experts
    (children named ``0`` to ``E - 1``, as the checkpoint's per-expert keys, beside any
    children not named by a number, such as an activation, which stay), the same is:
    keep the rank's children under their global names, so that their checkpoint keys load
    into them, drop the others before any weight is read (their keys are then ignored as
    unexpected on this rank), and set ``num_experts``; the module's forward must take its
    ``i``-th remaining child for local expert ``i``.  A module the model's expert plan does
    not mention is left whole, as the model leaves it.

    Args:
        model: the model just built, before transformers distributes it.
        expert_mesh: gives the expert-parallel mesh transformers builds for the load (its
            ``get_local_rank()`` and ``size()``); called only if a module is to be cut.

    Returns:
        Per module path, the global numbers of the experts kept.

    Raises:
        ValueError: the model's plan runs such a module with a style other than
            ``ep_dispatch_experts``, its children are not numbered ``0`` to ``E - 1``,
            ``E`` does not divide by the number of ranks, or the mesh cannot be found;
            raised alike on every rank (it depends on the model and the load's arguments).
    """
    cut = [
        (name, module)
        for name, module in model.named_modules()
        if name and (declared_plan(type(module), "ep") or {}).get("*") == LOCAL_EXPERTS
    ]
    plan = getattr(model, PLAN_OF_MODEL["ep"], None) or {}
    cut = [(name, module) for name, module in cut if _wildcard(name) in plan]
    if not cut:
        return {}
    mesh = expert_mesh() if expert_mesh is not None else None
    if mesh is None:
        raise ValueError(
            f"{type(model).__name__}: {type(cut[0][1]).__name__} declares 'local_experts' but transformers' "
            "expert-parallel mesh for this load was not found; load without expert parallelism."
        )
    rank, size = int(mesh.get_local_rank()), int(mesh.size())
    kept: dict[str, tuple[int, ...]] = {}
    ignored: set[str] = set()
    rules = dict(plan)
    for name, module in cut:
        path = _wildcard(name)
        where = f"{type(model).__name__}.{name} ({type(module).__name__}, 'local_experts')"
        if plan[path] != _DISPATCH:
            raise ValueError(f"{where}: the model's expert plan runs it as {plan[path]!r}, not {_DISPATCH!r}.")
        # the experts are the children named by number; others (an activation, a norm) stay on every rank
        names = [child for child, _ in module.named_children() if child.isdigit()]
        if not names or names != [str(number) for number in range(len(names))]:
            raise ValueError(f"{where}: its numbered children are not the experts 0 to {len(names) - 1}: {names[:8]}")
        if len(names) % size:
            raise ValueError(f"{where}: cannot evenly shard {len(names)} experts across {size} expert-parallel ranks.")
        share = len(names) // size
        local = tuple(range(rank * share, (rank + 1) * share))
        dropped = [child for child in names if int(child) not in local]
        for child in dropped:
            del module._modules[child]
        if hasattr(module, "num_experts"):
            module.num_experts = share
        module._is_expert_parallel = True  # as transformers marks the 3-D experts it shards
        kept[name] = local
        if dropped:
            where_keys = re.escape(path).replace(re.escape("*"), r"\d+")
            ignored.add(rf"(^|\.){where_keys}\.({'|'.join(dropped)})\.")
        # the model's rules for the parameters of the module replaced (3-D experts) name nothing here
        rules = {key: style for key, style in rules.items() if not _names_nothing(key, path, module)}
    setattr(model, PLAN_OF_MODEL["ep"], rules)
    model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | ignored
    return kept


def _names_nothing(key: str, path: str, module: Any) -> bool:
    """Whether plan rule ``key`` is under ``path`` and names no parameter or sub-module of ``module``."""
    if not key.startswith(f"{path}."):
        return False
    rest = key[len(path) + 1 :]
    names = {_wildcard(f"x.{name}")[2:] for name, _ in (*module.named_parameters(), *module.named_modules()) if name}
    return rest not in names
