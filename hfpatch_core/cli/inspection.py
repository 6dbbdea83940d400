"""What ``hfpatch explain`` and ``hfpatch check`` compute, as plain data."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pluggy
import torch
import torch.nn as nn
import transformers
from transformers import monkey_patching
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from .. import hookspecs
from .._pipeline.discovery import PackInfo
from .._pipeline.gathering import PackSet
from .._pipeline.model_types import (
    default_config,
    load_config,
    model_class_for,
    modeling_module_classes,
    unknown_model_type,
)
from .._pipeline.planning import decider, default_class_names, gather_for, plan_load
from .._pipeline.resolution import find_replacement, matches, patch_conflicts
from .._pipeline.selection import Selection
from .._pipeline.settling import Problem, selection_text, settle
from .._runtime.snapshot import HOOK_GUARD
from .._session.session import Session
from ..context import LoadContext
from ..conversion import describe_transform
from ..errors import ConverterConflictError, HfPatchError, PatchConflictError
from ..plan import Claim, Plan
from .drift import Drift, DriftRecord, RecordError, Target, compare, read_record, record_path


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
            "refused": [
                {"pack": refused.pack, "version": refused.version, "class": refused.target, "reason": refused.reason}
                for refused in self.plan.refused
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
    """One message per pattern claim of ``plan`` that replaces a class containing other replaced classes."""
    nested: dict[int, tuple[Claim, dict[str, list[str]]]] = {}
    for module in model.modules():
        outer = type(module).__name__
        claim = plan.replaced.get(outer)
        if claim is None or not claim.patch.is_pattern:
            continue
        inners = nested.setdefault(id(claim), (claim, {}))[1].setdefault(outer, [])
        for inner_module in module.modules():
            inner = type(inner_module).__name__
            if inner_module is not module and inner in plan.replaced and inner not in inners:
                inners.append(inner)
    found: list[str] = []
    for claim, containers in nested.values():
        containers = {outer: inners for outer, inners in containers.items() if inners}
        if not containers:
            continue
        inner_names = list(dict.fromkeys(inner for inners in containers.values() for inner in inners))
        replacers = dict.fromkeys(
            f"{plan.replaced[inner].pack!r}'s {plan.replaced[inner].patch.replacement.__qualname__}"
            for inner in inner_names
        )
        found.append(
            f"pattern {claim.target!r} of pack {claim.pack!r} replaces "
            + "; ".join(f"{outer}, which contains {', '.join(inners)}" for outer, inners in containers.items())
            + f", also replaced (by {', '.join(replacers)}); the outer replacement decides whether the classes "
            f"it contains are built at all. Anchor the pattern (e.g. '^{inner_names[0]}$') if it was meant for "
            "one class."
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
        warnings=tuple(_nesting_warnings(instance, plan)),
    )


def _matching(claim: Claim, names: Iterable[str]) -> list[str]:
    return [name for name in names if find_replacement(name, {claim.target: claim}) is claim]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """What ``hfpatch check`` found for one pack.

    Attributes:
        pack: the pack's name.
        version: its distribution's version.
        model_types: the model types it was checked on (its *targets*).
        problems: what is wrong, one message each; empty when the pack passes.
        targets: every class its patches replace on those model types, with the
            signatures read from the installed transformers (what a record holds).
        record: the pack's drift record file (``drift.record_path``), ``None`` when it
            cannot be located (the module has no file).
        recorded: whether that file exists and records a release.
        drift: what changed since the record (empty without a record).
        refused: the classes the pack found and refused on those model types
            (``model_type: Class: reason``); not problems, the pack says why it leaves them.
    """

    pack: str
    version: str
    model_types: tuple[str, ...]
    problems: tuple[str, ...]
    targets: tuple[Target, ...] = ()
    record: Path | None = None
    recorded: bool = False
    drift: tuple[Drift, ...] = ()
    refused: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No problem and no drift."""
        return not self.problems and not self.drift


#: The config ``check_pack`` calls a pack's hooks with for a model type (``None`` when none
#: can be built).
ConfigFor = Callable[[str], Any]

