"""Which model types a pack targets, asked as a load would ask it.

A model type is *targeted* by a pack when the pack returns a patch, converter or model step
for it asked with ``config=None``, or declares it (``provide_model_types``); a pack that does
neither (a structural pack, deciding from the config alone) is asked with a config of every
model type (``asked_with_configs``).  ``hfpatch check`` checks the targets, ``hfpatch list``
plans them together for conflicts (``conflicts.find_conflicts``) and ``hfpatch lock`` records
their plans.

What takes long is kept by the caller: a ``AnswerCache`` (the command line's on-disk cache)
and a ``ShowProgress`` (its progress lines on stderr) are passed in, never imported here.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import pluggy
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from .. import hookspecs
from ..authoring.drift import Target
from ..authoring.randomness import isolated_rng
from ..context import LoadContext
from .discovery import PackInfo
from .gathering import Gathered, PackSet
from .model_types import load_classes, transformers_notices_off, unknown_model_type
from .planning import default_class_names
from .resolution import matches

#: The config a pack's hooks are asked with for a model type (``None`` when none can be built).
ConfigFor = Callable[[str], Any]


class AnswerCache(Protocol):
    """Where slowly found answers are kept (``hfpatch_core.cli.cache.Cache``)."""

    def get(self, name: str) -> Any | None:
        """The entry ``name``, or ``None``."""
        ...

    def put(self, name: str, value: Any) -> None:
        """Keep ``value`` (JSON) as entry ``name``."""
        ...

    def discard(self, stale: Callable[[str], bool]) -> None:
        """Forget the entries whose name ``stale`` accepts."""
        ...


class ProgressLine(Protocol):
    """The progress of one long step (``hfpatch_core.cli.output.Progress``)."""

    def step(self, item: str) -> None:
        """One item is about to be computed."""
        ...

    def finish(self) -> None:
        """The step is over."""
        ...


class ShowProgress(Protocol):
    """Starts a progress line: what is done, how many items, whether the result is kept."""

    def __call__(self, what: str, total: int, *, cached: bool) -> ProgressLine: ...


def progress_over(progress: ShowProgress | None, what: str, items: Iterable[str]) -> ProgressLine | None:
    """A progress line for a step over many model types (``None`` for a few: nothing to wait for)."""
    count = len(list(items))
    return progress(what, count, cached=True) if progress is not None and count > 20 else None


def default_class_name(model_type: str) -> str:
    """The model class a load of ``model_type`` is asked about: its default one."""
    return next(iter(default_class_names(None, model_type)), "PreTrainedModel")


def probe_context(model_type: str, config: Any) -> LoadContext:
    """The context packs' hooks are asked with for ``model_type``: a load of its default model class."""
    return LoadContext(model_type=model_type, model_class_name=default_class_name(model_type), config=config)


def answer_of(gathered: Gathered) -> str:
    """``"offers"`` (a patch, converter or model step), ``"refuses"`` (refusals only) or ``""``."""
    if gathered.claims or gathered.converters or gathered.steps:
        return "offers"
    return "refuses" if gathered.refused else ""


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


