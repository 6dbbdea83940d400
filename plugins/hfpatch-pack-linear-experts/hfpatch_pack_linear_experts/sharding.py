"""How the per-expert linears shard under transformers' sharded loads, derived from the model's own plans.

transformers shards a model by the plans it copies onto the model when it builds it
(``_tp_plan``, ``_ep_plan``), which name the original experts' 3-D parameters
(``layers.*.mlp.experts.gate_up_proj``).  The per-expert linears are in no plan, so
hfpatch core refuses the replacement in a sharded load unless its class declares how
they shard (``hfpatch_tp_plan``, ``hfpatch_ep_plan``, ``hfpatch_fsdp_plan``).  Here the
declarations are derived, per discovered layout, from the rules the model's plans give
the 3-D experts at the experts' path (read on the meta model discovery builds anyway),
never from a table of families:

* tensor parallelism: where the plan shards the 3-D experts by their intermediate
  dimension (gate/up ``packed_colwise`` or ``colwise`` as the halves are stored, down
  ``rowwise``; transposed layouts name the same cut ``packed_rowwise`` / ``colwise``)
  and sums the ranks' partial outputs (``moe_tp_experts`` on the experts module), each
  expert's gate and up shard ``colwise`` and its down ``rowwise``, by weight (a rule on
  the weight adds no per-module all-reduce; ``moe_tp_experts`` sums once for the
  module).  Where the plan does not shard the experts, nothing is declared beyond
  ``{}``: they stay whole, as the model keeps its own.
* expert parallelism: where the plan dispatches tokens to the experts
  (``ep_dispatch_experts``, the 3-D experts ``grouped_gemm``), ``{"*": "local_experts"}``:
  hfpatch cuts the experts to the rank's share before any weight is read.
* FSDP2: ``{}``: each expert's linears shard with their layer, as the model's plan wraps it.

What cannot be reproduced exactly is declared as no plan, with the reason
(``hfpatch_unsharded_reasons``, which core's refusal quotes): a plan style the per-expert
linears have no equivalent for, biases under tensor parallelism (a row-wise down
projection's bias would be added once per rank before the ranks' outputs are summed),
and checkpoints storing the experts 3-D, whose split converter reads every 3-D tensor
whole on every rank and cannot be cut per rank before it is read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from .experts import Layout

__all__ = ["Plans", "model_plans", "plans_for"]

#: The model attribute holding each parallelism's plan, as transformers copies it onto the model.
_PLAN_OF_MODEL = {"tp": "_tp_plan", "ep": "_ep_plan"}

_LAYER_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclasses.dataclass(frozen=True)
class Plans:
    """What one experts class declares per parallelism: a plan, or (``None``) a refusal with its reason.

    Attributes:
        tp, ep, fsdp: the plan (``hfpatch_<mode>_plan``), or ``None`` where the class cannot shard.
        reasons: per parallelism without a plan, why.
    """

    tp: tuple[tuple[str, str], ...] | None = ()
    ep: tuple[tuple[str, str], ...] | None = ()
    fsdp: tuple[tuple[str, str], ...] | None = ()
    reasons: tuple[tuple[str, str], ...] = ()

    def attributes(self) -> dict[str, object]:
        """The class attributes these plans are declared as (core's ``hfpatch_*_plan``)."""
        return {
            "hfpatch_tp_plan": None if self.tp is None else dict(self.tp),
            "hfpatch_ep_plan": None if self.ep is None else dict(self.ep),
            "hfpatch_fsdp_plan": None if self.fsdp is None else dict(self.fsdp),
            "hfpatch_unsharded_reasons": dict(self.reasons),
        }


def model_plans(model: object) -> dict[str, dict[str, str]]:
    """The tensor- and expert-parallel plans of a built (meta) model, by parallelism."""
    plans = {}
    for mode, attribute in _PLAN_OF_MODEL.items():
        plan = getattr(model, attribute, None)
        plans[mode] = dict(plan) if isinstance(plan, Mapping) else {}
    return plans


def _wildcard(path: str) -> str:
    return _LAYER_NUMBER.sub("*", path)


def _rules(plan: Mapping[str, str], path: str) -> tuple[str | None, dict[str, str]]:
    """The plan's rule for the module at ``path`` and its rules under it (relative names)."""
    prefix = f"{path}."
    return plan.get(path), {key[len(prefix) :]: style for key, style in plan.items() if key.startswith(prefix)}


def _same_rules(plan: Mapping[str, str], paths: Iterable[str]) -> tuple[str | None, dict[str, str]] | str:
    """The rules shared by every path of the class, or why they differ."""
    found = {path: _rules(plan, path) for path in dict.fromkeys(_wildcard(p) for p in paths)}
    distinct = {repr(rules) for rules in found.values()}
    if len(distinct) > 1:
        return f"the model's plan shards its modules differently by place ({found})"
    return next(iter(found.values()))


def _tensor_parallel(
    layout: Layout, stored_3d: bool, module: str | None, rules: dict[str, str]
) -> dict[str, str] | str:
    if module is None and not rules:
        return {}  # the model keeps the 3-D experts whole on every rank: so are the per-expert linears
    described = f"the model's tensor-parallel plan ({module!r} on the experts, {rules} on their parameters)"
    if stored_3d:
        return (
            f"{described} shards the experts, whose checkpoint stores them 3-D: the pack's split converter would "
            "read each 3-D tensor whole on every rank, and transformers cuts the 3-D parameter, not the per-expert "
            "linears it is split into"
        )
    if layout.has_bias:
        return (
            f"{described} shards the experts, which have biases: a row-wise down projection's bias would be added "
            "on every rank before the ranks' partial outputs are summed"
        )
    first = layout.parameters[0]
    if layout.has_gate:
        packed = "packed_" if layout.is_concatenated else ""  # interleaved halves: a plain cut keeps the pairs
        first_style = f"{packed}rowwise" if layout.is_transposed else f"{packed}colwise"
    else:
        first_style = "rowwise" if layout.is_transposed else "colwise"
    down_style = "colwise" if layout.is_transposed else "rowwise"
    expected = {first: first_style, "down_proj": down_style}
    if module != "moe_tp_experts" or rules != expected:
        return (
            f"{described} is not the intermediate-dimension cut of these experts ('moe_tp_experts' with "
            f"{expected}), which is the only one per-expert linears reproduce"
        )
    gate, up, down = layout.names
    plan = {f"*.{up}.weight": "colwise", f"*.{down}.weight": "rowwise"}
    if gate is not None:
        plan[f"*.{gate}.weight"] = "colwise"
    return plan


def _expert_parallel(
    layout: Layout, stored_3d: bool, module: str | None, rules: dict[str, str]
) -> dict[str, str] | str:
    if module is None and not rules:
        return {}
    described = f"the model's expert-parallel plan ({module!r} on the experts, {rules} on their parameters)"
    if stored_3d:
        return (
            f"{described} gives each rank its experts, whose checkpoint stores them 3-D: the pack's split converter "
            "would read every expert's weights on every rank, and cannot be cut to the rank's experts before they "
            "are read"
        )
    expected = dict.fromkeys(layout.parameters, "grouped_gemm")
    if module != "ep_dispatch_experts" or rules != expected:
        return (
            f"{described} is not token dispatch to whole experts ('ep_dispatch_experts' with {expected}), the only "
            "expert parallelism per-expert linears reproduce"
        )
    return {"*": "local_experts"}


def plans_for(layout: Layout, stored_3d: bool, paths: Iterable[str], plans: Mapping[str, Mapping[str, str]]) -> Plans:
    """The plans of an experts class of ``layout`` at ``paths`` (full module paths) in a model with ``plans``.

    Args:
        layout: the class's layout.
        stored_3d: the checkpoint stores the experts 3-D (split at load).
        paths: the module paths of the class's instances (``model.layers.0.mlp.experts``).
        plans: the model's plans by parallelism (``model_plans``).
    """
    paths = tuple(paths)
    found: dict[str, tuple[tuple[str, str], ...] | None] = {}
    reasons: dict[str, str] = {}
    for mode, derive in (("tp", _tensor_parallel), ("ep", _expert_parallel)):
        rules = _same_rules(plans.get(mode, {}), paths)
        result = rules if isinstance(rules, str) else derive(layout, stored_3d, *rules)
        if isinstance(result, str):
            found[mode], reasons[mode] = None, result
        else:
            found[mode] = tuple(sorted(result.items()))
    fsdp: tuple[tuple[str, str], ...] | None = ()
    if stored_3d:
        fsdp = None
        reasons["fsdp"] = (
            "its checkpoint stores the experts 3-D: the pack's split converter would read each 3-D tensor whole on "
            "every rank to cut it per expert, where a rank needs only its shard of each expert"
        )
    return Plans(tp=found["tp"], ep=found["ep"], fsdp=fsdp, reasons=tuple(sorted(reasons.items())))