#: Why a pack was checked on no model type at all, and what to do.
NO_TARGETS = (
    "it returned no patch and no converter for any model type, asked with config=None and with a config "
    "of each model type, and declares none (provide_model_types); nothing was checked. Pass --model-type TYPE"
)


def _default_class_name(model_type: str) -> str:
    return next(iter(default_class_names(None, model_type)), "PreTrainedModel")


def declared_model_types(info: PackInfo) -> tuple[tuple[str, ...], list[str]]:
    """The model types pack ``info`` declares with ``provide_model_types``, and the problems found.

    The pack is imported (once per process, as for a load); a pack that fails to import
    declares nothing (the caller reports the import failure).
    """
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    try:
        manager.register(info.load(), name=info.name)
    except Exception:  # the import failure is reported by gathering
        return (), []
    declared: list[str] = []
    problems: list[str] = []
    try:
        results = manager.hook.provide_model_types()
    except Exception as exc:
        return (), [f"pack {info.name!r}: provide_model_types() raised {type(exc).__name__}: {exc}"]
    for result in results:
        items = list(result) if isinstance(result, Iterable) and not isinstance(result, str | bytes) else None
        if items is None or not all(isinstance(item, str) for item in items):
            problems.append(
                f"pack {info.name!r}: provide_model_types() returned {result!r:.80}; return a list of model "
                "type strings, e.g. ['llama']."
            )
            continue
        for model_type in items:
            unknown = unknown_model_type(model_type)
            if unknown is not None:
                problems.append(f"pack {info.name!r} declares model type {model_type!r}: {unknown}")
            elif model_type not in declared:
                declared.append(model_type)
    return tuple(declared), problems


def _model_classes(classes: Mapping[str, type]) -> set[str]:
    from transformers import PreTrainedModel

    return {name for name, cls in classes.items() if issubclass(cls, PreTrainedModel)}


def pattern_problems(plan: Plan, classes: Mapping[str, type], model: nn.Module | None, model_type: str) -> list[str]:
    """Patterns of ``plan`` that would replace a model class of ``classes``, or a class that contains
    another replaced class in ``model`` (built on the meta device; ``None`` to skip that check)."""
    problems = []
    model_classes = _model_classes(classes)
    for claim in plan.entries:
        if not claim.patch.is_pattern:
            continue
        hit = sorted(name for name in model_classes if matches(claim.target, name))
        if hit:
            shown = ", ".join(hit[:4]) + (f" and {len(hit) - 4} more" if len(hit) > 4 else "")
            problems.append(
                f"pack {claim.pack!r}: pattern {claim.target!r} matches the model class{'es' if len(hit) > 1 else ''} "
                f"{shown} of transformers.models.{model_type}: a load would replace the model itself with "
                f"{claim.patch.replacement_name}. Anchor the pattern to the module classes it is meant for "
                "(e.g. '^...MLP$'), or name them exactly."
            )
    if model is not None:
        problems.extend(_nesting_warnings(model, plan))
    return problems


def converter_problems(plan: Plan) -> list[str]:
    """Converters of ``plan`` left out although their pack's patch replaces a class of the model.

    Such a load builds the pack's modules but reads the checkpoint in the original layout
    (``WeightLayoutError``); a correct plan has none.
    """
    replaced = {(claim.pack, claim.target) for claim in plan.replaced.values()}
    replacing = {claim.pack for claim in plan.replaced.values()}
    problems = []
    for claim, reason in plan.conversions.lost:
        targets = claim.converter.patch_targets
        if any((claim.pack, target) in replaced for target in targets) or (not targets and claim.pack in replacing):
            problems.append(
                f"{claim.describe()} is not applied ({reason}) although its patch replaces a "
                "class of the model: a load would fail with WeightLayoutError."
            )
    return problems


