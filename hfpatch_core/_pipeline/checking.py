"""Checking a pack before any load: its targets, its problems, and its drift since its record.

``check_pack`` asks a pack about every model type it targets (``probing``) as a load would
(``planning.plan_load``, on the meta device's terms: configs and class names, no weights) and
checks what it answers: patch targets that match no class, patterns that replace a model class
or a class that contains another replaced class, converters left out of the plan, and what
changed since the pack's drift record (``authoring.drift``).  ``check_combination`` does the
same for packs together.  ``hfpatch check`` shows the results; ``hfpatch verify`` verifies the
targets it finds.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from ..authoring.drift import Drift, DriftRecord, RecordError, Target, compare, read_record, record_path
from ..authoring.meta import meta_init_skipped
from ..context import LoadContext
from ..errors import ConverterConflictError, HfPatchError, PatchConflictError
from ..plan import Claim, Plan
from .discovery import PackInfo
from .gathering import Gathered, HookGuard, PackSet
from .model_types import default_config, load_classes, model_class_for, transformers_notices_off, unknown_model_type
from .planning import plan_load
from .probing import (
    AnswerCache,
    ConfigFor,
    ShowProgress,
    answer_of,
    asked_with_configs,
    configs_name,
    declared_model_types,
    keep,
    pack_identity,
    probe_context,
    progress_over,
    targets_of,
)
from .resolution import matches
from .selection import Selection


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


#: Why a pack was checked on no model type at all, and what to do.
NO_TARGETS = (
    "it returned no patch and no converter for any model type, asked with config=None and with a config "
    "of each model type, and declares none (provide_model_types); nothing was checked. Pass --model-type TYPE"
)


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
                f"{shown} of a {model_type} load's modeling modules: a load would replace the model itself with "
                f"{claim.patch.replacement_name}. Anchor the pattern to the module classes it is meant for "
                "(e.g. '^...MLP$'), or name them exactly."
            )
    if model is not None:
        problems.extend(nesting_warnings(model, plan))
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


class _Answers(PackSet):
    """A ``PackSet`` that calls the hooks once per load and config: ``check`` asks a model type to
    find its targets, again to check them and again to plan them, and a structural pack builds and
    probes the model each time.  A context without a config is asked every time (it is cheap)."""

    def __init__(self, packs: Mapping[str, PackInfo], *, guard: HookGuard) -> None:
        super().__init__(packs, guard=guard)
        self._answers: dict[tuple[Any, ...], tuple[Any, Gathered]] = {}

    def gather(self, context: LoadContext, priority_offsets: Mapping[str, int] | None = None) -> Gathered:
        if context.config is None:
            return super().gather(context, priority_offsets)
        offsets = tuple(sorted((priority_offsets or {}).items()))
        key = (context.model_type, context.model_class_name, id(context.config), offsets)
        found = self._answers.get(key)
        if found is None or found[0] is not context.config:  # (the config is held: its id stays its own)
            found = self._answers[key] = (context.config, super().gather(context, priority_offsets))
        return found[1]


#: What ``check_pack`` keeps in the cache of a pack's check: everything but the drift record,
#: which is read anew (``check --record`` rewrites it without changing what the hooks answer).
_CACHED_FIELDS = ("model_types", "problems", "targets", "refused")


def check_pack(
    selection: Selection,
    name: str,
    model_types: Sequence[str] = (),
    *,
    guard: HookGuard,
    config_for: ConfigFor | None = None,
    cache: AnswerCache | None = None,
    progress: ShowProgress | None = None,
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
        selection: the selection that holds the pack.
        name: the pack.
        model_types: check these instead of looking for targets (for a pack that
            decides from the config); each must be targeted.
        guard: what the pack's hooks are called under (``_runtime.snapshot.HOOK_GUARD``).
        config_for: the config to call the hooks with for a model type (default: its
            default config; ``hfpatch check`` passes a cached tiny config).
        cache: where to keep the result (all but the drift comparison), named by the pack's
            version and source hash, and to take it from when it is found (``hfpatch check``
            passes ``HF_PATCH_CACHE``'s, keyed by the installed transformers and hfpatch-core;
            ``--no-cache`` none).
        progress: shows a line while the pack is asked about many model types.
    """
    info = selection.packs[name]
    store = cache
    configs = config_for or default_config
    entry = json.dumps(["check", configs_name(configs), *pack_identity(info), sorted(model_types)])
    found = store.get(entry) if store is not None else None
    if isinstance(found, dict) and all(field in found for field in _CACHED_FIELDS):
        targeted = list(found["model_types"])
        problems = list(found["problems"])
        targets = {Target(*fields) for fields in found["targets"]}
        refusals = list(found["refused"])
        imported = True
    else:
        check = _PackCheck(name, _Answers({name: info}, guard=guard), configs, cache=store, progress=progress)
        with transformers_notices_off():
            targeted, declared = check.targets(info, model_types)
            line = progress_over(
                progress, f"checking pack {name!r} on the {len(targeted)} model types it targets", targeted
            )
            for model_type in targeted:
                if line is not None:
                    line.step(model_type)
                check.target(model_type, asked=bool(model_types) or model_type in declared)
            if line is not None:
                line.finish()
        if not targeted and not check.problems:
            check.note(f"pack {name!r} targets no model type: {NO_TARGETS}")
        problems, targets, refusals, imported = check.problems, check.found, check.refusals, check.imported
        if store is not None and imported:
            keep(
                store,
                entry,
                {
                    "model_types": targeted,
                    "problems": problems,
                    "targets": [dataclasses.astuple(target) for target in sorted(targets)],
                    "refused": refusals,
                },
            )
    path = _record_path(info) if imported else None
    record: DriftRecord | None = None
    problems = list(problems)
    try:
        record = read_record(path) if path is not None else None
    except RecordError as exc:
        problems.append(f"pack {name!r}: {exc}")
    drift = compare(record, targets, transformers.__version__) if record is not None and record.releases else ()
    return CheckResult(
        name,
        info.version,
        tuple(targeted),
        tuple(problems),
        targets=tuple(sorted(targets)),
        record=path,
        recorded=record is not None and bool(record.releases),
        drift=drift,
        refused=tuple(dict.fromkeys(refusals)),
    )


