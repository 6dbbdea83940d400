"""What planning decides for one load: which pack's class replaces which target, which
conversion lists are registered, and what lost.  Values only: the steps that compute
them are ``resolution`` (who wins) and ``composition`` (the lists transformers gets).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, Literal

from .context import LoadContext
from .conversion import Converter, describe_transform, source_patterns_of
from .patches import ModelStep, Patch

#: The attribute of a loaded model that holds its ``Plan``.
PLAN_ATTRIBUTE = "hfpatch_plan"

#: The origin recorded for transforms that come from transformers' own lists.
BUILTIN = "transformers"


@dataclasses.dataclass(frozen=True)
class Claim:
    """A patch as one pack offered it for one load.

    Attributes:
        pack: the pack's name.
        version: the pack's distribution version.
        patch: the patch itself.
        priority: the patch's priority plus the pack's offset from ``HF_PATCH_PACKS``.
        index: the patch's position in what the pack returned (keeps a pack's own order).
    """

    pack: str
    version: str
    patch: Patch
    priority: int
    index: int = 0

    @property
    def target(self) -> str:
        return self.patch.target

    @property
    def label(self) -> str:
        return f"{self.pack}=={self.version}"

    def describe(self) -> str:
        return f"pack {self.pack!r} ({self.patch.target!r} -> {self.patch.replacement.__qualname__})"


@dataclasses.dataclass(frozen=True)
class ConverterClaim:
    """A converter as one pack offered it for one load (ranked like a ``Claim``).

    Attributes:
        pack: the pack's name.
        version: the pack's distribution version.
        converter: the converter itself.
        priority: the converter's priority plus the pack's offset from ``HF_PATCH_PACKS``.
        index: the converter's position among everything gathered for the load.
    """

    pack: str
    version: str
    converter: Converter
    priority: int
    index: int = 0

    @property
    def key(self) -> str:
        return self.converter.key

    @property
    def overwrite(self) -> bool:
        return self.converter.overwrite

    def describe(self) -> str:
        patterns = sorted({p for t in self.converter.transforms for p in source_patterns_of(t)})
        return f"pack {self.pack!r} (converter for {self.key!r}: {patterns})"


@dataclasses.dataclass(frozen=True)
class StepClaim:
    """A model step as one pack offered it for one load (ranked like a ``Claim``).

    Attributes:
        pack: the pack's name.
        version: the pack's distribution version.
        step: the step itself.
        priority: the step's priority plus the pack's offset from ``HF_PATCH_PACKS``.
        index: the step's position in what the pack returned.
    """

    pack: str
    version: str
    step: ModelStep
    priority: int
    index: int = 0

    @property
    def target(self) -> str:
        return self.step.target

    @property
    def overwrite(self) -> bool:
        return self.step.overwrite

    @property
    def label(self) -> str:
        return f"{self.pack}=={self.version}"

    def describe(self) -> str:
        return f"pack {self.pack!r} (model step {self.step.target!r} -> {self.step.install_name})"


@dataclasses.dataclass(frozen=True)
class ComposedTransform:
    """One entry of a composed list, and where it came from (a pack name or ``BUILTIN``)."""

    transform: Any
    origin: str

    def describe(self) -> str:
        return f"{describe_transform(self.transform)} [{self.origin}]"


@dataclasses.dataclass(frozen=True)
class Removal:
    """A built-in transform left out because a pack's converter replaces it."""

    key: str
    transform: Any
    pack: str
    pattern: str


@dataclasses.dataclass(frozen=True)
class Conversions:
    """The conversion lists registered for one load (empty, and false, when no pack converts).

    Attributes:
        lists: for each key registered, the composed list in lookup order.
        removed: built-in transforms that converters replaced.
        lost: converter claims that do not apply (another pack won, or their patches are
            not applied), with the reason.
        unmatched: ``(claim, pattern)`` for ``replaces`` entries that matched no built-in transform.
        claims: every winning claim.
    """

    lists: Mapping[str, tuple[ComposedTransform, ...]] = dataclasses.field(default_factory=dict)
    removed: tuple[Removal, ...] = ()
    lost: tuple[tuple[ConverterClaim, str], ...] = ()
    unmatched: tuple[tuple[ConverterClaim, str], ...] = ()
    claims: tuple[ConverterClaim, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.lists)

    def transforms(self, key: str) -> list[Any]:
        """The list to register for ``key``."""
        return [entry.transform for entry in self.lists.get(key, ())]


