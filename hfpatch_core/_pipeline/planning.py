"""One load's plan, complete: gather the packs' claims, resolve them, compose the conversions.

``plan_load`` is the one way a plan is made: for a ``from_pretrained`` / ``from_config``
load, a ``patched()`` block, ``hfpatch explain``, ``check`` and ``verify``.  So every
caller gives packs the same context for the same model and gets the same plan (and
fingerprint).  The functions that name a model's classes live here for the same reason.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.nn as nn

from .. import _compat
from ..context import LoadContext
from ..conversion import source_patterns_of
from ..errors import ConverterConflictError, HfPatchError, PackError, PatchConflictError
from ..plan import Conversions, Plan
from .composition import compose, scope_for
from .foreign import displacements, foreign_replacements, overrides
from .gathering import Gathered, PackSet
from .parallel import refuse_unsharded
from .resolution import PatchDecision, matches, resolve_converters, resolve_patches, resolve_steps, unused_converters
from .selection import SelectionSpec
from .settling import Problem, settled

#: How a caller hears of pack failures while a plan is made: a warning each, or raise (strict).
Report = Callable[[Iterable[HfPatchError]], None]


def raise_first(errors: Iterable[HfPatchError]) -> None:
    """The strict ``Report``: the first failure is raised."""
    for error in errors:
        raise error


def module_classes(module: types.ModuleType) -> dict[str, type]:
    """The ``nn.Module`` classes a module holds, by attribute name (what a load resolves claims against)."""
    return {
        name: value for name, value in vars(module).items() if isinstance(value, type) and issubclass(value, nn.Module)
    }


def modeling_module(model_type: str, *, load: bool = True) -> types.ModuleType | None:
    """``transformers.models.<type>.modeling_<type>`` (imported unless ``load=False``), or ``None``."""
    package = model_type.replace("-", "_")
    name = f"transformers.models.{package}.modeling_{package}"
    if not load:
        return sys.modules.get(name)
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


#: module name -> (module, namespace size, newest name, its class names): a modeling module
#: is read again only when names were added to it (see ``application._MatchCache``).
_class_names: dict[str, tuple[types.ModuleType, int, str | None, tuple[str, ...]]] = {}


def class_names_for(model_class: type) -> tuple[str, ...]:
    """The module classes a load of ``model_class`` resolves claims against: those of its modeling module."""
    module = sys.modules.get(model_class.__module__)
    if module is None:
        return (model_class.__name__,)
    namespace = vars(module)
    size, newest = len(namespace), next(reversed(namespace.keys()), None)
    cached = _class_names.get(module.__name__)
    if cached is not None and cached[0] is module and cached[1:3] == (size, newest):
        return cached[3]
    names = tuple(module_classes(module))
    _class_names[module.__name__] = (module, size, newest, names)
    return names


#: A class defined, or a capitalised name bound, at the top level of a module's source.
_TOP_LEVEL_NAME = re.compile(rb"^(?:class[ \t]+([A-Za-z_]\w*)|([A-Z]\w*)[ \t]*(?::[^=\n]*)?=[^=])", re.M)


@functools.cache
def _source_names() -> frozenset[str]:
    """Every class name (and capitalised top-level name, which may bind a class) in the installed
    transformers' sources: read once, without importing a model (about 0.3 s)."""
    import transformers

    found: set[str] = set()
    for directory, _, files in os.walk(os.path.dirname(transformers.__file__)):
        for file in files:
            if file.endswith(".py"):
                try:
                    with open(os.path.join(directory, file), "rb") as handle:
                        source = handle.read()
                except OSError:
                    continue
                found.update((a or b).decode() for a, b in _TOP_LEVEL_NAME.findall(source))
    return frozenset(found)


@functools.lru_cache(maxsize=1024)
def _in_sources(target: str) -> bool:
    return target in _source_names() or any(matches(target, name) for name in _source_names())


def _in_loaded_modules(target: str) -> bool:
    """Whether a class bound in a loaded ``transformers*`` module (remote code included) matches."""
    for key, module in list(sys.modules.items()):
        if key.startswith("transformers") and isinstance(module, types.ModuleType):
            for name, value in list(vars(module).items()):
                if isinstance(value, type) and matches(target, name):
                    return True
    return False


@functools.lru_cache(maxsize=1024)  # the same targets against the same model's classes, load after load
def _matches_any(target: str, class_names: tuple[str, ...]) -> bool:
    return any(matches(target, name) for name in class_names)


def matches_no_class(target: str, class_names: Iterable[str] = ()) -> bool:
    """Whether a patch target matches no module class of the installed transformers: none of
    ``class_names`` (the model's), none its sources define, none of its loaded modules holds."""
    if _matches_any(target, tuple(class_names)):
        return False
    return not _in_sources(target) and not _in_loaded_modules(target)


