"""What ``hfpatch explain`` and ``hfpatch check`` compute, as plain data."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import transformers
from transformers import AutoConfig, monkey_patching
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from .context import LoadContext
from .conversion import describe_transform
from .errors import ConverterConflictError, HfPatchError, PatchConflictError
from .gathering import PackSet
from .plan import Claim, Plan
from .planning import default_class_names, modeling_module, module_classes, plan_load
from .resolution import find_replacement, matches
from .session import Session


class ModelNotFoundError(HfPatchError, ValueError):
    """``explain``/``check`` was given neither a checkpoint directory nor a known model type."""


def unknown_model_type(model_type: str) -> str | None:
    """Why ``model_type`` is not a model type of the installed transformers, with the closest
    names; ``None`` when it is one."""
    if model_type in CONFIG_MAPPING_NAMES:
        return None
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"{model_type!r} is not a model type of transformers {transformers.__version__}{hint}"


def load_config(model: str) -> Any:
    """The config of a local checkpoint directory, or the default config of a model type."""
    if os.path.isdir(model):
        return AutoConfig.from_pretrained(model)
    if model in CONFIG_MAPPING_NAMES:
        return AutoConfig.for_model(model)
    close = difflib.get_close_matches(model, list(CONFIG_MAPPING_NAMES), n=3)
    hint = f"; did you mean {', '.join(repr(name) for name in close)}?" if close else ""
    raise ModelNotFoundError(
        f"{model!r} is neither a checkpoint directory nor a model type known to transformers "
        f"{transformers.__version__}{hint}"
    )


def model_class_for(config: Any) -> type[nn.Module]:
    """The class a checkpoint of ``config`` loads as: its architecture, else a causal LM, else the base model."""
    model_type = getattr(config, "model_type", "")
    for name in default_class_names(config, model_type):
        model_class = getattr(transformers, name, None)
        if isinstance(model_class, type) and issubclass(model_class, nn.Module):
            return model_class
    raise ModelNotFoundError(f"transformers {transformers.__version__} has no model class for {model_type!r}")


def modeling_module_classes(model_type: str) -> dict[str, type]:
    """The ``nn.Module`` classes of ``transformers.models.<type>.modeling_<type>`` (empty if none)."""
    module = modeling_module(model_type)
    return module_classes(module) if module is not None else {}


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
            "warnings": list(self.warnings),
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


def _nesting_warnings(model: nn.Module, plan: Plan) -> list[str]:
    found: list[str] = []
    seen: set[tuple[str, str]] = set()
    for module in model.modules():
        outer = type(module).__name__
        claim = plan.replaced.get(outer)
        if claim is None or not claim.patch.is_pattern:
            continue
        for inner_module in module.modules():
            inner = type(inner_module).__name__
            if inner_module is module or inner not in plan.replaced or (outer, inner) in seen:
                continue
            seen.add((outer, inner))
            other = plan.replaced[inner]
            found.append(
                f"pattern {claim.target!r} of pack {claim.pack!r} replaces {outer}, which contains {inner}, "
                f"also replaced (by {other.pack!r}'s {other.patch.replacement.__qualname__}); the outer "
                f"replacement decides whether {inner} is built at all. Anchor the pattern (e.g. '^{inner}$') "
                "if it was meant for one class."
            )
    return found


def explain(model: str, session: Session, *, registered: Mapping[str, type] | None = None) -> Explanation:
    """Build ``model`` (a checkpoint directory or a model type) on the meta device and
    report, for every module class in it, what the session's packs would do."""

    config = load_config(model)
    model_class = model_class_for(config)
    with torch.device("meta"):
        instance = model_class(config)
    counts: dict[str, int] = {}
    for module in instance.modules():
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    context = LoadContext.for_model(model_class, config)
    session.report(session.selection.problems)
    plan = plan_load(
        context,
        session.packs,
        priority_offsets=session.selection.spec.priority_offsets,
        class_names=counts,
        registered=monkey_patching.get_patch_mapping() if registered is None else registered,
        report=session.report,
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
        warnings=tuple(_nesting_warnings(instance, plan)),
    )


def _matching(claim: Claim, names: Iterable[str]) -> list[str]:
    return [name for name in names if find_replacement(name, {claim.target: claim}) is claim]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What ``hfpatch check`` found for one pack."""

    pack: str
    version: str
    model_types: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def _default_class_name(model_type: str) -> str:
    return next(iter(default_class_names(None, model_type)), "PreTrainedModel")


def _default_config(model_type: str) -> Any:
    try:
        return AutoConfig.for_model(model_type)
    except Exception:  # some model types cannot build a default config
        return None


def check_pack(session: Session, name: str, model_types: Sequence[str] = ()) -> CheckResult:
    """Import pack ``name``, call its hooks for every model type, and check what they return.

    A model type is *targeted* when the pack returns patches or converters for it
    (asked with ``config=None``); for those, the hooks are called again with the
    default config, and every patch target must match a class of that model type's
    modeling module.  ``model_types``: check these instead of asking with
    ``config=None`` (for a pack that decides from the config, and returns nothing
    without one); each must be targeted.
    """
    info = session.selection.packs[name]
    packs = PackSet({name: info})
    problems: list[str] = []
    targeted: list[str] = []

    def note(message: str) -> None:
        if message not in problems:
            problems.append(message)

    for model_type in model_types:
        unknown = unknown_model_type(model_type)
        if unknown is None:
            targeted.append(model_type)
        else:
            note(unknown)

    for model_type in () if model_types else CONFIG_MAPPING_NAMES:
        context = LoadContext(model_type=model_type, model_class_name=_default_class_name(model_type))
        gathered = packs.gather(context)
        for failure in gathered.failures:
            note(str(failure))
        if any(failure.stage == "import" for failure in gathered.failures):
            break
        if gathered.claims or gathered.converters:
            targeted.append(model_type)

    for model_type in targeted:
        context = LoadContext(
            model_type=model_type,
            model_class_name=_default_class_name(model_type),
            config=_default_config(model_type),
        )
        gathered = packs.gather(context)
        for failure in gathered.failures:
            note(str(failure))
        if model_types and not (gathered.claims or gathered.converters or gathered.failures):
            note(f"pack {name!r} returns no patch and no converter for {model_type} (default config)")
        classes = modeling_module_classes(model_type)
        for converter in gathered.converters:
            key = converter.key
            known = key in CONFIG_MAPPING_NAMES or isinstance(getattr(transformers, key, None), type)
            if not known:
                note(
                    f"pack {name!r}: converter key {key!r} is neither a model type nor a model class of "
                    f"transformers {transformers.__version__}; no model would use it."
                )
            elif not gathered.claims:
                note(
                    f"pack {name!r}: converter for {key!r} but no patch of the pack is active for {model_type}; "
                    "the checkpoint would be converted for modules that were not replaced."
                )
        try:
            plan_load(context, packs, class_names=classes, registered={}, report=_ignore)
        except (PatchConflictError, ConverterConflictError) as exc:
            note(str(exc))
        for claim in gathered.claims:
            if not any(matches(claim.target, class_name) for class_name in classes):
                note(
                    f"pack {name!r}: patch target {claim.target!r} matches no module class of "
                    f"transformers.models.{model_type} in transformers {transformers.__version__}; "
                    "check the class name (it may have been renamed)."
                )
    return CheckResult(name, info.version, tuple(targeted), tuple(problems))


def _ignore(errors: Iterable[HfPatchError]) -> None:
    """check_pack notes failures from its own gathering; planning for a conflict need not report them."""