def check_pack(
    session: Session, name: str, model_types: Sequence[str] = (), *, config_for: ConfigFor | None = None
) -> CheckResult:
    """Import pack ``name``, call its hooks for every model type, and check what they return.

    A model type is *targeted* when the pack returns patches or converters for it asked
    with ``config=None``, or declares it (``provide_model_types``).  A pack that targets
    nothing that way is asked again with ``config_for(model_type)`` for every model type.
    For each target, the hooks are called with ``config_for(model_type)``, and every
    patch target must match a class of that model type's modeling module; no pattern may
    match a model class or a class that contains another replaced class.  A pack with no
    target at all is a problem (nothing was checked).

    Args:
        session: the session whose selection holds the pack.
        name: the pack.
        model_types: check these instead of looking for targets (for a pack that
            decides from the config); each must be targeted.
        config_for: the config to call the hooks with for a model type (default: its
            default config; ``hfpatch check`` passes a cached tiny config).
    """
    configs = config_for or default_config
    info = session.selection.packs[name]
    packs = PackSet({name: info}, guard=HOOK_GUARD)
    problems: list[str] = []
    targeted: list[str] = []

    def note(message: str) -> None:
        if message not in problems:
            problems.append(message)

    imported = True

    def offered(model_type: str, config: Any) -> bool:
        nonlocal imported
        context = LoadContext(model_type=model_type, model_class_name=_default_class_name(model_type), config=config)
        gathered = packs.gather(context)
        for failure in gathered.failures:
            note(str(failure))
            imported = imported and failure.stage != "import"
        return bool(gathered.claims or gathered.converters)

    for model_type in model_types:
        unknown = unknown_model_type(model_type)
        if unknown is None:
            targeted.append(model_type)
        else:
            note(unknown)

    declared: tuple[str, ...] = ()
    if not model_types:
        for model_type in CONFIG_MAPPING_NAMES:
            if offered(model_type, None):
                targeted.append(model_type)
            if not imported:
                break
        if imported:
            declared, declaration_problems = declared_model_types(info)
            for problem in declaration_problems:
                note(problem)
            targeted.extend(model_type for model_type in declared if model_type not in targeted)
        if imported and not targeted and not problems:
            targeted.extend(
                model_type for model_type in CONFIG_MAPPING_NAMES if offered(model_type, configs(model_type))
            )

    found: set[Target] = set()
    refusals: list[str] = []
    for model_type in targeted:
        config = configs(model_type)
        context = LoadContext(model_type=model_type, model_class_name=_default_class_name(model_type), config=config)
        gathered = packs.gather(context)
        for failure in gathered.failures:
            note(str(failure))
        refusals.extend(f"{model_type}: {refused.target}: {refused.reason}" for refused in gathered.refused)
        asked = bool(model_types) or model_type in declared
        if asked and not (gathered.claims or gathered.converters or gathered.failures or gathered.refused):
            note(f"pack {name!r} returns no patch and no converter for {model_type} (asked with a config of it)")
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
            plan = plan_load(context, packs, class_names=classes, registered={}, report=_ignore)
        except (PatchConflictError, ConverterConflictError) as exc:
            note(str(exc))
        else:
            for problem in [
                *pattern_problems(plan, classes, _meta_model(plan, config), model_type),
                *converter_problems(plan),
            ]:
                note(problem)
        for claim in gathered.claims:
            hit = targets_of(model_type, [claim.target], classes)
            found.update(hit)
            if not hit:
                note(
                    f"pack {name!r}: patch target {claim.target!r} matches no module class of "
                    f"transformers.models.{model_type} in transformers {transformers.__version__}; "
                    "check the class name (it may have been renamed)."
                )
    if not targeted and not problems:
        note(f"pack {name!r} targets no model type: {NO_TARGETS}")
    path = _record_path(info) if imported else None
    record: DriftRecord | None = None
    try:
        record = read_record(path) if path is not None else None
    except RecordError as exc:
        note(f"pack {name!r}: {exc}")
    drift = compare(record, found, transformers.__version__) if record is not None and record.releases else ()
    return CheckResult(
        name,
        info.version,
        tuple(targeted),
        tuple(problems),
        targets=tuple(sorted(found)),
        record=path,
        recorded=record is not None and bool(record.releases),
        drift=drift,
        refused=tuple(dict.fromkeys(refusals)),
    )


