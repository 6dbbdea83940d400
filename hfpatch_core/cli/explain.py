"""``hfpatch explain``: what the enabled packs would do to one model, computed on the meta device, then shown."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import monkey_patching

from .._pipeline.checking import nesting_warnings
from .._pipeline.model_types import (
    load_config,
    model_class_for,
)
from .._pipeline.planning import module_classes, plan_load
from .._pipeline.resolution import find_replacement, matches
from .._runtime import provenance
from .._session.session import Session
from ..authoring.meta import meta_init_skipped
from ..context import LoadContext
from ..conversion import describe_transform
from ..plan import Claim, Foreign, Plan, StepClaim
from .exit_codes import EXIT_OK
from .output import print_json, table


@dataclasses.dataclass(frozen=True)
class ClassReport:
    """One module class present in the model."""

    name: str
    count: int
    replaced_by: Claim | None
    lost: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What the enabled packs would do to one model."""

    model_class: str
    model_type: str | None
    plan: Plan
    classes: tuple[ClassReport, ...]
    unused: tuple[Claim, ...]
    warnings: tuple[str, ...]
    #: what a checkpoint saved from a patched model records (``provenance``), or ``None``
    provenance: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "model_class": self.model_class,
            "model_type": self.model_type,
            "fingerprint": self.plan.fingerprint,
            "packs": [{"name": name, "version": version} for name, version in self.plan.packs],
            "classes": [
                {
                    "class": report.name,
                    "count": report.count,
                    "replaced_by": _claim_json(report.replaced_by) if report.replaced_by else None,
                    "lost": list(report.lost),
                }
                for report in self.classes
            ],
            "unused": [_claim_json(claim) for claim in self.unused],
            "refused": [
                {"pack": refused.pack, "version": refused.version, "class": refused.target, "reason": refused.reason}
                for refused in self.plan.refused
            ],
            "foreign": [
                {
                    "class": found.name,
                    "replacement": found.replacement,
                    "source": found.source,
                    "module": found.module or None,
                    "overridden_by": found.overridden_by,
                    "displaced": found.displaced,
                }
                for found in self.plan.foreign
            ],
            "lost": [
                {"claim": _claim_json(lost.claim), "class": lost.class_name, "reason": lost.reason}
                for lost in self.plan.lost
            ],
            "conversions": {
                key: [{"transform": describe_transform(entry.transform), "from": entry.origin} for entry in entries]
                for key, entries in self.plan.conversions.lists.items()
            },
            "conversions_removed": [
                {"key": removal.key, "transform": describe_transform(removal.transform), "by": removal.pack}
                for removal in self.plan.conversions.removed
            ],
            "conversions_lost": [
                {
                    "pack": claim.pack,
                    "key": claim.key,
                    "transforms": [describe_transform(transform) for transform in claim.converter.transforms],
                    "reason": reason,
                }
                for claim, reason in self.plan.conversions.lost
            ],
            "steps": [_step_json(claim) for claim in self.plan.steps],
            "steps_lost": [{**_step_json(claim), "reason": reason} for claim, reason in self.plan.lost_steps],
            "warnings": list(self.warnings),
            "provenance": dict(self.provenance) if self.provenance is not None else None,
        }


def _step_json(claim: StepClaim) -> dict[str, Any]:
    return {
        "pack": claim.pack,
        "version": claim.version,
        "target": claim.target,
        "install": claim.step.install_name,
        "priority": claim.priority,
        "overwrite": claim.overwrite,
    }


def _claim_json(claim: Claim) -> dict[str, Any]:
    return {
        "pack": claim.pack,
        "version": claim.version,
        "target": claim.target,
        "replacement": claim.patch.replacement_name,
        "priority": claim.priority,
        "overwrite": claim.patch.overwrite,
    }


def explain(model: str, session: Session, *, registered: Mapping[str, type] | None = None) -> Explanation:
    """Build ``model`` (a checkpoint directory or a model type) on the meta device and
    report, for every module class in it, what the session's packs would do."""

    config = load_config(model)
    model_class = model_class_for(config)
    with torch.device("meta"), meta_init_skipped():
        instance = model_class(config)
    # a class is named as transformers' registry resolves it, by its modeling module's attribute:
    # one swapped in outside hfpatch (Liger-Kernel's way) counts under the name it replaced
    modeling = sys.modules.get(model_class.__module__)
    aliases = {id(cls): name for name, cls in module_classes(modeling).items()} if modeling is not None else {}
    counts: dict[str, int] = {}
    for module in instance.modules():
        name = aliases.get(id(type(module)), type(module).__name__)
        counts[name] = counts.get(name, 0) + 1
    context = LoadContext.for_model(model_class, config)
    session.report(session.selection.problems)
    plan = plan_load(
        context,
        session.packs,
        priority_offsets=session.selection.spec.priority_offsets,
        class_names=counts,
        registered=monkey_patching.get_patch_mapping() if registered is None else registered,
        report=session.report,
        selection=session.selection.spec,
    )
    lost_by_class: dict[str, list[str]] = {}
    for lost in plan.lost:
        for name in [lost.class_name] if lost.class_name else _matching(lost.claim, counts):
            lost_by_class.setdefault(name, []).append(f"{lost.claim.describe()}: {lost.reason}")
    classes = tuple(
        ClassReport(name, count, plan.replaced.get(name), tuple(lost_by_class.get(name, ())))
        for name, count in counts.items()
    )
    used = {id(claim) for claim in plan.replaced.values()}
    unused = tuple(claim for claim in plan.entries if id(claim) not in used)
    return Explanation(
        model_class=model_class.__name__,
        model_type=context.model_type,
        plan=plan,
        classes=classes,
        unused=unused,
        warnings=tuple(nesting_warnings(instance, plan)),
        provenance=provenance.read(model) if Path(model).is_dir() and _read_as_directory(model) else None,
    )