def _unknown_targets(gathered: Gathered, class_names: tuple[str, ...]) -> list[PackError]:
    """One failure per pack with a patch target that matches no class of the installed transformers."""
    unknown: dict[str, list[str]] = {}
    for claim in gathered.claims:
        if matches_no_class(claim.target, class_names):
            unknown.setdefault(claim.pack, []).append(claim.target)
    return [
        PackError(
            pack,
            f"pack {pack!r}: patch target{'s' if len(targets) > 1 else ''} {', '.join(map(repr, targets))} "
            "match" + ("" if len(targets) > 1 else "es") + " no module class of the installed transformers "
            "(transformers.models, or any loaded transformers module); the pack is skipped, it would replace "
            "nothing. Check the class name (renamed in this release?).",
        )
        for pack, targets in unknown.items()
    ]


def _without(gathered: Gathered, failures: list[PackError]) -> Gathered:
    """``gathered`` without the claims, converters and participation of the packs that failed."""
    if not failures:
        return gathered
    failed = {failure.pack for failure in failures}
    return dataclasses.replace(
        gathered,
        claims=tuple(claim for claim in gathered.claims if claim.pack not in failed),
        converters=tuple(claim for claim in gathered.converters if claim.pack not in failed),
        packs=tuple(pack for pack in gathered.packs if pack[0] not in failed),
        failures=(*gathered.failures, *failures),
        refused=tuple(refusal for refusal in gathered.refused if refusal.pack not in failed),
        steps=tuple(claim for claim in gathered.steps if claim.pack not in failed),
    )


def _mapped(names: Mapping[str, Any], model_type: str) -> str | None:
    value = names.get(model_type)
    if isinstance(value, tuple | list):
        value = value[0] if value else None
    return value if isinstance(value, str) else None


def default_class_names(config: Any, model_type: str | None) -> list[str]:
    """The classes a checkpoint of ``config`` (or a bare ``model_type``) loads as, most likely first:
    its ``architectures``, then the model type's causal LM, then its image-text-to-text model (a
    composite model's class with the LM head: ``LlavaForConditionalGeneration``), then its base model."""
    from transformers.models.auto import modeling_auto

    names = list(getattr(config, "architectures", None) or ())
    if model_type:
        for mapping in (
            "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            "MODEL_MAPPING_NAMES",
        ):
            name = _mapped(getattr(modeling_auto, mapping, {}), model_type)
            names += [name] if name else []
    return list(dict.fromkeys(names))


def context_for(
    config_or_model_type: Any, model_class: type | None = None, *, load_module: bool = False
) -> tuple[LoadContext, list[str]]:
    """The context (and class names) of building a model of a config or ``model_type`` string.

    ``model_class``: the class about to be built, when known.  Otherwise the model is
    taken to be the first of ``default_class_names``.  ``load_module``: import the model
    type's modeling module to name its classes (otherwise only if already imported).
    """
    config: Any = None if isinstance(config_or_model_type, str) else config_or_model_type
    model_type: str | None = (
        config_or_model_type if isinstance(config_or_model_type, str) else getattr(config, "model_type", None) or None
    )
    if model_class is not None:
        return LoadContext.for_model(model_class, config), list(class_names_for(model_class))
    names = default_class_names(config, model_type)
    module = modeling_module(model_type, load=load_module) if model_type else None
    class_names = list(module_classes(module)) if module is not None else []
    context = LoadContext(
        model_type=model_type, model_class_name=names[0] if names else "PreTrainedModel", config=config
    )
    return context, class_names


def gather_for(
    context: LoadContext,
    packs: PackSet,
    *,
    priority_offsets: Mapping[str, int] | None = None,
    class_names: Iterable[str] = (),
) -> Gathered:
    """What ``packs`` offer for ``context``, without the packs that target no class or cannot shard
    (those are among its ``failures``): what ``plan_load`` resolves."""
    gathered = packs.gather(context, priority_offsets)
    gathered = _without(gathered, _unknown_targets(gathered, tuple(class_names)))
    return refuse_unsharded(gathered, context)


#: A load's resolution of what was gathered: raises the first conflict (see ``decider``).
Decide = Callable[[Gathered], "tuple[PatchDecision, Conversions]"]


def decider(
    context: LoadContext,
    class_names: Iterable[str] = (),
    *,
    registered: Mapping[str, type] | None = None,
    overridable: Iterable[str] = (),
) -> Decide:
    """How ``plan_load`` decides a ``Gathered`` for ``context`` (arguments as ``plan_load``'s):
    ``settling`` decides candidate selections with it."""
    names, owned = tuple(class_names), tuple(overridable)
    return functools.partial(_decide, context=context, class_names=names, registered=registered, overridable=owned)


