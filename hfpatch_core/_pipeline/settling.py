"""A selection that settles a load's conflicts, found by resolving the load again with it.

When two packs tie, the conflict error names one ``HF_PATCH_PACKS`` value that settles
every conflict of the model type: candidate selections (one claimant of a tied target
raised by 1, or a pack disabled, then again on the next conflict) are tried in order of
fewest changes, each by deciding the load's gathered claims as the selection would give
them.  The claims a selection gives are the same hook results with the pack's offset
added (``gathering.PackSet.gather``), or without the disabled pack's: so the check is
the resolver's own decision, not a guess, and the hooks are not called again.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import ConflictError, ConverterConflictError, PatchConflictError
from ..settings import PACKS_ENV
from .gathering import Gathered
from .selection import SelectionSpec

#: The most candidate selections one search decides (each decision is cheap: no hook runs).
LIMIT = 256

Conflict = PatchConflictError | ConverterConflictError


@dataclasses.dataclass(frozen=True, order=True)
class Change:
    """A selection relative to the current one: packs raised (by how much) and packs disabled."""

    raised: tuple[tuple[str, int], ...] = ()
    excluded: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.raised) + len(self.excluded)

    def packs(self) -> set[str]:
        return {name for name, _ in self.raised} | set(self.excluded)

    def raise_(self, pack: str) -> Change:
        raised = dict(self.raised)
        raised[pack] = raised.get(pack, 0) + 1
        return Change(tuple(sorted(raised.items())), self.excluded)

    def exclude(self, pack: str) -> Change:
        raised = tuple(item for item in self.raised if item[0] != pack)
        return Change(raised, tuple(sorted({*self.excluded, pack})))

    def describe(self) -> str:
        parts = [f"raises {name!r} by {offset}" for name, offset in self.raised]
        parts += [f"disables {name!r}" for name in self.excluded]
        return ", ".join(parts)


def adjusted(gathered: Gathered, change: Change) -> Gathered:
    """What gathering gives under the selection ``change`` describes: the same claims, raised or left out."""
    if not change.size:
        return gathered
    raised, excluded = dict(change.raised), set(change.excluded)
    return dataclasses.replace(
        gathered,
        claims=tuple(
            dataclasses.replace(claim, priority=claim.priority + raised.get(claim.pack, 0))
            for claim in gathered.claims
            if claim.pack not in excluded
        ),
        converters=tuple(
            dataclasses.replace(claim, priority=claim.priority + raised.get(claim.pack, 0))
            for claim in gathered.converters
            if claim.pack not in excluded
        ),
        steps=tuple(
            dataclasses.replace(claim, priority=claim.priority + raised.get(claim.pack, 0))
            for claim in gathered.steps
            if claim.pack not in excluded
        ),
        packs=tuple(pack for pack in gathered.packs if pack[0] not in excluded),
    )


@dataclasses.dataclass(frozen=True)
class Problem:
    """One model type's gathered claims, and how its load decides them.

    Attributes:
        model_type: the model type (for messages).
        gathered: what the packs offered for the load under the current selection.
        decide: the load's resolution of a ``Gathered``; raises the first conflict.
    """

    model_type: str | None
    gathered: Gathered
    decide: Callable[[Gathered], Any]


def first_conflict(problems: Sequence[Problem], change: Change) -> Conflict | None:
    """The first conflict any of ``problems`` raises under ``change``; ``None`` when every one resolves."""
    for problem in problems:
        try:
            problem.decide(adjusted(problem.gathered, change))
        except (PatchConflictError, ConverterConflictError) as exc:
            return exc
    return None


def settle(problems: Sequence[Problem], *, limit: int = LIMIT) -> tuple[Change | None, int]:
    """The change with fewest steps under which every problem resolves, and how many were checked.

    Each conflict met branches into raising one of its tied packs by 1 and disabling one.
    Among changes of one size (packs named), raising comes before disabling (every pack
    keeps running), a smaller raise before a larger, then the change touching fewest of
    the problems' claims: raising a pack raises all its claims, on every model type, and
    fewer claims moved means fewer new ties elsewhere.
    """
    footprint = Counter(
        pack
        for problem in problems
        for pack in [
            *(claim.pack for claim in problem.gathered.claims),
            *(c.pack for c in problem.gathered.converters),
            *(step.pack for step in problem.gathered.steps),
        ]
    )

    def key(change: Change) -> tuple[int, int, int, int, Change]:
        moved = sum(footprint[pack] for pack in change.packs())
        return (change.size, len(change.excluded), sum(offset for _, offset in change.raised), moved, change)

    start = Change()
    queue = [(key(start), start)]
    seen = {start}
    checked = 0
    while queue and checked < limit:
        _, change = heapq.heappop(queue)
        conflict = first_conflict(problems, change)
        checked += 1
        if conflict is None:
            return change, checked
        for pack in conflict.packs:
            for child in (change.raise_(pack), change.exclude(pack)):
                if child not in seen:
                    seen.add(child)
                    heapq.heappush(queue, (key(child), child))
    return None, checked


def _item(name: str, offset: int) -> str:
    return f"{name}@{offset:+d}" if offset else name


def selection_text(
    change: Change,
    *,
    spec: SelectionSpec | None,
    enabled: Iterable[str],
    offsets: Mapping[str, int] | None = None,
) -> str:
    """The ``HF_PATCH_PACKS`` value of the current selection with ``change`` made to it.

    ``spec``: the current selection (``None`` when unknown: then the value lists the
    ``enabled`` packs with their ``offsets``).
    """
    raised, excluded = dict(change.raised), set(change.excluded)
    if spec is None or spec.mode != "all":
        names = list(spec.included) if spec is not None else sorted(enabled)
        current = dict(spec.priority_offsets if spec is not None else offsets or {})
        items = [_item(name, current.get(name, 0) + raised.get(name, 0)) for name in names if name not in excluded]
        return ",".join(items) or "none"
    current = dict(spec.priority_offsets)
    for name, offset in raised.items():
        current[name] = current.get(name, 0) + offset
    disabled = dict.fromkeys([*spec.excluded, *sorted(excluded)])
    items = ["all", *(_item(name, offset) for name, offset in current.items() if offset and name not in disabled)]
    return ",".join([*items, *(f"-{name}" for name in disabled)])


def settled(
    conflict: ConflictError,
    problems: Sequence[Problem],
    *,
    spec: SelectionSpec | None,
    enabled: Iterable[str],
    offsets: Mapping[str, int] | None = None,
    limit: int = LIMIT,
) -> ConflictError:
    """``conflict`` with the remedy the search finds for ``problems`` (checked), or says it found none."""
    model_types = ", ".join(dict.fromkeys(str(problem.model_type) for problem in problems))
    change, checked = settle(problems, limit=limit)
    if change is None:
        remedy = (
            f"No selection settles every conflict of {model_types}: the resolver checked {checked} (raising one "
            f"claimant of each tied target by 1, disabling packs). Choose the packs to run with {PACKS_ENV}=a,b."
        )
        return conflict.with_remedy(remedy, None)
    text = selection_text(change, spec=spec, enabled=enabled, offsets=offsets)
    remedy = (
        f"{PACKS_ENV}={text} ({change.describe()}) settles every conflict of {model_types}: the resolver "
        "decided this load's claims with it and found no tie. `hfpatch list` shows the conflicts of every "
        "model type the packs target."
    )
    return conflict.with_remedy(remedy, text)
