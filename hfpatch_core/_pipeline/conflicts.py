"""The conflicts between the packs of a selection, found before any load: every model type two or
more of them target (``probing.targeted_model_types``), planned as a load would plan it, on the
meta device's terms (configs and class names, no weights).  ``hfpatch list`` shows them."""

from __future__ import annotations

import dataclasses

from ..context import LoadContext
from ..errors import ConverterConflictError, PatchConflictError
from .gathering import HookGuard, PackSet
from .model_types import default_config, load_classes
from .planning import decider, gather_for
from .probing import AnswerCache, ConfigFor, ShowProgress, default_class_name, targeted_model_types
from .resolution import patch_conflicts
from .selection import Selection
from .settling import Problem, selection_text, settle


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


def find_conflicts(
    selection: Selection,
    *,
    guard: HookGuard,
    config_for: ConfigFor | None = None,
    cache: AnswerCache | None = None,
    progress: ShowProgress | None = None,
) -> Conflicts:
    """Plan every model type two or more of ``selection``'s packs target, on the meta device's
    terms (configs and class names, no weights), as a load would: the ties, and one selection
    checked to settle all of them at once (``settling.settle`` over every such model type, so
    that settling one model type's conflicts makes none on another).

    Args:
        selection: the packs, with their priority offsets.
        guard: what the packs' hooks are called under (``_runtime.snapshot.HOOK_GUARD``).
        config_for: the config each model type is planned with (default: its default config);
            a structural pack is asked with it too (``probing.targeted_model_types``).
        cache: where a structural pack's answers are kept.
        progress: shows a line while a structural pack is asked about every model type.
    """
    configs = config_for or default_config
    offsets = selection.spec.priority_offsets
    packs = PackSet(selection.packs, guard=guard)
    problems: list[Problem] = []
    conflicts: list[PackConflict] = []
    targeted = targeted_model_types(packs, offsets, config_for=config_for, cache=cache, progress=progress)
    for model_type, names in sorted(targeted.items()):
        if len(names) < 2:
            continue
        context = LoadContext(
            model_type=model_type, model_class_name=default_class_name(model_type), config=configs(model_type)
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