def targets_of(model_type: str, patch_targets: Iterable[str], classes: Mapping[str, type] | None = None) -> set[Target]:
    """Every class of ``model_type``'s modeling module that one of ``patch_targets`` matches
    (transformers' rules, as a load applies them), with its signatures: what a drift record
    lists for patches with those targets.

    Args:
        model_type: the model type.
        patch_targets: ``Patch.target`` values (class names or patterns).
        classes: the modeling module's classes, when the caller has them already.
    """
    classes = modeling_module_classes(model_type) if classes is None else classes
    return {
        Target.of(model_type, module_class)
        for target in patch_targets
        for class_name, module_class in classes.items()
        if matches(target, class_name)
    }


def _record_path(info: PackInfo) -> Path | None:
    """The drift record of pack ``info``: beside the module its entry point names."""
    module = info.value.partition(":")[0].strip()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # the import failure is reported by gathering
        return None
    if spec is None or not spec.has_location or spec.origin is None:
        return None
    return record_path(spec.origin)


def write_record(result: CheckResult) -> Path:
    """Add the installed transformers release, with ``result.targets``, to the pack's record.

    The other releases of an existing record are kept; the same release is replaced for
    the model types checked (``result.model_types``) and kept for the others.
    The file is written with sorted keys and targets: recording twice on one release
    writes the same bytes.

    Args:
        result: a ``check_pack`` result without problems.

    Returns:
        The record file written.

    Raises:
        RecordError: the pack has problems, its module has no file to record beside,
            or its existing record is not a valid record.
    """
    if result.problems:
        raise RecordError(f"pack {result.pack!r} has problems; fix them before recording it")
    if result.record is None:
        raise RecordError(f"pack {result.pack!r}: its module has no file to write a record beside")
    record = read_record(result.record) or DriftRecord(result.pack, {})
    version = transformers.__version__
    # a check limited to some model types (--model-type) keeps the others of this release
    kept = [t for t in record.releases.get(version, ()) if t.model_type not in result.model_types]
    record = record.with_release(version, [*kept, *result.targets])
    result.record.write_text(record.dumps(), encoding="utf-8")
    return result.record


def _meta_model(plan: Plan, config: Any) -> nn.Module | None:
    """The model of ``config`` on the meta device, when a pattern of ``plan`` could contain a replaced class."""
    if config is None or not any(claim.patch.is_pattern for claim in plan.entries):
        return None
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what building on the meta device says is not the pack's problem
            return model_class_for(config)(config)
    except Exception:  # a model type whose default model cannot be built here: no nesting check
        return None


def check_combination(
    session: Session,
    results: Sequence[CheckResult],
    *,
    config_for: ConfigFor | None = None,
) -> list[str]:
    """Check the packs of ``results`` together, on every model type two or more of them target.

    Each such model type is planned with all of them (``plan_load``, with the selection's
    priority offsets) as a load would be: a conflict between packs, or a pattern of one
    pack that replaces a model class or contains a class another pack replaces, is a
    problem.  Returns the problems, one message each.
    """
    configs = config_for or default_config
    by_type: dict[str, list[str]] = {}
    for result in results:
        for model_type in result.model_types:
            by_type.setdefault(model_type, []).append(result.pack)
    problems: list[str] = []
    for model_type, names in by_type.items():
        if len(names) < 2:
            continue
        packs = PackSet({name: session.selection.packs[name] for name in names}, guard=HOOK_GUARD)
        config = configs(model_type)
        context = LoadContext(model_type=model_type, model_class_name=_default_class_name(model_type), config=config)
        classes = modeling_module_classes(model_type)
        together = " + ".join(sorted(names))
        try:
            plan = plan_load(
                context,
                packs,
                priority_offsets=session.selection.spec.priority_offsets,
                class_names=classes,
                registered={},
                report=_ignore,
                selection=session.selection.spec,
            )
        except (PatchConflictError, ConverterConflictError) as exc:
            problems.append(f"{together} on {model_type}: every load of a {model_type} model would raise: {exc}")
            continue
        # what a pack does alone, check_pack reported under the pack already
        alone = {problem for result in results if result.pack in names for problem in result.problems}
        found = [*pattern_problems(plan, classes, _meta_model(plan, config), model_type), *converter_problems(plan)]
        for problem in found:
            prefixed = f"{together} on {model_type}: {problem}"
            if problem not in alone and prefixed not in problems:
                problems.append(prefixed)
    return problems


