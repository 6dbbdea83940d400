"""Deciding, from the gathered claims alone, which patch and which converter wins.

One ranking rule for both kinds of claim: the higher priority wins; on a tie the claim
with ``overwrite=True``; still tied is a conflict naming both packs and how to choose.
Every function here is pure: the same claims give the same decision whatever order the
packs were discovered in.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from ..context import LoadContext
from ..errors import ConverterConflictError, PatchConflictError
from ..plan import Claim, ConverterClaim, Lost, Plan, StepClaim
from ..settings import PACKS_ENV

T = TypeVar("T")


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern[str] | None:
    try:
        return re.compile(pattern)
    except re.error:
        return None


def find_replacement(class_name: str, mapping: Mapping[str, T]) -> T | None:
    """The value ``mapping`` assigns to ``class_name`` under transformers' registry rule.

    An exact key wins; otherwise the first key, in insertion order, that matches
    ``class_name`` with ``re.search``.  (The same rule as
    ``transformers.monkey_patching._find_replacement_class``.)
    """
    if class_name in mapping:
        return mapping[class_name]
    for pattern, value in mapping.items():
        compiled = _compiled(pattern)
        if compiled is not None and compiled.search(class_name):
            return value
    return None


def rank(claim: Claim | ConverterClaim | StepClaim) -> tuple[int, int, str, int]:
    """The sort key of the ranking rule: priority, then ``overwrite``, then pack name and position."""
    overwrite = claim.patch.overwrite if isinstance(claim, Claim) else claim.overwrite
    return (-claim.priority, -int(overwrite), claim.pack, claim.index)


Ranked = Claim | ConverterClaim | StepClaim


def _tied(first: Ranked, second: Ranked) -> bool:
    return rank(first)[:2] == rank(second)[:2]


def _beaten_because(loser: Ranked, winner: Ranked) -> str:
    if loser.priority < winner.priority:
        return f"priority {loser.priority} < {winner.priority} of {winner.describe()}"
    return f"same priority; {winner.describe()} sets overwrite=True"


def _choose_between(packs: Sequence[str]) -> str:
    """The generic remedy, for a conflict resolved without a selection to check (``planning`` replaces it)."""
    first, *others = packs
    return (
        f"Choose a winner: raise one pack ({PACKS_ENV}=all,{first}@+1), disable the others "
        f"({PACKS_ENV}=all,{','.join(f'-{other}' for other in others)}), or give one of them a higher priority."
    )


def _names(packs: Sequence[str]) -> str:
    quoted = [repr(pack) for pack in packs]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _claimants(claims: Iterable[Claim]) -> str:
    """Every claim of one target, best first: pack, replacement, priority and overwrite."""
    return "; ".join(
        f"{claim.pack}: {claim.patch.replacement_name}, priority {claim.priority}"
        + (", overwrite=True" if claim.patch.overwrite else "")
        for claim in sorted(claims, key=rank)
    )


def _conflict(tied: Sequence[Claim], claims: Sequence[Claim]) -> PatchConflictError:
    first, second = tied[0], tied[1]
    target = first.target
    packs = tuple(sorted({claim.pack for claim in tied}))
    if first.pack == second.pack:
        return PatchConflictError(
            f"pack {first.pack!r} claims {target!r} twice ({first.patch.replacement_name} and "
            f"{second.patch.replacement_name}) with the same priority; return one patch per target, "
            "or give one of them a higher priority.",
            packs=packs,
            target=target,
        )
    many = len(tied) > 2
    both = {(True, True): "all set", (True, False): "both set", (False, True): "none sets"}.get(
        (first.patch.overwrite, many), "neither sets"
    )
    every = f"every claimant of {target!r}: {_claimants(claims)}"
    return PatchConflictError(
        f"packs {_names([claim.pack for claim in tied])} {'all' if many else 'both'} replace {target!r} "
        f"with priority {first.priority} and {both} overwrite=True ({every}).",
        _choose_between(packs),
        packs=packs,
        target=target,
    )


def tied_claims(claims: Sequence[Claim]) -> list[Claim]:
    """The claims of one target that tie with its best (the best first): a conflict when two or more.

    A claim of another pack with the very same replacement class as the best does not tie
    (both packs want the same thing).
    """
    ranked = sorted(claims, key=rank)
    winner = ranked[0]
    tied = [winner]
    for other in ranked[1:]:
        if other.patch.replacement is winner.patch.replacement and other.pack != winner.pack:
            continue
        if _tied(other, winner):
            tied.append(other)
    return tied


def patch_conflicts(claims: Iterable[Claim]) -> list[PatchConflictError]:
    """Every target the claims tie on, one error each (by target): what ``resolve_patches`` raises first."""
    by_target: dict[str, list[Claim]] = {}
    for claim in claims:
        by_target.setdefault(claim.target, []).append(claim)
    found = []
    for target in sorted(by_target):
        tied = tied_claims(by_target[target])
        if len(tied) > 1:
            found.append(_conflict(tied, by_target[target]))
    return found


def _winner_of(claims: Sequence[Claim], lost: list[Lost]) -> Claim:
    tied = tied_claims(claims)
    if len(tied) > 1:
        raise _conflict(tied, claims)
    ranked = sorted(claims, key=rank)
    winner = ranked[0]
    for other in ranked[1:]:
        if other.patch.replacement is winner.patch.replacement and other.pack != winner.pack:
            lost.append(Lost(other, f"same replacement as {winner.describe()}", winner))
            continue
        lost.append(Lost(other, _beaten_because(other, winner), winner))
    return winner


@dataclasses.dataclass(frozen=True)
class PatchDecision:
    """Which patch claims won (in registration order), which lost, and what each class gets."""

    entries: tuple[Claim, ...]
    lost: tuple[Lost, ...]
    replaced: Mapping[str, Claim]

    def applied(self, *, classes_known: bool) -> tuple[Claim, ...]:
        """The claims that take effect: those replacing a class of the model, when its classes are known."""
        return tuple(self.replaced.values()) if classes_known else self.entries


@functools.lru_cache(maxsize=256)  # the same model's classes against the same keys, load after load
def _class_table(
    keys: tuple[str, ...], class_names: tuple[str, ...]
) -> tuple[tuple[str, str | None, frozenset[str]], ...]:
    """For each class name: the key of ``keys`` that ``find_replacement`` picks for it, and every key matching it."""
    by_key = {key: key for key in keys}
    return tuple(
        (name, find_replacement(name, by_key), frozenset(key for key in keys if matches(key, name)))
        for name in class_names
    )


def resolve_patches(
    claims: Iterable[Claim],
    *,
    registered: Mapping[str, type] | None = None,
    overridable: Iterable[str] = (),
    class_names: Iterable[str] = (),
) -> PatchDecision:
    """Decide every target the claims name.

    Args:
        claims: every claim gathered for the load.
        registered: what transformers' patch registry holds before the plan is
            registered (user code's direct registrations among it).
        overridable: keys of ``registered`` that hfpatch itself registered for an
            enclosing load; a claim may replace them without ``overwrite``.
        class_names: the module classes the plan will meet (the model's modeling
            module, or the classes of a model built on the meta device): used to
            report which class each claim replaces and which claims it shadows.

    Raises:
        PatchConflictError: two claims on one target tie on priority and overwrite.
    """
    registered = dict(registered or {})
    overridable = frozenset(overridable)
    by_target: dict[str, list[Claim]] = {}
    for claim in claims:
        by_target.setdefault(claim.target, []).append(claim)

    lost: list[Lost] = []
    winners: list[Claim] = []
    for target in sorted(by_target):
        winner = _winner_of(by_target[target], lost)
        if target in registered and target not in overridable and not winner.patch.overwrite:
            existing = registered[target]
            lost.append(
                Lost(
                    winner,
                    f"{target!r} is already registered with register_patch_mapping "
                    f"({existing.__module__}.{existing.__qualname__}); the patch needs overwrite=True to replace it",
                )
            )
            continue
        winners.append(winner)
    winners.sort(key=lambda claim: (-claim.priority, claim.pack, claim.index))

    effective: dict[str, object] = dict(registered)
    for claim in winners:
        effective[claim.target] = claim
    replaced: dict[str, Claim] = {}
    for name, key, matching in _class_table(tuple(effective), tuple(sorted(set(class_names)))):
        chosen = effective[key] if key is not None else None
        if isinstance(chosen, Claim):
            replaced[name] = chosen
        for claim in winners:
            if claim is chosen or claim.target not in matching:
                continue
            if isinstance(chosen, Claim):
                how = "an exact name" if chosen.target == name else "a pattern registered before it"
                reason = f"{name} is replaced by {chosen.describe()}, {how}"
                lost.append(Lost(claim, reason, chosen, class_name=name))
            else:
                reason = f"{name} is replaced by a mapping registered directly with register_patch_mapping"
                lost.append(Lost(claim, reason, None, class_name=name))
    return PatchDecision(tuple(winners), tuple(lost), replaced)


def resolve(
    claims: Iterable[Claim],
    *,
    context: LoadContext | None = None,
    registered: Mapping[str, type] | None = None,
    overridable: Iterable[str] = (),
    class_names: Iterable[str] = (),
    packs: Iterable[tuple[str, str]] = (),
) -> Plan:
    """The ``Plan`` of patch claims alone (no converters): ``resolve_patches`` as a plan.

    ``context`` and ``packs`` (``(name, version)`` of the packs that took part, for the
    fingerprint) are recorded on the plan; the other arguments are ``resolve_patches``'.

    Raises:
        PatchConflictError: two claims on one target tie on priority and overwrite.
    """
    decision = resolve_patches(claims, registered=registered, overridable=overridable, class_names=class_names)
    return Plan(
        context=context,
        packs=tuple(sorted(set(packs))),
        entries=decision.entries,
        lost=decision.lost,
        replaced=decision.replaced,
    )


# --- converters -------------------------------------------------------------------------


def _converter_conflict(first: ConverterClaim, second: ConverterClaim, patterns: list[str]) -> ConverterConflictError:
    packs = tuple(sorted({first.pack, second.pack}))
    return ConverterConflictError(
        f"packs {first.pack!r} and {second.pack!r} both convert checkpoint tensors {patterns} for {second.key!r} "
        f"with priority {first.priority} and {'both' if first.overwrite else 'neither'} overwrite=True.",
        _choose_between(packs),
        packs=packs,
        target=second.key,
    )


@dataclasses.dataclass(frozen=True)
class ConverterDecision:
    """Which converter claims won (highest rank first) and which lost, with the reason."""

    winners: tuple[ConverterClaim, ...]
    lost: tuple[tuple[ConverterClaim, str], ...]


def resolve_converters(
    claims: Sequence[ConverterClaim],
    *,
    overlap: Callable[[ConverterClaim, ConverterClaim], list[str]],
) -> ConverterDecision:
    """Decide between converters of different packs that convert the same checkpoint tensors.

    Args:
        claims: the converter claims that may apply.
        overlap: the source patterns two claims both convert, within one lookup scope
            (``composition.ConversionScope.overlap``); empty when they do not compete.

    Raises:
        ConverterConflictError: two packs convert the same tensors with the same rank.
    """
    lost: list[tuple[ConverterClaim, str]] = []
    winners: list[ConverterClaim] = []
    for claim in sorted(claims, key=rank):
        for winner in winners:
            if winner.pack == claim.pack:
                continue
            patterns = overlap(winner, claim)
            if not patterns:
                continue
            if _tied(winner, claim):
                raise _converter_conflict(winner, claim, patterns)
            lost.append((claim, f"converts the same tensors {patterns}: {_beaten_because(claim, winner)}"))
            break
        else:
            winners.append(claim)
    return ConverterDecision(tuple(winners), tuple(lost))


def unused_converters(
    converters: Sequence[ConverterClaim], claims: Iterable[Claim], decision: PatchDecision, *, classes_known: bool
) -> dict[int, str]:
    """Which gathered converters must not apply because their patches are not applied.

    A patch is applied when it replaces a class of the model (or, when the model's
    classes are not known, when it won its target).  A converter with
    ``patch_targets`` applies while one of the pack's patches on those targets is
    applied; one without, while any patch of its pack is (a pack without patches keeps
    its converters).  A converter would otherwise reshape checkpoint tensors for modules
    that are not in the model, and the load would fail or load them under wrong names.
    (Gathering already refused a converter naming a patch its pack did not return.)

    Returns:
        The reason each unused converter (by ``index``) does not apply.
    """
    applied = decision.applied(classes_known=classes_known)
    in_effect = {(claim.pack, claim.target) for claim in applied}
    applied_packs = {claim.pack for claim in applied}
    with_patches = {claim.pack for claim in claims}
    unused: dict[int, str] = {}
    for converter in converters:
        pack, targets = converter.pack, converter.converter.patch_targets
        if not targets:
            if pack in with_patches and pack not in applied_packs:
                unused[converter.index] = f"no patch of pack {pack!r} is applied"
        elif not any((pack, target) in in_effect for target in targets):
            unused[converter.index] = "; ".join(_not_applied(pack, target, decision) for target in targets)
    return unused


def _not_applied(pack: str, target: str, decision: PatchDecision) -> str:
    for lost in decision.lost:
        if lost.claim.pack == pack and lost.claim.target == target:
            where = f" on {lost.class_name}" if lost.class_name else ""
            return f"its patch {target!r} is not applied{where}: {lost.reason}"
    return f"its patch {target!r} replaces no class of this model"


def matches(target: str, class_name: str) -> bool:
    """Whether a registry key ``target`` matches ``class_name`` (exactly, or by ``re.search``)."""
    if target == class_name:
        return True
    compiled = _compiled(target)
    return compiled is not None and compiled.search(class_name) is not None


# --- model steps ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepDecision:
    """Which step claims won (one per target, in installation order) and which lost, with the reason."""

    winners: tuple[StepClaim, ...]
    lost: tuple[tuple[StepClaim, str], ...]


def resolve_steps(claims: Iterable[StepClaim]) -> StepDecision:
    """Decide every step target the claims name, by the ranking rule of patches.

    The winners are installed highest rank first (a step of higher priority changes the
    model before one of lower priority on another target).

    Raises:
        PatchConflictError: two packs offer a step for one target with the same priority and
            the same ``overwrite``, or one pack offers two steps for one target.
    """
    by_target: dict[str, list[StepClaim]] = {}
    for claim in claims:
        by_target.setdefault(claim.target, []).append(claim)
    winners: list[StepClaim] = []
    lost: list[tuple[StepClaim, str]] = []
    for target in sorted(by_target):
        ranked = sorted(by_target[target], key=rank)
        winner = ranked[0]
        for other in ranked[1:]:
            if _tied(other, winner):
                packs = tuple(sorted({winner.pack, other.pack}))
                if winner.pack == other.pack:
                    raise PatchConflictError(
                        f"pack {winner.pack!r} offers two model steps for {target!r} with the same priority; "
                        "return one step per target, or give one of them a higher priority.",
                        packs=packs,
                        target=target,
                    )
                raise PatchConflictError(
                    f"packs {winner.pack!r} and {other.pack!r} both offer a model step for {target!r} with priority "
                    f"{winner.priority} and {'both' if winner.overwrite else 'neither'} overwrite=True "
                    f"({winner.step.install_name}; {other.step.install_name}).",
                    _choose_between(packs),
                    packs=packs,
                    target=target,
                )
            lost.append((other, _beaten_because(other, winner)))
        winners.append(winner)
    winners.sort(key=rank)
    return StepDecision(tuple(winners), tuple(lost))