def _read_as_directory(model: str) -> bool:
    # load_config's rule: a model type's name is a directory only when written as a path
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from .inputs import given_as_path

    return given_as_path(model) or model not in CONFIG_MAPPING_NAMES


def _outside(plan: Plan, name: str) -> Foreign | None:
    """What replaces the class ``name`` outside hfpatch, if anything does."""
    for found in plan.foreign:
        if (found.source == "module" and found.name == name) or (
            found.source == "registry" and matches(found.name, name)
        ):
            return found
    return None


def _matching(claim: Claim, names: Iterable[str]) -> list[str]:
    return [name for name in names if find_replacement(name, {claim.target: claim}) is claim]


def cmd_explain(args: argparse.Namespace) -> int:
    from .._session.session import new_session
    from ..conversion import describe_transform

    explanation = explain(args.model, new_session())
    if args.json:
        print_json(explanation.to_json())
        return EXIT_OK
    plan = explanation.plan
    packs = ", ".join(f"{name} {version}" for name, version in plan.packs) or "none"
    print(f"{explanation.model_class} (model_type {explanation.model_type}); packs: {packs}; plan {plan.fingerprint}")
    rows = []
    for report in explanation.classes:
        claim, found = report.replaced_by, _outside(plan, report.name)
        if claim is not None:
            shown = f"{claim.patch.replacement.__qualname__} [{claim.pack} {claim.version}]"
        else:  # a class another library replaced: which one here, and why below
            shown = f"{found.replacement} [outside hfpatch]" if found is not None else "-"
        rows.append([report.name, str(report.count), shown])
    print(table(rows, ["class", "count", "replaced by"]))
    if explanation.provenance is not None:
        recorded = explanation.provenance
        made = ", ".join(f"{p.get('name')} {p.get('version')}" for p in recorded.get("packs", [])) or "no pack"
        print(f"\nSaved from a model patched by {made} (plan {recorded.get('fingerprint')}; {provenance.FILE_NAME})")
        for difference in provenance.differences(recorded, plan):
            print(f"  differs now: {difference}")
    lost = [(report.name, text) for report in explanation.classes for text in report.lost]
    if lost:
        print("\nClaims that lost or are shadowed:")
        for name, text in lost:
            print(f"  {name}: {text}")
    for lost_claim in plan.lost:
        if lost_claim.class_name is None and not any(lost_claim.claim.describe() in text for _, text in lost):
            print(f"  {lost_claim.claim.describe()}: {lost_claim.reason}")
    if plan.steps or plan.lost_steps:
        # explain builds no weights: a step may still refuse the loaded model (plan_of shows it then)
        print("\nModel steps, installed on the loaded model (which a step may still refuse):")
        for step in plan.steps:
            print(f"  {step.target}: {step.step.install_name} [{step.pack} {step.version}]")
        for step, reason in plan.lost_steps:
            print(f"  not installed: {step.describe()}: {reason}")
    if plan.refused:
        print("\nClasses a pack found and refused (left as they are):")
        for refused in plan.refused:
            print(f"  {refused.describe()}")
    if plan.foreign:
        print("\nClasses replaced outside hfpatch (another library's patches):")
        for found in plan.foreign:
            print(f"  {found.describe()}")
    if explanation.unused:
        print("\nClaims that match no class of this model:")
        for claim in explanation.unused:
            print(f"  {claim.describe()}")
    conversions = plan.conversions
    for key, entries in conversions.lists.items():
        print(f"\nConversions for {key!r} (first matching converter wins):")
        for entry in entries:
            print(f"  {entry.describe()}")
    for removal in conversions.removed:
        print(f"  removed by {removal.pack!r}: {describe_transform(removal.transform)} [transformers]")
    if conversions.lost and not conversions.lists:
        print("\nConverters not applied:")
    for converter, reason in conversions.lost:
        print(f"  not applied: {converter.describe()}: {reason}")
    for warning in explanation.warnings:
        print(f"\nwarning: {warning}")
    return EXIT_OK
