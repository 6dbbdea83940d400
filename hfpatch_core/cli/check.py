"""``hfpatch check``: each pack's targets, problems and drift, alone and together, computed then shown."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pluggy
import torch
import torch.nn as nn
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from .. import hookspecs
from .._pipeline.discovery import PackInfo
from .._pipeline.gathering import Gathered, PackSet
from .._pipeline.model_types import (
    default_config,
    load_classes,
    model_class_for,
    unknown_model_type,
)
from .._pipeline.planning import decider, default_class_names, gather_for, plan_load
from .._pipeline.resolution import matches, patch_conflicts
from .._pipeline.selection import Selection
from .._pipeline.settling import Problem, selection_text, settle
from .._runtime.snapshot import HOOK_GUARD
from .._session.session import Session
from ..authoring.randomness import isolated_rng
from ..context import LoadContext
from ..errors import ConverterConflictError, HfPatchError, PatchConflictError
from ..plan import Plan
from .drift import Drift, DriftRecord, RecordError, Target, compare, read_record, record_path
from .exit_codes import EXIT_OK, EXIT_PROBLEMS
from .explain import nesting_warnings
from .output import UsageError, transformers_notices_off, transformers_version


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


def _context(model_type: str, config: Any) -> LoadContext:
    """The context ``check`` asks a pack's hooks with: a load of ``model_type``'s default model class."""
    return LoadContext(model_type=model_type, model_class_name=_default_class_name(model_type), config=config)


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
        with isolated_rng():  # a pack may probe each model type to answer (moe-replay does)
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

    def __init__(self, packs: Mapping[str, PackInfo]) -> None:
        super().__init__(packs, guard=HOOK_GUARD)
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


def _pack_identity(info: PackInfo) -> list[str]:
    """What names a pack's answers in the cache: its name, distribution, version, entry point and
    a hash of its source (``cache.pack_source_digest``: an editable install's edits count)."""
    from .cache import pack_source_digest

    module = info.value.partition(":")[0].strip()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None and spec.has_location else None
    return [info.name, info.distribution, info.version, info.value, pack_source_digest(origin)]


def _configs_name(configs: ConfigFor) -> str:
    """Which configs a pack was asked with, in a cache entry's name: answers to tiny configs are not
    answers to default ones."""
    return f"{getattr(configs, '__module__', '')}.{getattr(configs, '__qualname__', repr(configs))}"


def _keep(cache: Any, entry: str, value: Any) -> None:
    """Put ``value`` as ``entry`` in ``cache``, forgetting the entries of the same kind for the same pack
    under another identity (an earlier version or source of it): the file holds each pack's latest."""
    kind, configs, pack, *identity = json.loads(entry)

    def stale(other: str) -> bool:
        try:
            found = json.loads(other)
        except ValueError:
            return False
        return isinstance(found, list) and found[:3] == [kind, configs, pack] and found[3:7] != identity[:4]

    cache.discard(stale)
    cache.put(entry, value)


def _answers_cache() -> Any:
    from .cache import Cache, core_key

    return Cache("pack-answers", core_key())


#: What ``check_pack`` keeps in the cache of a pack's check: everything but the drift record,
#: which is read anew (``check --record`` rewrites it without changing what the hooks answer).
_CACHED_FIELDS = ("model_types", "problems", "targets", "refused")


def check_pack(
    session: Session,
    name: str,
    model_types: Sequence[str] = (),
    *,
    config_for: ConfigFor | None = None,
    cache: bool = False,
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
        cache: keep the result (all but the drift comparison) in ``HF_PATCH_CACHE``, named by
            the installed transformers and hfpatch-core and the pack's version and source hash,
            and take it from there when it is found (``hfpatch check`` does; ``--no-cache`` not).
    """
    info = session.selection.packs[name]
    store = _answers_cache() if cache else None
    configs = config_for or default_config
    entry = json.dumps(["check", _configs_name(configs), *_pack_identity(info), sorted(model_types)])
    found = store.get(entry) if store is not None else None
    if isinstance(found, dict) and all(field in found for field in _CACHED_FIELDS):
        targeted = list(found["model_types"])
        problems = list(found["problems"])
        targets = {Target(*fields) for fields in found["targets"]}
        refusals = list(found["refused"])
        imported = True
    else:
        check = _PackCheck(name, _Answers({name: info}), configs, cache=store)
        with transformers_notices_off():
            targeted, declared = check.targets(info, model_types)
            progress = _progress(f"checking pack {name!r} on the {len(targeted)} model types it targets", targeted)
            for model_type in targeted:
                if progress is not None:
                    progress.step(model_type)
                check.target(model_type, asked=bool(model_types) or model_type in declared)
            if progress is not None:
                progress.finish()
        if not targeted and not check.problems:
            check.note(f"pack {name!r} targets no model type: {NO_TARGETS}")
        problems, targets, refusals, imported = check.problems, check.found, check.refusals, check.imported
        if store is not None and imported:
            _keep(
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


def _progress(what: str, items: Sequence[str]) -> Any:
    """A progress line for a step over many model types (``None`` for a few: nothing to wait for)."""
    from .output import Progress

    return Progress(what, len(items), cached=True) if len(items) > 20 else None


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
    cache: Any = None

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
        return bool(_answer(self.gather(_context(model_type, config))))

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
        return list(asked_with_configs(self.packs, self.name, self.configs, cache=self.cache, gather=self.gather))

    def target(self, model_type: str, *, asked: bool) -> None:
        """Check what the pack offers for ``model_type`` (``asked``: it was named or declared, so it
        must offer something)."""
        config = self.configs(model_type)
        context = _context(model_type, config)
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


def _answer(gathered: Gathered) -> str:
    """``"offers"`` (a patch, converter or model step), ``"refuses"`` (refusals only) or ``""``."""
    if gathered.claims or gathered.converters or gathered.steps:
        return "offers"
    return "refuses" if gathered.refused else ""


def asked_with_configs(
    packs: PackSet,
    name: str,
    configs: ConfigFor,
    *,
    cache: Any = None,
    gather: Callable[[LoadContext], Gathered] | None = None,
    model_types: Iterable[str] | None = None,
) -> dict[str, str]:
    """The model types pack ``name`` answers when asked with ``configs(model_type)`` for every model
    type of the installed transformers (or of ``model_types``): model type -> ``"offers"`` or ``"refuses"``.

    What a pack that decides from the config alone (a structural pack: nothing for ``config=None``,
    no ``provide_model_types``) applies to; ``check`` checks these and ``list`` plans them for
    conflicts.  Asking builds each model type's config, and the pack builds and probes each model:
    the answer is kept in ``cache`` (a ``cache.Cache``), named by the pack's version and source
    hash, unless the pack failed (it is asked again); the answers for some ``model_types`` are
    read from it, not kept.  A progress line on stderr while it asks every model type.
    """
    from .output import Progress

    info = packs.infos[name]
    entry = json.dumps(["asked", _configs_name(configs), *_pack_identity(info)])
    found = cache.get(entry) if cache is not None else None
    some = None if model_types is None else [t for t in dict.fromkeys(model_types) if t in CONFIG_MAPPING_NAMES]
    if isinstance(found, dict):
        return {str(t): str(answer) for t, answer in found.items() if some is None or t in some}
    ask = gather or (lambda context: packs.gather(context))
    asked = list(CONFIG_MAPPING_NAMES) if some is None else some
    progress = (
        Progress(
            f"asking pack {name!r} with a tiny config of every model type (declare provide_model_types, "
            "or pass --model-type, to ask only those)",
            len(asked),
            cached=cache is not None,
        )
        if some is None
        else _progress(f"asking pack {name!r} with a tiny config of {len(asked)} model types", asked)
    )
    answers: dict[str, str] = {}
    failed = False
    with transformers_notices_off():
        for model_type in asked:
            if progress is not None:
                progress.step(model_type)
            gathered = ask(_context(model_type, configs(model_type)))
            failed = failed or bool(gathered.failures)
            answer = _answer(gathered)
            if answer:
                answers[model_type] = answer
    if progress is not None:
        progress.finish()
    if cache is not None and not failed and some is None:
        _keep(cache, entry, answers)
    return answers


def targets_of(model_type: str, patch_targets: Iterable[str], classes: Mapping[str, type] | None = None) -> set[Target]:
    """Every class a load of ``model_type`` resolves (``load_classes``) that one of ``patch_targets`` matches
    (transformers' rules, as a load applies them), with its signatures: what a drift record
    lists for patches with those targets.

    Args:
        model_type: the model type.
        patch_targets: ``Patch.target`` values (class names or patterns).
        classes: those classes, when the caller has them already.
    """
    classes = load_classes(model_type) if classes is None else classes
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
        context = _context(model_type, config)
        classes = load_classes(model_type, config)
        together = " + ".join(sorted(names))
        try:
            plan = plan_load(
                context,
                packs,
                priority_offsets=session.selection.spec.priority_offsets,
                class_names=classes,
                registered={},
                report=ignore,
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


def ignore(errors: Iterable[HfPatchError]) -> None:
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


def targeted_model_types(
    packs: PackSet, priority_offsets: Mapping[str, int] | None = None, *, config_for: ConfigFor | None = None
) -> dict[str, set[str]]:
    """For each model type, the packs of ``packs`` that target it, as ``check_pack`` finds targets:
    a patch or converter asked with ``config=None``, or the model type declared (``provide_model_types``);
    with ``config_for``, a pack that targets nothing that way (a structural pack) is asked with
    ``config_for(model_type)`` (``asked_with_configs``, its answers cached): on every model type, or,
    when it is the only such pack, on those the others target (a conflict takes two packs)."""
    targets: dict[str, set[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        context = _context(model_type, None)
        gathered = packs.gather(context, priority_offsets)
        offering = [
            *(claim.pack for claim in gathered.claims),
            *(claim.pack for claim in gathered.converters),
            *(claim.pack for claim in gathered.steps),
        ]
        for pack in offering:
            targets.setdefault(model_type, set()).add(pack)
    for name, info in packs.infos.items():
        for model_type in declared_model_types(info)[0]:
            targets.setdefault(model_type, set()).add(name)
    if config_for is not None:
        placed = {name for names in targets.values() for name in names}
        structural = sorted(name for name in packs.infos if name not in placed)
        others = list(targets) if len(structural) == 1 else None
        for name in structural:
            alone = PackSet({name: packs.infos[name]}, guard=HOOK_GUARD)
            answers = asked_with_configs(alone, name, config_for, cache=_answers_cache(), model_types=others)
            for model_type, answer in answers.items():
                if answer == "offers":
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
    for model_type, names in sorted(targeted_model_types(packs, offsets, config_for=config_for).items()):
        if len(names) < 2:
            continue
        context = LoadContext(
            model_type=model_type, model_class_name=_default_class_name(model_type), config=configs(model_type)
        )
        classes = tuple(load_classes(model_type, context.config))
        gathered = gather_for(context, packs, priority_offsets=offsets, class_names=classes)
        decide = decider(context, classes, registered={})
        problems.append(Problem(model_type, gathered, decide))
        found: list[PatchConflictError | ConverterConflictError] = list(patch_conflicts(gathered.claims))
        if not found:
            try:
                decide(gathered)
            except (ConverterConflictError, PatchConflictError) as exc:  # converters', or model steps' ties
                found.append(exc)
        conflicts.extend(PackConflict(model_type, exc.target, exc.packs, exc.problem) for exc in found)
    if not conflicts:
        return Conflicts(tuple(problem.model_type or "" for problem in problems))
    change, checked = settle(problems)
    text = None if change is None else selection_text(change, spec=selection.spec, enabled=selection.packs)
    return Conflicts(tuple(problem.model_type or "" for problem in problems), tuple(conflicts), text, checked)


@functools.cache
def probe_config(model_type: str) -> Any:
    """The config check and verify call a pack's hooks with: the model type's tiny config (built
    once per process), else its default config, else ``None``."""
    from transformers.utils import logging as hf_logging

    from .._pipeline.model_types import default_config
    from ..testing import tiny_config

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.CRITICAL)  # some default configs log errors while they are shrunk
    try:
        return tiny_config(model_type)
    except Exception:  # a config that cannot be shrunk (or built) is asked as it is
        return default_config(model_type)
    finally:
        hf_logging.set_verbosity(verbosity)


def check_model_types(model_types: Sequence[str] | None) -> None:
    from .._pipeline.model_types import unknown_model_type

    for model_type in model_types or ():
        unknown = unknown_model_type(model_type)
        if unknown is not None:
            raise UsageError(f"--model-type {unknown}")


def cmd_check(args: argparse.Namespace) -> int:
    from .._pipeline.selection import current_selection
    from .._session.session import Session
    from ..errors import HfPatchError

    check_model_types(args.model_type)
    selection = current_selection(args.packs or None, origin="hfpatch check")
    session = Session(selection, strict=False)
    failed = False
    for error in selection.problems:
        print(f"FAIL  {error}")
        failed = True
    results = []
    for name in sorted(selection.packs):
        result = check_pack(session, name, args.model_type or (), config_for=probe_config, cache=True)
        results.append(result)
        targets = ", ".join(result.model_types) or "no model type"
        # --record refreshes the record: the drift it replaces is not a failure
        ok = not result.problems and (args.record or not result.drift)
        failed = failed or not ok
        print(f"{'ok   ' if ok else 'FAIL '} {name} {result.version}: targets {targets}")
        for problem in result.problems:
            print(f"      - {problem}")
        for refused in result.refused:
            print(f"      refused (left as it is): {refused}")
        if args.record:
            try:
                path = write_record(result)
            except (HfPatchError, OSError) as exc:
                failed = True
                print(f"      not recorded: {exc}")
            else:
                classes = len(result.targets)
                print(
                    f"      recorded {classes} class{'es' if classes != 1 else ''} on transformers "
                    f"{transformers_version()} in {path}"
                )
            continue
        for drift in result.drift:
            print(f"      - {drift.describe()}")
        if result.drift:
            print(f"      verify the pack on this release, then `hfpatch check --record {name}` adds it to the record")
        elif not result.recorded and not result.problems:
            print(f"      no drift record: `hfpatch check --record {name}` writes one (not a failure)")
    if len(results) > 1:
        together = ", ".join(result.pack for result in results)
        problems = check_combination(session, results, config_for=probe_config)
        if problems:
            failed = True
            print(f"FAIL  together: {together}")
            for problem in problems:
                print(f"      - {problem}")
        else:
            print(f"ok    together: {together}")
    if not selection.packs and not selection.problems:
        print("No pack to check.")
    return EXIT_PROBLEMS if failed else EXIT_OK