def pack_source_digest(module_file: str | Path | None) -> str:
    """A hash of the Python source of a pack: the files of the package whose ``__init__.py`` is
    ``module_file`` (every ``.py`` under it), or that one module file; ``""`` without a file.

    An editable install's ``RECORD`` lists no source file, so the installed distribution's hash
    (``cli.cache.environment_key``) does not see an author's edits; this does.  Data files (the
    drift record) are left out: rewriting the record does not change what the hooks answer.
    """
    if module_file is None:
        return ""
    path = Path(module_file)
    files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    digest = hashlib.sha256()
    for file in files:
        if "__pycache__" in file.parts:
            continue
        with contextlib.suppress(OSError):
            digest.update(f"{file.name}\0".encode() + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def pack_identity(info: PackInfo) -> list[str]:
    """What names a pack's answers in a cache: its name, distribution, version, entry point and
    a hash of its source (``pack_source_digest``: an editable install's edits count)."""
    module = info.value.partition(":")[0].strip()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None and spec.has_location else None
    return [info.name, info.distribution, info.version, info.value, pack_source_digest(origin)]


def configs_name(configs: ConfigFor) -> str:
    """Which configs a pack was asked with, in a cache entry's name: answers to tiny configs are not
    answers to default ones."""
    return f"{getattr(configs, '__module__', '')}.{getattr(configs, '__qualname__', repr(configs))}"


def keep(cache: AnswerCache, entry: str, value: Any) -> None:
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


def asked_with_configs(
    packs: PackSet,
    name: str,
    configs: ConfigFor,
    *,
    cache: AnswerCache | None = None,
    gather: Callable[[LoadContext], Gathered] | None = None,
    model_types: Iterable[str] | None = None,
    progress: ShowProgress | None = None,
) -> dict[str, str]:
    """The model types pack ``name`` answers when asked with ``configs(model_type)`` for every model
    type of the installed transformers (or of ``model_types``): model type -> ``"offers"`` or ``"refuses"``.

    What a pack that decides from the config alone (a structural pack: nothing for ``config=None``,
    no ``provide_model_types``) applies to; ``check`` checks these and ``list`` plans them for
    conflicts.  Asking builds each model type's config, and the pack builds and probes each model:
    the answer is kept in ``cache``, named by the pack's version and source hash, unless the pack
    failed (it is asked again); the answers for some ``model_types`` are read from it, not kept.
    ``progress`` shows a line while it asks every model type.
    """
    info = packs.infos[name]
    entry = json.dumps(["asked", configs_name(configs), *pack_identity(info)])
    found = cache.get(entry) if cache is not None else None
    some = None if model_types is None else [t for t in dict.fromkeys(model_types) if t in CONFIG_MAPPING_NAMES]
    if isinstance(found, dict):
        return {str(t): str(answer) for t, answer in found.items() if some is None or t in some}
    ask = gather or (lambda context: packs.gather(context))
    asked = list(CONFIG_MAPPING_NAMES) if some is None else some
    if some is None:
        line = (
            progress(
                f"asking pack {name!r} with a tiny config of every model type (declare provide_model_types, "
                "or pass --model-type, to ask only those)",
                len(asked),
                cached=cache is not None,
            )
            if progress is not None
            else None
        )
    else:
        line = progress_over(progress, f"asking pack {name!r} with a tiny config of {len(asked)} model types", asked)
    answers: dict[str, str] = {}
    failed = False
    with transformers_notices_off():
        for model_type in asked:
            if line is not None:
                line.step(model_type)
            gathered = ask(probe_context(model_type, configs(model_type)))
            failed = failed or bool(gathered.failures)
            answer = answer_of(gathered)
            if answer:
                answers[model_type] = answer
    if line is not None:
        line.finish()
    if cache is not None and not failed and some is None:
        keep(cache, entry, answers)
    return answers


def targeted_model_types(
    packs: PackSet,
    priority_offsets: Mapping[str, int] | None = None,
    *,
    config_for: ConfigFor | None = None,
    cache: AnswerCache | None = None,
    progress: ShowProgress | None = None,
) -> dict[str, set[str]]:
    """For each model type, the packs of ``packs`` that target it, as ``check_pack`` finds targets:
    a patch or converter asked with ``config=None``, or the model type declared (``provide_model_types``);
    with ``config_for``, a pack that targets nothing that way (a structural pack) is asked with
    ``config_for(model_type)`` (``asked_with_configs``, its answers kept in ``cache``): on every model
    type, or, when it is the only such pack, on those the others target (a conflict takes two packs)."""
    targets: dict[str, set[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        context = probe_context(model_type, None)
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
            alone = PackSet({name: packs.infos[name]}, guard=packs.guard)
            answers = asked_with_configs(alone, name, config_for, cache=cache, model_types=others, progress=progress)
            for model_type, answer in answers.items():
                if answer == "offers":
                    targets.setdefault(model_type, set()).add(name)
    return targets


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
