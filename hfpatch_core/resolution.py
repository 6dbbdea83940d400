"""Deciding, from the gathered claims alone, which replacement wins each target.

``resolve`` is a pure function: the same claims give the same plan whatever order
the packs were discovered in.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from .context import LoadContext
from .errors import PatchConflictError
from .plan import Claim, Lost, Plan
from .settings import PACKS_ENV

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


def _rank(claim: Claim) -> tuple[int, int, str, int]:
    return (-claim.priority, -int(claim.patch.overwrite), claim.pack, claim.index)


def _conflict(first: Claim, second: Claim) -> PatchConflictError:
    target = first.target
    if first.pack == second.pack:
        return PatchConflictError(
            f"pack {first.pack!r} claims {target!r} twice ({first.patch.replacement_name} and "
            f"{second.patch.replacement_name}) with the same priority; return one patch per target, "
            "or give one of them a higher priority."
        )
    both = "both set overwrite=True" if first.patch.overwrite else "neither sets overwrite=True"
    return PatchConflictError(
        f"packs {first.pack!r} and {second.pack!r} both replace {target!r} with priority {first.priority} "
        f"({first.pack}: {first.patch.replacement_name}; {second.pack}: {second.patch.replacement_name}) and {both}. "
        f"Choose a winner: {PACKS_ENV}=all,{first.pack}@+1 raises {first.pack!r}, "
        f"{PACKS_ENV}=all,-{second.pack} disables {second.pack!r}, or give one patch a higher priority."
    )


def _winner_of(claims: Sequence[Claim], lost: list[Lost]) -> Claim:
    ranked = sorted(claims, key=_rank)
    winner = ranked[0]
    for other in ranked[1:]:
        if other.patch.replacement is winner.patch.replacement and other.pack != winner.pack:
            lost.append(Lost(other, f"same replacement as {winner.describe()}", winner))
            continue
        if (other.priority, other.patch.overwrite) == (winner.priority, winner.patch.overwrite):
            raise _conflict(winner, other)
        if other.priority < winner.priority:
            reason = f"priority {other.priority} < {winner.priority} of {winner.describe()}"
        else:
            reason = f"same priority; {winner.describe()} sets overwrite=True"
        lost.append(Lost(other, reason, winner))
    return winner


def resolve(
    claims: Iterable[Claim],
    *,
    context: LoadContext | None = None,
    registered: Mapping[str, type] | None = None,
    overridable: Iterable[str] = (),
    class_names: Iterable[str] = (),
    packs: Iterable[tuple[str, str]] = (),
) -> Plan:
    """Resolve claims to a ``Plan``.

    Args:
        claims: every claim gathered for the load.
        context: the load, recorded on the plan.
        registered: what transformers' patch registry holds before the plan is
            registered (user code's direct registrations among it).
        overridable: keys of ``registered`` that hfpatch itself registered for an
            enclosing load; a claim may replace them without ``overwrite``.
        class_names: the module classes the plan will meet (the model's modeling
            module, or the classes of a model built on the meta device): used to
            report which class each claim replaces and which claims it shadows.
        packs: ``(name, version)`` of the packs that took part, for the fingerprint.

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
    for name in sorted(set(class_names)):
        chosen = find_replacement(name, effective)
        if isinstance(chosen, Claim):
            replaced[name] = chosen
        for claim in winners:
            if claim is chosen or not matches(claim.target, name):
                continue
            if isinstance(chosen, Claim):
                how = "an exact name" if chosen.target == name else "a pattern registered before it"
                reason = f"{name} is replaced by {chosen.describe()}, {how}"
                lost.append(Lost(claim, reason, chosen, class_name=name))
            else:
                reason = f"{name} is replaced by a mapping registered directly with register_patch_mapping"
                lost.append(Lost(claim, reason, None, class_name=name))

    return Plan(
        context=context,
        packs=tuple(sorted(set(packs))),
        entries=tuple(winners),
        lost=tuple(lost),
        replaced=replaced,
    )


def matches(target: str, class_name: str) -> bool:
    """Whether a registry key ``target`` matches ``class_name`` (exactly, or by ``re.search``)."""
    if target == class_name:
        return True
    compiled = _compiled(target)
    return compiled is not None and compiled.search(class_name) is not None
