"""``hfpatch lock``: write the lock of this environment's packs and plans, or check the environment against one."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

from .._pipeline.locking import Lock, LockedPack, LockedPlan
from .._pipeline.model_types import load_config, model_class_for
from .._pipeline.planning import class_names_for, context_for, plan_load
from .._pipeline.selection import current_selection, installed_transformers_version
from .._session.session import Session
from ..context import LoadContext
from ..errors import HfPatchError
from ..plan import Plan
from ..settings import LOCK_ENV, PACKS_ENV, lock_from_env
from .check import check_model_types, targeted_model_types
from .exit_codes import EXIT_OK, EXIT_PROBLEMS


def plan_for(session: Session, source: str) -> Plan:
    """The plan a load of ``source`` (a model type, planned with its default config, or a
    checkpoint directory) gets from ``session``'s packs, as ``Session.plan`` makes it for a
    load with an empty patch registry."""
    config = load_config(source)
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
        registered={},
        report=session.report,
        selection=session.selection.spec,
    )


def lock_sources(session: Session, model_types: Iterable[str] = (), models: Iterable[str] = ()) -> dict[str, str]:
    """What each locked model type is planned from: every model type the selected packs target
    (``check``'s rule), and ``model_types``, from their default configs; each checkpoint of
    ``models`` instead of its model type's default config."""
    sources: dict[str, str] = {}
    if session.selection.packs:
        targeted = targeted_model_types(session.packs, session.selection.spec.priority_offsets)
        sources.update((model_type, model_type) for model_type in sorted(targeted))
    sources.update((model_type, model_type) for model_type in model_types)
    for model in models:
        model_type = getattr(load_config(model), "model_type", None) or model
        sources[model_type] = model
    return dict(sorted(sources.items()))


def build_lock(session: Session, path: str, sources: dict[str, str]) -> Lock:
    """The lock of ``session``'s packs (hashed as installed now) and of the plans of ``sources``."""
    spec = session.selection.spec
    packs = {
        name: LockedPack.of(info, spec.priority_offsets.get(name, 0)) for name, info in session.selection.packs.items()
    }
    plans = {}
    for model_type, source in sources.items():
        plan = plan_for(session, source)
        plans[model_type] = LockedPlan.of(plan, source)
    selection = spec.text if spec.text is not None else spec.mode if spec.mode != "only" else ""
    return Lock(path, selection, installed_transformers_version(), packs, plans)


def lock_differences(lock: Lock, session: Session) -> list[str]:
    """What differs between ``lock`` and this environment: the packs, then (when they match)
    each locked model type's plan, made again from what it was planned from."""
    changes = lock.pack_changes(session.selection)
    if changes:
        return changes
    for model_type, locked in lock.plans.items():
        # a checkpoint directory that is gone is planned from its model type's default config
        source = locked.source if os.path.isdir(locked.source) or locked.source == model_type else model_type
        changes.extend(lock.plan_changes(plan_for(session, source), locked.source))
    return changes


def _locked_session() -> Session:
    # what a load under the lock selects: an unset HF_PATCH_PACKS means no pack
    return Session(current_selection(locked=True), strict=False)


def cmd_lock(args: argparse.Namespace) -> int:
    if args.check is not None:
        return check_lock(args.check)
    check_model_types(args.model_type)
    # what loads will select: an unset HF_PATCH_PACKS means none when HF_PATCH_LOCK is set
    session = Session(current_selection(locked=lock_from_env() is not None), strict=False)
    lock = build_lock(session, args.output, lock_sources(session, args.model_type or (), args.model or ()))
    lock.write()
    packs = ", ".join(f"{pack.name} {pack.version}" for pack in lock.packs.values()) or "none"
    plans = ", ".join(lock.plans) or "none"
    print(f"Wrote {lock.path}: packs {packs}; plans of {plans}.")
    print(
        f"Run with {LOCK_ENV}={lock.path} and {PACKS_ENV}={lock.selection}: a load whose packs or plan differ raises."
    )
    return EXIT_OK


def check_lock(path: str) -> int:
    lock = Lock.read(path)
    changes = lock_differences(lock, _locked_session())
    if not changes:
        packs, plans = ", ".join(lock.packs) or "none", ", ".join(lock.plans) or "none"
        print(f"{lock.path} matches: packs {packs}; plans of {plans}.")
        return EXIT_OK
    print(f"{lock.path} differs from this environment ({PACKS_ENV} as set now; unset selects no pack under a lock):")
    for change in changes:
        print(f"  - {change}")
    print(
        f"If the change is meant, write the lock again: hfpatch lock -o {lock.path} "
        f"(with {PACKS_ENV}={lock.selection}, the lock's selection)."
    )
    return EXIT_PROBLEMS
