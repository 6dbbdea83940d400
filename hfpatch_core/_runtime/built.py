"""What a load built, read back into its plan: replacements made by a load nested in it.

A plan says which classes it replaces by resolving its claims against the classes of the
load's own modeling module.  A claim registered by a composite model's load stays in
transformers' patch registry while the composite builds its sub-models in loads of their
own (``AutoModel.from_config(config.text_config)``), so a class of another modeling module,
claimed by the outer load, is replaced inside the nested load, where no plan resolved it.
The built model shows it; ``replaced_as_built`` writes it into the plan that registered it.
"""

from __future__ import annotations

import dataclasses
import re

import torch.nn as nn

from ..plan import Claim, Plan


def replaced_as_built(plan: Plan, model: nn.Module) -> Plan:
    """``plan`` (and its nested plans) with every replacement found in ``model`` that no plan of the
    load lists, listed by the plan whose winning claim registered it."""
    if not any(each.entries for each in plan.all_plans()):
        return plan
    listed = {claim.patch.replacement for each in plan.all_plans() for claim in each.replaced.values()}
    built = {type(module) for module in model.modules()} - listed
    if not built:
        return plan
    return _with(plan, built)


def _with(plan: Plan, built: set[type]) -> Plan:
    found: dict[str, Claim] = {}
    for claim in plan.entries:
        replacement = claim.patch.replacement
        if replacement in built:
            found.setdefault(_original_name(claim), claim)
    nested = tuple(_with(inner, built) for inner in plan.nested)
    if not found and nested == plan.nested:
        return plan
    return dataclasses.replace(plan, replaced={**plan.replaced, **found}, nested=nested)


def _original_name(claim: Claim) -> str:
    """The class name ``claim`` replaced: its target, or for a pattern target (the registry matches
    a key with ``re.search`` where no class has that exact name) the first base class it matches."""
    target = claim.target
    if target.isidentifier():
        return target
    for base in claim.patch.replacement.__mro__[1:]:
        if re.search(target, base.__name__):
            return base.__name__
    return target
