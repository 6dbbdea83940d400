"""The lock: which packs (by the content of their files) and which plans a run may use.

``hfpatch lock`` writes a ``Lock`` (JSON: readable, and no TOML writer to depend on);
``HF_PATCH_LOCK`` / ``enable(lock=...)`` make every load compare the packs it would use
(``Lock.check_packs``) and its plan (``Lock.check_plan``) with it before any weight is
read.  A pack is hashed over the files its distribution's ``RECORD`` lists (``pack_files``), once per
process: after that only the files' ``stat`` is read, so an edit made while the process
runs is still seen.

A plan is locked by what the packs decide, not by what a config's sizes make: the classes
replaced and by what, the winning claims, and each converter's kind and weight patterns
(``SizedConcatenate``, not ``SizedConcatenate(sizes=[4096, ...])``), so that one lock holds
every size of a model type (an 8B and a 70B Llama).  Importing this module imports neither
torch nor transformers (``hfpatch lock --check`` reads a lock without them).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import LockError
from ..settings import PACKS_ENV
from .discovery import PackInfo
from .pack_files import editable_sources, edited_files, pack_digest
from .selection import Selection, installed_transformers_version

if TYPE_CHECKING:
    from ..plan import Plan

#: The format written in ``hfpatch_lock``; a reader refuses any other.  2: plans are locked by
#: decision (converter kinds, no sizes) and keyed by a ``decision`` hash, not ``Plan.fingerprint``.
FORMAT = 2


@dataclasses.dataclass(frozen=True)
class LockedPack:
    """One selected pack as the lock holds it."""

    name: str
    distribution: str
    version: str
    sha256: str
    priority_offset: int = 0

    @classmethod
    def of(cls, info: PackInfo, offset: int = 0) -> LockedPack:
        """``info`` as installed now."""
        return cls(info.name, info.distribution, info.version, pack_digest(info), offset)

    def to_json(self) -> dict[str, Any]:
        return {
            "distribution": self.distribution,
            "version": self.version,
            "sha256": self.sha256,
            "priority_offset": self.priority_offset,
        }


def converter_kind(transform: Any) -> str:
    """A converter as the lock holds it: its class, weight patterns and operations' classes, no
    sizes (``WeightConverter(['q', 'k'] -> ['qk'], [SizedConcatenate])``): the same for every
    config of a model type that the pack converts the same way."""
    from ..conversion import source_patterns_of, target_patterns_of

    operations = [type(operation).__name__ for operation in getattr(transform, "operations", None) or ()]
    kinds = f", [{', '.join(operations)}]" if operations else ""
    return (
        f"{type(transform).__name__}({list(source_patterns_of(transform))!r} -> "
        f"{list(target_patterns_of(transform))!r}{kinds})"
    )


def _step_line(claim: Any) -> str:
    overwrite = ", overwrite" if claim.overwrite else ""
    return f"{claim.target} -> {claim.step.install_name} [{claim.label}, priority {claim.priority}{overwrite}]"


def _claim_line(claim: Any) -> str:
    overwrite = ", overwrite" if claim.patch.overwrite else ""
    return f"{claim.target} -> {claim.patch.replacement_name} [{claim.label}, priority {claim.priority}{overwrite}]"


@dataclasses.dataclass(frozen=True)
class LockedPlan:
    """One model type's plan as the lock holds it.

    Attributes:
        model_type: the model type.
        source: what it was planned from: ``""`` for the model type's default config, or a
            checkpoint directory (``hfpatch lock --model DIR``).  Shown, not compared.
        model_class: the class planned for (shown, not compared: every head class of the
            model type loads under the same plan).
        claims: the winning claims, one line each (target, replacement, pack, priority).
        replaced: for each class of the model type replaced, the replacement and its pack.
        converters: for each conversion key registered, its composed list, one line each, by
            kind (``converter_kind``: no sizes).
        steps: the winning model steps, one line each (target, install function, pack, priority).
        foreign: the classes replaced outside hfpatch where the lock was written, one line each
            (``LlamaMLP <- liger_kernel...LigerSwiGLUMLP [module]``; ``Foreign``): a load whose
            other libraries' patches differ is not the locked one.  ``hfpatch lock`` run as a
            command sees none, so a locked load refuses any.
    """

    model_type: str
    source: str
    model_class: str
    claims: tuple[str, ...] = ()
    replaced: Mapping[str, str] = dataclasses.field(default_factory=dict)
    converters: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    steps: tuple[str, ...] = ()
    foreign: tuple[str, ...] = ()

    @property
    def decision(self) -> str:
        """A short hash of what the packs decided (claims, classes replaced, converter kinds): two
        loads of the model type with the same decision pass the same lock, whatever their sizes."""
        digest = hashlib.sha256()
        for line in self.claims:
            digest.update(f"claim {line}\n".encode())
        for name, replacement in sorted(self.replaced.items()):
            digest.update(f"replaced {name} {replacement}\n".encode())
        for key, lines in sorted(self.converters.items()):
            for line in lines:
                digest.update(f"convert {key} {line}\n".encode())
        for line in self.steps:
            digest.update(f"step {line}\n".encode())
        for line in self.foreign:  # none for a lock written before foreign patches were locked: its hash holds
            digest.update(f"foreign {line}\n".encode())
        return digest.hexdigest()[:12]

    @classmethod
    def of(cls, plan: Plan, source: str = "") -> LockedPlan:
        """``plan`` as the lock records it (``source``: see the attribute)."""
        context = plan.context
        model_type = (context.model_type if context is not None else None) or ""
        return cls(
            model_type=model_type,
            source=source,
            model_class=context.model_class_name if context is not None else "",
            claims=tuple(_claim_line(claim) for claim in plan.entries),
            replaced={
                name: f"{claim.patch.replacement_name} [{claim.label}]" for name, claim in sorted(plan.replaced.items())
            },
            converters={
                key: tuple(f"{converter_kind(entry.transform)} [{entry.origin}]" for entry in entries)
                for key, entries in sorted(plan.conversions.lists.items())
            },
            steps=tuple(_step_line(claim) for claim in plan.steps),
            foreign=foreign_lines(plan),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "from": self.source or "default config",
            "model_class": self.model_class,
            "decision": self.decision,
            "claims": list(self.claims),
            "replaced": dict(self.replaced),
            "converters": {key: list(lines) for key, lines in self.converters.items()},
            # only when there are: a lock without steps reads as before model steps existed
            **({"steps": list(self.steps)} if self.steps else {}),
            **({"foreign": list(self.foreign)} if self.foreign else {}),
        }

    def differences(self, now: LockedPlan) -> list[str]:
        """What ``now`` (the same model type's plan made now) changes, one phrase each."""
        where = f"model type {self.model_type!r}"
        found = []
        for name in sorted({*self.replaced, *now.replaced}):
            was, is_ = self.replaced.get(name), now.replaced.get(name)
            if was != is_:
                found.append(f"{where}: {name} is replaced by {is_ or 'nothing'} (locked: {was or 'not replaced'})")
        for key in sorted({*self.converters, *now.converters}):
            was_list, is_list = self.converters.get(key, ()), now.converters.get(key, ())
            if was_list != is_list:
                now_text, was_text = list(is_list) or "none", list(was_list) or "none"
                found.append(f"{where}: the conversions for {key!r} are {now_text} (locked: {was_text})")
        if self.steps != now.steps:
            now_steps, was_steps = list(now.steps) or "none", list(self.steps) or "none"
            found.append(f"{where}: the model steps are {now_steps} (locked: {was_steps})")
        if self.foreign != now.foreign:
            found.append(f"{where}: {_foreign_phrase(now.foreign, self.foreign)}")
        if not found:
            added = [claim for claim in now.claims if claim not in self.claims]
            removed = [claim for claim in self.claims if claim not in now.claims]
            found += [f"{where}: claim {claim} is new" for claim in added]
            found += [f"{where}: locked claim {claim} is gone" for claim in removed]
        if not found:
            found.append(f"{where}: decision {now.decision} (locked: {self.decision})")
        return found

    @classmethod
    def from_json(cls, model_type: str, plan: Mapping[str, Any]) -> LockedPlan:
        """The plan ``to_json`` wrote for ``model_type``."""
        source = str(plan.get("from", ""))
        return cls(
            model_type,
            "" if source == "default config" else source,
            str(plan.get("model_class", "")),
            tuple(map(str, plan.get("claims", ()))),
            {str(k): str(v) for k, v in dict(plan.get("replaced", {})).items()},
            {str(k): tuple(map(str, v)) for k, v in dict(plan.get("converters", {})).items()},
            tuple(map(str, plan.get("steps", ()))),
            tuple(map(str, plan.get("foreign", ()))),
        )


def foreign_lines(plan: Plan) -> tuple[str, ...]:
    """The classes of ``plan`` replaced outside hfpatch before the load, as the lock holds them
    (sorted; what the load's own code changes in the registry is found after planning)."""
    return tuple(sorted(found.short for found in plan.foreign if found.source != "changed during the load"))


def _foreign_phrase(now: Iterable[str], locked: Iterable[str]) -> str:
    now_list, locked_list = list(now) or "none", list(locked) or "none"
    return f"the classes replaced outside hfpatch are {now_list} (locked: {locked_list})"


@dataclasses.dataclass(frozen=True)
class Lock:
    """What ``hfpatch lock`` wrote: the selection, its packs and the plans of the model types they target.

    Attributes:
        path: the file it was read from (or is written to).
        selection: the ``HF_PATCH_PACKS`` value it was written with (``"all"`` when unset).
        transformers: the transformers version it was written with: not compared for the
            model types it has plans for (a plan that changes with it is); a load of
            another model type the packs change passes only under this version.
        packs: the selected packs, by name.
        plans: the plan of each model type, by model type.
    """

    path: str
    selection: str
    transformers: str
    packs: Mapping[str, LockedPack]
    plans: Mapping[str, LockedPlan]

    # --- file ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        import importlib_metadata

        try:
            version = importlib_metadata.version("hfpatch-core")
        except importlib_metadata.PackageNotFoundError:  # a source tree on the path
            version = "unknown"
        return {
            "hfpatch_lock": FORMAT,
            "written_by": f"hfpatch-core {version}",
            "transformers": self.transformers,
            "selection": self.selection,
            "packs": {name: pack.to_json() for name, pack in sorted(self.packs.items())},
            "plans": {model_type: plan.to_json() for model_type, plan in sorted(self.plans.items())},
        }

    def write(self) -> None:
        """Write the lock to ``path`` (sorted: the same environment writes the same bytes)."""
        Path(self.path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Lock:
        """Read the lock file at ``path``.

        Raises:
            LockError: the file cannot be read or is not a lock ``hfpatch lock`` wrote.
        """
        shown = os.fspath(path)
        try:
            data = json.loads(Path(shown).read_text(encoding="utf-8"))
        except OSError as exc:
            raise LockError(
                f"hfpatch lock {shown!r} cannot be read ({exc.strerror or exc}); write it with "
                f"`hfpatch lock -o {shown}`, or point HF_PATCH_LOCK / enable(lock=...) at the lock file.",
                lock=shown,
            ) from None
        except ValueError as exc:
            raise LockError(
                f"hfpatch lock {shown!r} is not JSON ({exc}); write it again with `hfpatch lock -o {shown}`.",
                lock=shown,
            ) from None
        if not isinstance(data, dict) or data.get("hfpatch_lock") != FORMAT:
            raise LockError(
                f"{shown!r} is not an hfpatch lock of format {FORMAT} (its 'hfpatch_lock' is "
                f"{data.get('hfpatch_lock') if isinstance(data, dict) else None!r}); write it again with "
                f"`hfpatch lock -o {shown}`.",
                lock=shown,
            )
        try:
            packs = {
                name: LockedPack(
                    name,
                    str(pack["distribution"]),
                    str(pack["version"]),
                    str(pack["sha256"]),
                    int(pack.get("priority_offset", 0)),
                )
                for name, pack in dict(data["packs"]).items()
            }
            plans = {
                model_type: LockedPlan.from_json(model_type, plan) for model_type, plan in dict(data["plans"]).items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise LockError(
                f"hfpatch lock {shown!r} is malformed ({type(exc).__name__}: {exc}); write it again with "
                f"`hfpatch lock -o {shown}`.",
                lock=shown,
            ) from None
        return cls(shown, str(data.get("selection", "all")), str(data.get("transformers", "")), packs, plans)

    # --- comparing ----------------------------------------------------------------------
    def pack_changes(self, selection: Selection) -> list[str]:
        """How the packs ``selection`` runs differ from the locked ones, one phrase each naming the pack."""
        found = []
        selected = selection.packs
        offsets = selection.spec.priority_offsets
        for name in sorted({*self.packs, *selected}):
            locked, info = self.packs.get(name), selected.get(name)
            if info is None and locked is not None:
                why = selection.status.get(name)
                if selection.spec.unset_none:
                    why = f"{selection.spec.unset_none} selects no pack; set {PACKS_ENV}={self.selection!r}"
                found.append(
                    f"pack {name!r} ({locked.distribution} {locked.version}) is locked but "
                    + (f"not selected ({why})" if why else "not installed")
                )
                continue
            assert info is not None
            if locked is None:
                found.append(
                    f"pack {name!r} ({info.distribution} {info.version}) was added: it is selected "
                    f"({selection.spec.quoted}) but not in the lock"
                )
                continue
            if info.distribution != locked.distribution:
                found.append(f"pack {name!r} now comes from {info.distribution} (locked: {locked.distribution})")
            elif info.version != locked.version:
                found.append(
                    f"pack {name!r} ({info.distribution}) is version {info.version} (locked: {locked.version})"
                )
            elif pack_digest(info) != locked.sha256:
                edited = edited_files(info)
                sources = editable_sources(info)
                detail = (
                    f"edited since installed: {', '.join(edited)}"
                    if edited
                    else f"installed in editable mode: its sources in {sources} differ from the locked ones"
                    if sources
                    else "reinstalled from other sources or edited with its RECORD"
                )
                found.append(
                    f"pack {name!r} ({info.distribution} {info.version}) has files that differ from the locked ones "
                    f"({detail})"
                )
            offset = offsets.get(name, 0)
            if offset != locked.priority_offset:
                found.append(f"pack {name!r} has priority offset {offset:+d} (locked: {locked.priority_offset:+d})")
        return found

    def plan_changes(self, plan: Plan, source: str = "") -> list[str]:
        """How ``plan`` differs from the locked plan of its model type, one phrase each; a model
        type the lock has no plan for differs only when the plan replaces or converts anything
        and transformers is not the locked version (``decision_changes``)."""
        now = LockedPlan.of(plan, source)
        if now.model_type not in self.plans and not (plan.entries or plan.conversions or plan.steps or now.foreign):
            return []
        return self.decision_changes(now)

    def decision_changes(self, now: LockedPlan) -> list[str]:
        """How ``now`` (a plan as the lock records it) differs from the locked plan of its model type.

        A model type the lock has no plan for (``hfpatch lock`` plans the model types the packs
        declare or claim without a config; fused-dense applies to hundreds more) passes when
        the installed transformers is the locked version: the packs are the locked ones, file
        for file (``check_packs`` runs first), so what they decide now is what they decided
        when the lock was written.  Under another transformers it differs when the packs
        replace, convert or install anything in it.
        """
        locked = self.plans.get(now.model_type)
        if locked is None and now.foreign:
            # what another library replaced is no pack's decision: the lock holds it only where it has a plan
            where = f"model type {now.model_type or '?'!r} has no plan in the lock"
            return [f"{where}, and {_foreign_phrase(now.foreign, ())}"]
        if locked is None:
            if not now.claims and not now.converters and not now.steps:
                return []
            installed = _transformers_version()
            if installed == self.transformers:
                # the packs were checked unchanged (check_packs, before any plan), and transformers is
                # the locked one: what they decide now for this model type is what they decided when
                # the lock was written, had it been planned then (a fleet lock holds every model its
                # packs apply to, fused-dense's ~200 model types, without planning each one)
                return []
            what = ", ".join(
                [
                    *now.claims,
                    *(f"conversions for {key!r}" for key in now.converters),
                    *(f"step {s}" for s in now.steps),
                ]
            )
            return [
                f"model type {now.model_type or '?'!r} has no plan in the lock, the packs would apply {what}, and "
                f"transformers is {installed} (locked: {self.transformers}), with which the locked packs may decide "
                "otherwise than they did"
            ]
        if locked.decision == now.decision:
            return []
        return locked.differences(now)

    def error(self, changes: Iterable[str], *, model_types: Iterable[str] = ()) -> LockError:
        """The ``LockError`` for ``changes``, with how to fix it."""
        changes = tuple(changes)
        missing = [f"--model-type {t}" for t in model_types if t and t not in self.plans]
        again = f"hfpatch lock -o {self.path}" + "".join(f" {option}" for option in missing)
        selection = f"{PACKS_ENV}={self.selection!r}"
        foreign = (
            " Classes replaced outside hfpatch (another library's patch, Liger-Kernel's or a KernelConfig's) are "
            "locked as found where the lock was written, and `hfpatch lock` run as a command finds none: apply that "
            "library's patch after loading, or write the lock in the process that applies it "
            "(`hfpatch_core.cli.main(['--no-cache', 'lock', ...])` after the patch)."
            if any("replaced outside hfpatch" in change for change in changes)
            else ""
        )
        return LockError(
            f"the packs or plan of this load differ from the lock {self.path!r}: "
            + "; ".join(changes)
            + f". If the change is meant, write the lock again (`{again}`, with {selection} as it was written) and "
            "ship it; otherwise restore the locked environment (pip install the locked versions, uninstall or "
            f"leave out with {PACKS_ENV} the packs not locked). `hfpatch lock --check {self.path}` lists every "
            "difference." + foreign,
            lock=self.path,
            changes=changes,
        )

    def check_packs(self, selection: Selection) -> None:
        """Raise ``LockError`` when the packs ``selection`` runs differ from the locked ones."""
        changes = self.pack_changes(selection)
        if changes:
            raise self.error(changes)

    def check_plan(self, plan: Plan) -> None:
        """Raise ``LockError`` when ``plan`` differs from the locked plan of its model type."""
        changes = self.plan_changes(plan)
        if changes:
            model_type = plan.context.model_type if plan.context is not None else None
            raise self.error(changes, model_types=[model_type or ""])


@functools.cache
def _transformers_version() -> str:
    """The installed transformers version (its metadata, read once: a process does not change it)."""
    return installed_transformers_version()


def read_lock(path: str | os.PathLike[str]) -> Lock:
    """``Lock.read``: the lock file at ``path``."""
    return Lock.read(path)