@dataclasses.dataclass(frozen=True)
class Lost:
    """A claim that is not used, and what beat it.

    Attributes:
        claim: the claim that is not applied.
        reason: why, in words.
        winner: the claim that won the same target, when another pack's claim did.
        class_name: for a shadowed claim, the class it matched but does not replace.
    """

    claim: Claim
    reason: str
    winner: Claim | None = None
    class_name: str | None = None


@dataclasses.dataclass(frozen=True)
class Refused:
    """A class a pack found to patch and refused (a ``Refusal`` it returned), for this load.

    Attributes:
        pack: the pack's name.
        version: the pack's version.
        target: the class name it refused.
        reason: why, in the pack's words.
    """

    pack: str
    version: str
    target: str
    reason: str

    def describe(self) -> str:
        return f"{self.target}: refused by {self.pack!r} ({self.version}): {self.reason}"


@dataclasses.dataclass(frozen=True)
class Foreign:
    """A class of the model that code outside hfpatch replaced, as a load found it.

    Attributes:
        name: the class name (``LlamaMLP``), or the registry key for a registry entry.
        replacement: what is in its place, ``module.qualname`` (``"removed"`` for a
            registry entry taken out during the load).
        source: ``"module"``: the modeling module's attribute was reassigned (Liger-Kernel's
            way); ``"registry"``: an entry of transformers' patch registry that no pack
            made; ``"changed during the load"``: code run by the load cleared or
            overwrote an entry a pack registered for it.
        module: the modeling module, for ``"module"``.
        overridden_by: the pack whose claim replaces the class for this load instead; the
            foreign class is put back when the load ends.
        displaced: the selected packs (comma-separated) that do not replace the class because
            of it: a claim that lost to the foreign registry entry, or a class the pack found
            and refused (``Refusal``); the foreign class is used for the load.
    """

    name: str
    replacement: str
    source: Literal["module", "registry", "changed during the load"]
    module: str = ""
    overridden_by: str | None = None
    displaced: str | None = None

    @property
    def situation(self) -> str:
        """What was found, in words."""
        return {
            "module": f"{self.module}.{self.name} is {self.replacement} (set outside hfpatch)",
            "registry": f"transformers' patch registry maps {self.name!r} to {self.replacement} (no pack made it)",
            "changed during the load": f"transformers' patch registry entry {self.name!r} of this load "
            + ("was removed" if self.replacement == "removed" else f"became {self.replacement}")
            + " while the model was built (code outside hfpatch changed it)",
        }[self.source]

    def describe(self) -> str:
        overridden = f"; pack {self.overridden_by!r} replaces it for this load" if self.overridden_by else ""
        displaced = f"; it is used instead of pack {self.displaced!r}'s class" if self.displaced else ""
        return self.situation + overridden + displaced

    @property
    def short(self) -> str:
        """The replacement as the summary line shows it: ``LlamaMLP <- lib.LibMLP [module]``."""
        overridden = f", overridden by {self.overridden_by}" if self.overridden_by else ""
        return f"{self.name} <- {self.replacement} [{self.source}{overridden}]"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The outcome of resolving every claim gathered for one load.

    Attributes:
        context: the load the plan is for.
        packs: ``(name, version)`` of each pack that took part, sorted by name.
        entries: the winning claims, in the order they are registered (priority first),
            so that the registry's first regex match honours priority.
        lost: claims beaten on the same target (priority, overwrite, a direct
            registration) or shadowed on a class by a better match.
        replaced: for each class name the plan was resolved against, the claim that
            replaces it.
        conversions: the conversion lists registered for the load.
        nested: the plans of sub-models loaded inside this load.
        refused: the classes packs found to patch and refused, each with the reason
            (``Refusal``); nothing is replaced for them.  A model step refused (by its pack's
            hook, or by its ``install`` on the loaded model) is here under the step's target.
        foreign: the model's classes replaced outside hfpatch (``Foreign``).
        steps: the winning model steps (``ModelStep``), one per target, in the order they
            are installed on the loaded model (priority first).
        lost_steps: step claims beaten on the same target, with the reason.
    """

    context: LoadContext | None
    packs: tuple[tuple[str, str], ...] = ()
    entries: tuple[Claim, ...] = ()
    lost: tuple[Lost, ...] = ()
    replaced: Mapping[str, Claim] = dataclasses.field(default_factory=dict)
    conversions: Conversions = dataclasses.field(default_factory=Conversions)
    nested: tuple[Plan, ...] = ()
    refused: tuple[Refused, ...] = ()
    foreign: tuple[Foreign, ...] = ()
    steps: tuple[StepClaim, ...] = ()
    lost_steps: tuple[tuple[StepClaim, str], ...] = ()

    def all_plans(self) -> tuple[Plan, ...]:
        """This plan and the plans of the sub-models loaded inside it."""
        return (self, *(inner for plan in self.nested for inner in plan.all_plans()))

    @property
    def touches_weights(self) -> bool:
        """Whether any plan in this load replaced a class or converts weights."""
        return any(plan.entries or plan.conversions for plan in self.all_plans())

    @property
    def installed_steps(self) -> tuple[StepClaim, ...]:
        """The winning steps the loaded model holds: those its own ``install`` did not refuse
        (a refusal at install time is among ``refused``, under the step's target and pack)."""
        refused = {(refusal.pack, refusal.target) for refusal in self.refused}
        return tuple(claim for claim in self.steps if (claim.pack, claim.target) not in refused)

    @property
    def mapping(self) -> dict[str, type]:
        """The winners as a ``register_patch_mapping`` mapping, in registration order."""
        return {claim.target: claim.patch.replacement for claim in self.entries}

    @property
    def shadowed(self) -> tuple[Lost, ...]:
        """The lost claims that matched a class another claim replaces."""
        return tuple(lost for lost in self.lost if lost.class_name is not None)

    @property
    def fingerprint(self) -> str:
        """A short hash of the active packs and the winning claims.

        Two processes (or ranks) with the same fingerprint selected the same pack
        versions, register the same replacements for this load and found the same classes
        replaced outside hfpatch (``foreign``: a rank that imported Liger-Kernel and one that
        did not run different models).
        """
        digest = hashlib.sha256()
        for name, version in self.packs:
            digest.update(f"pack {name}=={version}\n".encode())
        for claim in self.entries:
            line = f"claim {claim.target!r} {claim.patch.replacement_name} {claim.priority} {claim.patch.overwrite}"
            digest.update(f"{line}\n".encode())
        for key, entries in sorted(self.conversions.lists.items()):
            for entry in entries:
                digest.update(f"convert {key} {entry.origin} {describe_transform(entry.transform)}\n".encode())
        for step in self.steps:
            line = f"step {step.target!r} {step.step.install_name} {step.priority} {step.overwrite}"
            digest.update(f"{line}\n".encode())
        for found in self.foreign:
            digest.update(f"foreign {found.short}\n".encode())
        for inner in self.nested:
            where = inner.context.model_class_name if inner.context else "?"
            digest.update(f"nested {where} {inner.fingerprint}\n".encode())
        return digest.hexdigest()[:12]

    @property
    def packs_touching(self) -> dict[str, str]:
        """For each replacement class name, the pack whose claim put it there."""
        return {claim.patch.replacement.__name__: claim.pack for claim in self.entries}

    def summary(self) -> str:
        """One line for the load log."""
        where = self.context.model_class_name if self.context is not None else "model"
        converted = ""
        if self.conversions:
            converted = "; converters for " + ", ".join(sorted(self.conversions.lists))
        inner = "".join(
            f"; inside, {plan.summary().removeprefix('hfpatch: ').rsplit(' (plan', 1)[0]}"
            for plan in self.nested
            if plan.replaced or plan.conversions or plan.refused or plan.foreign
        )
        # only what replaced a class of the model: a registered target that matched none is no patch
        parts = ", ".join(
            f"{name} <- {claim.patch.replacement.__qualname__} [{claim.label}]"
            for name, claim in sorted(self.replaced.items())
        )
        steps = "".join(f"; step {claim.target} [{claim.label}]" for claim in self.installed_steps)
        # a refusal is why a pack that was asked for changed nothing: the log line says so
        refused = "".join(f"; {refusal.target} refused by {refusal.pack}: {refusal.reason}" for refusal in self.refused)
        # classes another library replaced: the model is not what the packs alone make of it
        foreign = "; outside hfpatch: " + ", ".join(found.short for found in self.foreign) if self.foreign else ""
        return (
            f"hfpatch: {where}: {parts or 'no patch applied'}{converted}{steps}{refused}{foreign}{inner} "
            f"(plan {self.fingerprint})"
        )


def plan_of(model: object) -> Plan | None:
    """The plan a model was loaded with, or ``None`` if hfpatch did not load it."""
    plan = getattr(model, PLAN_ATTRIBUTE, None)
    return plan if isinstance(plan, Plan) else None