def _decide(
    gathered: Gathered,
    *,
    context: LoadContext,
    class_names: tuple[str, ...],
    registered: Mapping[str, type] | None,
    overridable: tuple[str, ...],
) -> tuple[PatchDecision, Conversions]:
    """Resolve ``gathered``: which patches win and the conversions registered; raises the first conflict
    (a tie between model steps too, so that ``settling`` finds a selection that settles those)."""
    resolve_steps(gathered.steps)
    decision = resolve_patches(gathered.claims, registered=registered, overridable=overridable, class_names=class_names)
    if not gathered.converters:
        return decision, Conversions()
    unused = unused_converters(gathered.converters, gathered.claims, decision, classes_known=bool(class_names))
    kept = [claim for claim in gathered.converters if claim.index not in unused]
    dropped = [(claim, unused[claim.index]) for claim in gathered.converters if claim.index in unused]
    if not kept:
        return decision, Conversions(lost=tuple(dropped))
    conversion_mapping = _compat.module("conversion_mapping")
    scope = scope_for(context.model_type, context.model_class_name, kept)
    converters = resolve_converters(kept, overlap=scope.overlap)
    conversions = compose(
        converters.winners,
        builtin=conversion_mapping.get_checkpoint_conversion_mapping,
        scope=scope,
        lost=[*dropped, *converters.lost],
    )
    return decision, conversions


def _replaced_by_an_enclosing_load(key: str, pattern: str) -> bool:
    """Whether ``pattern`` names a transform of transformers' list for ``key`` that the load this one
    is nested in has already replaced (a head class's base, built inside the head's load: its
    lists start from the enclosing load's, without what that load's converters replaced)."""
    before = _compat.conversions_before_hfpatch(key) if key in _compat.displaced_conversions else None
    return any(pattern in source_patterns_of(transform) for transform in before or ())


def plan_load(
    context: LoadContext,
    packs: PackSet,
    *,
    priority_offsets: Mapping[str, int] | None = None,
    class_names: Iterable[str] = (),
    registered: Mapping[str, type] | None = None,
    overridable: Iterable[str] = (),
    report: Report = raise_first,
    selection: SelectionSpec | None = None,
) -> Plan:
    """Gather ``packs``' claims for ``context``, resolve them and compose the conversions.

    Args:
        context: the load.
        packs: the selected packs.
        priority_offsets: each pack's offset from the selection (``name@N``).
        class_names: the module classes the model is built from (see ``resolve_patches``);
            empty when unknown, and then every winning claim counts as applied.
        registered: transformers' patch registry before this load registers anything.
        overridable: keys of ``registered`` an enclosing hfpatch load put there.
        report: hears each pack failure (a failing pack's claims are left out); raising
            from it stops planning (strict mode).
        selection: the choice that selected ``packs``, to write the ``HF_PATCH_PACKS``
            value a conflict error suggests (``None``: the enabled packs are listed).

    Raises:
        PatchConflictError: two packs tie on a target; the message names every claimant
            of the target and a selection checked to settle every conflict of the load
            (``settling``).
        ConverterConflictError: two packs convert the same tensors with the same rank.
    """
    class_names = tuple(class_names)
    gathered = gather_for(context, packs, priority_offsets=priority_offsets, class_names=class_names)
    report(gathered.failures)
    decide = decider(context, class_names, registered=registered, overridable=overridable)
    try:
        decision, conversions = decide(gathered)
    except (PatchConflictError, ConverterConflictError) as exc:
        problem = Problem(context.model_type, gathered, decide)
        raise settled(exc, [problem], spec=selection, enabled=packs.infos, offsets=priority_offsets) from None
    report(
        PackError(
            claim.pack,
            f"pack {claim.pack!r}: converter for {claim.key!r} replaces {pattern!r}, "
            "which matches no transform registered for that key; check the source pattern.",
        )
        for claim, pattern in conversions.unmatched
        if not _replaced_by_an_enclosing_load(claim.key, pattern)
    )
    foreign = foreign_replacements(
        modeling_module(context.model_type, load=False) if context.model_type else None,
        class_names,
        registered=registered or {},
        overridable=overridable,
        replaced=decision.replaced,
        lost=decision.lost,
        refused=gathered.refused,
    )
    report(overrides(found) for found in foreign if found.overridden_by)
    report(displacements(foreign))
    steps = resolve_steps(gathered.steps)
    return Plan(
        context=context,
        packs=tuple(sorted(set(gathered.packs))),
        entries=decision.entries,
        lost=decision.lost,
        replaced=decision.replaced,
        conversions=conversions,
        refused=gathered.refused,
        foreign=foreign,
        steps=steps.winners,
        lost_steps=steps.lost,
    )
