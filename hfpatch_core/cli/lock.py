"""``hfpatch lock``: write the lock of this environment's packs and plans, or check the environment against one.

A plan is locked by what the packs decide (``LockedPlan``: no sizes), so each model type is
planned once, from its default config (a model type is never read as a path) or from the
checkpoints ``--model`` names.  Planning imports transformers and every pack and takes long
for many model types: the targeted model types and each plan are kept in the cache
(``cache.Cache``, keyed by the installed versions and the packs' files), so that a second
``lock --check`` reads the lock, hashes the packs and compares without importing either.
A model type the lock did not plan is held by it too, under the locked transformers
(``Lock.decision_changes``): the lock need not plan every model type its packs apply to.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .._pipeline.locking import Lock, LockedPack, LockedPlan
from .._pipeline.selection import Selection, current_selection, installed_transformers_version
from ..settings import LOCK_ENV, PACKS_ENV, lock_from_env
from .cache import Cache, environment_key
from .exit_codes import EXIT_OK, EXIT_PROBLEMS
from .output import Progress, UsageError

if TYPE_CHECKING:
    from .._session.session import Session
    from ..plan import Plan

#: What a model type is planned from: ``(model type, checkpoint directory or None for its default config)``.
Source = tuple[str, str | None]


def plan_for(session: Session, model_type: str, directory: str | None = None) -> Plan:
    """The plan a load of ``model_type`` (its default config, or the config of the checkpoint
    ``directory``) gets from ``session``'s packs, as ``Session.plan`` makes it for a load with
    the patch registry as it is (empty in the command's own process; another library's entries
    where the lock is written in the process that made them: ``LockedPlan.foreign``)."""
    from transformers import AutoConfig, monkey_patching

    from .._pipeline.model_types import model_class_for
    from .._pipeline.planning import class_names_for, context_for, plan_load
    from ..context import LoadContext
    from ..errors import HfPatchError

    # a model type is read as a model type: a folder of that name in the working directory is not its config
    config = AutoConfig.from_pretrained(directory) if directory is not None else AutoConfig.for_model(model_type)
    try:
        model_class = model_class_for(config)
    except HfPatchError:  # a model type without a model class: planned as a patched() block would
        context, class_names = context_for(config, load_module=True)
    else:
        context, class_names = LoadContext.for_model(model_class, config), list(class_names_for(model_class))
    return plan_load(
        context,
        session.packs,
        priority_offsets=session.selection.spec.priority_offsets,
        class_names=class_names,
        registered=monkey_patching.get_patch_mapping(),
        report=session.report,
        selection=session.selection.spec,
    )


def _selection_key(selection: Selection) -> str:
    offsets = selection.spec.priority_offsets
    return json.dumps(sorted([name, offsets.get(name, 0)] for name in selection.packs))


def _source_key(source: Source) -> str:
    model_type, directory = source
    if directory is None:
        return model_type
    try:  # the checkpoint's config decides its plan: a changed config.json is another entry
        with open(os.path.join(directory, "config.json"), "rb") as handle:
            config = hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        config = "unreadable"
    return f"{model_type} {os.path.abspath(directory)} {config}"


class Planner:
    """The plans of one selection, from the cache or made (importing transformers and the packs) on a miss."""

    def __init__(self, selection: Selection) -> None:
        self.selection = selection
        self.cache = Cache("plans", environment_key())
        self._selection = _selection_key(selection)
        self._session: Session | None = None

    @property
    def session(self) -> Session:
        if self._session is None:
            from .._session.session import Session

            self._session = Session(self.selection, strict=False)
        return self._session

    def targeted(self) -> list[str]:
        """Every model type the selected packs target (``check``'s rule), sorted."""
        if not self.selection.packs:
            return []
        name = f"targets {self._selection}"
        found = self.cache.get(name)
        if found is None:
            from .._pipeline.probing import targeted_model_types

            progress = Progress("finding the model types the packs target", 1)
            session = self.session
            found = sorted(targeted_model_types(session.packs, session.selection.spec.priority_offsets))
            progress.step("every model type")
            progress.finish()
            self.cache.put(name, found)
        return list(found)

    def plans(self, sources: Sequence[Source]) -> list[LockedPlan]:
        """The plan of each source as the lock records it."""
        found: dict[int, LockedPlan] = {}
        missing = []
        for index, source in enumerate(sources):
            cached = self.cache.get(f"plan {self._selection} {_source_key(source)}")
            if isinstance(cached, dict):
                found[index] = LockedPlan.from_json(source[0], cached)
            else:
                missing.append(index)
        if missing:
            progress = Progress("planning the model types", len(missing))
            for index in missing:
                model_type, directory = sources[index]
                progress.step(directory or model_type)
                plan = LockedPlan.of(plan_for(self.session, model_type, directory), directory or "")
                # a model type whose config names another (a checkpoint's) is locked under its own
                plan = dataclasses.replace(plan, model_type=model_type)
                self.cache.put(f"plan {self._selection} {_source_key(sources[index])}", plan.to_json())
                found[index] = plan
            progress.finish()
        return [found[index] for index in range(len(sources))]


def checkpoint_model_type(directory: str) -> str:
    """The model type of the checkpoint ``directory`` (its ``config.json``, read as JSON: no import)."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            model_type = json.load(handle).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise UsageError(f"--model {directory}: {path} cannot be read as a config ({exc})") from None
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(f"--model {directory}: {path} names no model_type; is it a transformers checkpoint?")
    return model_type


def lock_sources(planner: Planner, model_types: Iterable[str] = (), models: Iterable[str] = ()) -> list[Source]:
    """What each locked model type is planned from: every model type the selected packs target
    (``check``'s rule), and ``model_types``, from their default configs; each checkpoint of
    ``models`` instead of its model type's default config."""
    sources: dict[str, list[str | None]] = {}
    for model_type in [*planner.targeted(), *model_types]:
        sources.setdefault(model_type, [None])
    checkpoints: dict[str, list[str | None]] = {}
    for model in models:
        checkpoints.setdefault(checkpoint_model_type(model), []).append(model)
    sources.update(checkpoints)
    return [(model_type, directory) for model_type in sorted(sources) for directory in sources[model_type]]


def build_lock(planner: Planner, path: str, sources: Sequence[Source]) -> Lock:
    """The lock of ``planner``'s packs (hashed as installed now) and of the plans of ``sources``.

    Raises:
        UsageError: two checkpoints of one model type make different plans (one lock holds one
            decision per model type).
    """
    selection = planner.selection
    spec = selection.spec
    packs = {name: LockedPack.of(info, spec.priority_offsets.get(name, 0)) for name, info in selection.packs.items()}
    plans: dict[str, LockedPlan] = {}
    for plan in planner.plans(sources):
        first = plans.setdefault(plan.model_type, plan)
        if first.decision != plan.decision:
            raise UsageError(
                f"--model {first.source or plan.model_type} and --model {plan.source} make different plans for "
                f"model type {plan.model_type!r} ({'; '.join(first.differences(plan))}); a lock holds one plan per "
                "model type: lock them in separate files, or load them with the packs each needs"
            )
    text = spec.text if spec.text is not None else spec.mode if spec.mode != "only" else ""
    return Lock(path, text, installed_transformers_version(), packs, plans)


def lock_differences(lock: Lock, planner: Planner) -> list[str]:
    """What differs between ``lock`` and this environment: the packs, then (when they match)
    each locked model type's plan, made again from what it was planned from (its checkpoint
    while it is there, else its default config)."""
    changes = lock.pack_changes(planner.selection)
    if changes:
        return changes
    sources: list[Source] = [
        (model_type, locked.source if locked.source and os.path.isdir(locked.source) else None)
        for model_type, locked in lock.plans.items()
    ]
    for plan in planner.plans(sources):
        changes.extend(lock.decision_changes(plan))
    return changes


def locked_selection(path: str | None) -> str | None:
    """The selection of the lock at ``path`` (what an unset ``HF_PATCH_PACKS`` means under it), or
    ``None`` when there is no lock there.

    Raises:
        LockError: the file exists and is not a lock.
    """
    if path is None or not os.path.isfile(path):
        return None
    return Lock.read(path).selection


def cmd_lock(args: argparse.Namespace) -> int:
    if args.check is not None:
        return check_lock(args.check)
    # what loads will select: under HF_PATCH_LOCK an unset HF_PATCH_PACKS is that lock's selection
    planner = Planner(current_selection(locked=locked_selection(lock_from_env())))
    lock = build_lock(planner, args.output, lock_sources(planner, args.model_type or (), args.model or ()))
    lock.write()
    packs = ", ".join(f"{pack.name} {pack.version}" for pack in lock.packs.values()) or "none"
    plans = ", ".join(lock.plans) or "none"
    print(f"Wrote {lock.path}: packs {packs}; plans of {plans}.")
    print(
        f"Run with {LOCK_ENV}={lock.path} (and {PACKS_ENV} unset, or {PACKS_ENV}={lock.selection}): a load whose "
        "packs or plan differ raises."
    )
    print(
        f"A model type not planned here loads under it with the locked packs while transformers is {lock.transformers} "
        "(docs/reproducible.md)."
    )
    return EXIT_OK


def check_lock(path: str) -> int:
    lock = Lock.read(path)
    # as a load under this lock selects: HF_PATCH_PACKS, or the lock's own selection when it is unset
    planner = Planner(current_selection(locked=lock.selection))
    changes = lock_differences(lock, planner)
    if not changes:
        packs, plans = ", ".join(lock.packs) or "none", ", ".join(lock.plans) or "none"
        print(f"{lock.path} matches: packs {packs}; plans of {plans}.")
        return EXIT_OK
    print(f"{lock.path} differs from this environment ({PACKS_ENV} as set now; unset means the lock's selection):")
    for change in changes:
        print(f"  - {change}")
    print(
        f"If the change is meant, write the lock again: hfpatch lock -o {lock.path} "
        f"(with {PACKS_ENV}={lock.selection}, the lock's selection)."
    )
    return EXIT_PROBLEMS