@dataclasses.dataclass
class _PackCheck:
    """One ``check_pack`` run as it goes: the problems found (in order, each once), whether the pack
    imported, the classes its patches replace and the refusals it gave."""

    name: str
    packs: PackSet
    configs: ConfigFor
    problems: list[str] = dataclasses.field(default_factory=list)
    imported: bool = True
    found: set[Target] = dataclasses.field(default_factory=set)
    refusals: list[str] = dataclasses.field(default_factory=list)
    #: where the model types found by asking with configs are kept (``None``: not kept)
    cache: AnswerCache | None = None
    #: shows a line while the pack is asked about every model type
    progress: ShowProgress | None = None

    def note(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def gather(self, context: LoadContext) -> Gathered:
        gathered = self.packs.gather(context)  # (an _Answers: asked once per config)
        for failure in gathered.failures:
            self.note(str(failure))
            self.imported = self.imported and failure.stage != "import"
        return gathered

    def offers(self, model_type: str, config: Any) -> bool:
        """Whether the pack answers ``model_type`` with anything: a patch, converter or model step,
        or a refusal (a model type where it only refuses is checked and shown too)."""
        return bool(answer_of(self.gather(probe_context(model_type, config))))

    def targets(self, info: PackInfo, model_types: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
        """The model types to check (those given, else those the pack targets) and those it declares."""
        if model_types:
            for model_type in model_types:
                unknown = unknown_model_type(model_type)
                if unknown is not None:
                    self.note(unknown)
            return [model_type for model_type in model_types if unknown_model_type(model_type) is None], ()
        targeted: list[str] = []
        for model_type in CONFIG_MAPPING_NAMES:
            if self.offers(model_type, None):
                targeted.append(model_type)
            if not self.imported:
                return targeted, ()
        declared, declaration_problems = declared_model_types(info)
        for problem in declaration_problems:
            self.note(problem)
        targeted.extend(model_type for model_type in declared if model_type not in targeted)
        if not targeted and not self.problems:
            # a pack that decides from the config alone offers nothing for config=None: every model
            # type is asked with a config (minutes for a pack that builds each model on meta)
            targeted.extend(self._asked_with_configs())
        return targeted, declared

    def _asked_with_configs(self) -> list[str]:
        return list(
            asked_with_configs(
                self.packs, self.name, self.configs, cache=self.cache, gather=self.gather, progress=self.progress
            )
        )

    def target(self, model_type: str, *, asked: bool) -> None:
        """Check what the pack offers for ``model_type`` (``asked``: it was named or declared, so it
        must offer something)."""
        config = self.configs(model_type)
        context = probe_context(model_type, config)
        gathered = self.gather(context)
        self.refusals.extend(f"{model_type}: {refused.target}: {refused.reason}" for refused in gathered.refused)
        if asked and not (
            gathered.claims or gathered.converters or gathered.steps or gathered.failures or gathered.refused
        ):
            self.note(
                f"pack {self.name!r} returns no patch and no converter for {model_type} (asked with a config of it)"
            )
        classes = load_classes(model_type, config)
        for converter in gathered.converters:
            self._converter_key(converter.key, model_type, bool(gathered.claims))
        try:
            plan = plan_load(context, self.packs, class_names=classes, registered={}, report=ignore)
        except (PatchConflictError, ConverterConflictError) as exc:
            self.note(str(exc))
        else:
            for problem in [
                *pattern_problems(plan, classes, _meta_model(plan, config), model_type),
                *converter_problems(plan),
            ]:
                self.note(problem)
        for claim in gathered.claims:
            hit = targets_of(model_type, [claim.target], classes)
            self.found.update(hit)
            if not hit:
                self.note(
                    f"pack {self.name!r}: patch target {claim.target!r} matches no module class a {model_type} "
                    f"load reads (transformers.models.{model_type} and the modules of the classes it builds) "
                    f"in transformers {transformers.__version__}; "
                    "check the class name (it may have been renamed)."
                )

    def _converter_key(self, key: str, model_type: str, patched: bool) -> None:
        known = key in CONFIG_MAPPING_NAMES or isinstance(getattr(transformers, key, None), type)
        if not known:
            self.note(
                f"pack {self.name!r}: converter key {key!r} is neither a model type nor a model class of "
                f"transformers {transformers.__version__}; no model would use it."
            )
        elif not patched:
            self.note(
                f"pack {self.name!r}: converter for {key!r} but no patch of the pack is active for {model_type}; "
                "the checkpoint would be converted for modules that were not replaced."
            )


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
        with torch.device("meta"), warnings.catch_warnings(), meta_init_skipped():
            warnings.simplefilter("ignore")  # what building on the meta device says is not the pack's problem
            return model_class_for(config)(config)
    except Exception:  # a model type whose default model cannot be built here: no nesting check
        return None


def check_combination(
    selection: Selection,
    results: Sequence[CheckResult],
    *,
    guard: HookGuard,
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
        packs = PackSet({name: selection.packs[name] for name in names}, guard=guard)
        config = configs(model_type)
        context = probe_context(model_type, config)
        classes = load_classes(model_type, config)
        together = " + ".join(sorted(names))
        try:
            plan = plan_load(
                context,
                packs,
                priority_offsets=selection.spec.priority_offsets,
                class_names=classes,
                registered={},
                report=ignore,
                selection=selection.spec,
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


def ignore(errors: Iterable[HfPatchError]) -> None:
    """check_pack notes failures from its own gathering; planning for a conflict need not report them."""


def nesting_warnings(model: nn.Module, plan: Plan) -> list[str]:
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