def _ignore(errors: Iterable[HfPatchError]) -> None:
    """check_pack notes failures from its own gathering; planning for a conflict need not report them."""


@dataclasses.dataclass(frozen=True)
class PackConflict:
    """Two or more enabled packs tie on one target of one model type: every load of it raises.

    Attributes:
        model_type: the model type.
        target: the patch target (or converter key) they tie on.
        packs: the packs that tie, sorted.
        message: the conflict error's problem (it names every claimant of the target).
    """

    model_type: str
    target: str
    packs: tuple[str, ...]
    message: str


@dataclasses.dataclass(frozen=True)
class Conflicts:
    """The conflicts of a selection on every model type two or more of its packs target.

    Attributes:
        model_types: the model types planned (two or more enabled packs target each).
        conflicts: one per tied target.
        selection: an ``HF_PATCH_PACKS`` value under which every model type of
            ``model_types`` resolves (the resolver decided each with it); ``None`` when
            there is no conflict, or none was found.
        checked: how many candidate selections the resolver decided.
    """

    model_types: tuple[str, ...]
    conflicts: tuple[PackConflict, ...] = ()
    selection: str | None = None
    checked: int = 0

    def of(self, pack: str) -> list[PackConflict]:
        """The conflicts ``pack`` takes part in."""
        return [conflict for conflict in self.conflicts if pack in conflict.packs]


def targeted_model_types(packs: PackSet, priority_offsets: Mapping[str, int] | None = None) -> dict[str, set[str]]:
    """For each model type, the packs of ``packs`` that target it, as ``check_pack`` finds targets:
    a patch or converter asked with ``config=None``, or the model type declared (``provide_model_types``)."""
    targets: dict[str, set[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        context = LoadContext(model_type=model_type, model_class_name=_default_class_name(model_type), config=None)
        gathered = packs.gather(context, priority_offsets)
        for pack in [*(claim.pack for claim in gathered.claims), *(claim.pack for claim in gathered.converters)]:
            targets.setdefault(model_type, set()).add(pack)
    for name, info in packs.infos.items():
        for model_type in declared_model_types(info)[0]:
            targets.setdefault(model_type, set()).add(name)
    return targets


def find_conflicts(selection: Selection, *, config_for: ConfigFor | None = None) -> Conflicts:
    """Plan every model type two or more of ``selection``'s packs target, on the meta device's
    terms (configs and class names, no weights), as a load would: the ties, and one selection
    checked to settle all of them at once (``settling.settle`` over every such model type, so
    that settling one model type's conflicts makes none on another)."""
    configs = config_for or default_config
    offsets = selection.spec.priority_offsets
    packs = PackSet(selection.packs, guard=HOOK_GUARD)
    problems: list[Problem] = []
    conflicts: list[PackConflict] = []
    for model_type, names in sorted(targeted_model_types(packs, offsets).items()):
        if len(names) < 2:
            continue
        context = LoadContext(
            model_type=model_type, model_class_name=_default_class_name(model_type), config=configs(model_type)
        )
        classes = tuple(modeling_module_classes(model_type))
        gathered = gather_for(context, packs, priority_offsets=offsets, class_names=classes)
        decide = decider(context, classes, registered={})
        problems.append(Problem(model_type, gathered, decide))
        found: list[PatchConflictError | ConverterConflictError] = list(patch_conflicts(gathered.claims))
        if not found:
            try:
                decide(gathered)
            except ConverterConflictError as exc:
                found.append(exc)
        conflicts.extend(PackConflict(model_type, exc.target, exc.packs, exc.problem) for exc in found)
    if not conflicts:
        return Conflicts(tuple(problem.model_type or "" for problem in problems))
    change, checked = settle(problems)
    text = None if change is None else selection_text(change, spec=selection.spec, enabled=selection.packs)
    return Conflicts(tuple(problem.model_type or "" for problem in problems), tuple(conflicts), text, checked)
