"""Composing the packs' converters with transformers' built-in conversion lists.

transformers keeps one list of weight transforms per model type or class name and a
registration replaces the whole list.  For one load, hfpatch computes each list the
packs touch: the winning converters' transforms (highest priority first, so that the
loader's first-matching converter honours priority), then transformers' built-in list
for that key minus the transforms a converter ``replaces``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from . import _compat
from .conversion import Converter, describe_transform, source_patterns_of
from .errors import ConverterConflictError
from .plan import Claim, Plan
from .settings import PACKS_ENV

#: The origin recorded for transforms that come from transformers' own lists.
BUILTIN = "transformers"


@dataclasses.dataclass(frozen=True)
class ConverterClaim:
    """A converter as one pack offered it for one load."""

    pack: str
    version: str
    converter: Converter
    priority: int
    index: int = 0

    @property
    def key(self) -> str:
        return self.converter.key

    def describe(self) -> str:
        patterns = sorted({p for t in self.converter.transforms for p in source_patterns_of(t)})
        return f"pack {self.pack!r} (converter for {self.key!r}: {patterns})"


@dataclasses.dataclass(frozen=True)
class ComposedTransform:
    """One entry of a composed list, and where it came from (a pack name or ``"transformers"``)."""

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
    """The conversion lists registered for one load.

    Attributes:
        lists: for each key registered, the composed list in lookup order.
        removed: built-in transforms that converters replaced.
        lost: converter claims that lost to another pack, with the reason.
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


def _example(pattern: str) -> str:
    return pattern.replace("*", "0").replace("\\", "").strip("^$")


def pattern_regex(pattern: str) -> re.Pattern[str] | None:
    """A transform's source or target pattern as a regular expression (``*`` stands for an index), or None."""
    try:
        return re.compile(pattern.replace("*", r"\d+"))
    except re.error:
        return None


def patterns_overlap(first: str, second: str) -> bool:
    """Whether two source patterns can match the same checkpoint key (a close test)."""
    if first == second:
        return True
    for pattern, other in ((first, second), (second, first)):
        compiled = pattern_regex(pattern)
        if compiled is not None and compiled.search(_example(other)):
            return True
    return False


def _overlapping(first: ConverterClaim, second: ConverterClaim) -> list[str]:
    found = []
    for a in (p for t in first.converter.transforms for p in source_patterns_of(t)):
        for b in (p for t in second.converter.transforms for p in source_patterns_of(t)):
            if patterns_overlap(a, b):
                found.append(a if a == b else f"{a} / {b}")
    return found


def _rank(claim: ConverterClaim) -> tuple[int, int, str, int]:
    return (-claim.priority, -int(claim.converter.overwrite), claim.pack, claim.index)


def _conflict(first: ConverterClaim, second: ConverterClaim, key: str, patterns: list[str]) -> ConverterConflictError:
    return ConverterConflictError(
        f"packs {first.pack!r} and {second.pack!r} both convert checkpoint tensors {patterns} for {key!r} "
        f"with priority {first.priority} and {'both' if first.converter.overwrite else 'neither'} overwrite=True. "
        f"Choose a winner: {PACKS_ENV}=all,{first.pack}@+1, {PACKS_ENV}=all,-{second.pack}, or give one "
        "converter a higher priority."
    )


def is_model_type(key: str, model_types: Iterable[str]) -> bool:
    return key in model_types or key == key.lower()


def compose(
    claims: Sequence[ConverterClaim],
    *,
    builtin: Callable[[str], list[Any] | None],
    model_types: Iterable[str] = (),
    class_model_types: Mapping[str, str] | None = None,
    class_keys_supported: bool = True,
) -> Conversions:
    """Compose the converters of one load with the built-in lists.

    Args:
        claims: every converter claim gathered for the load.
        builtin: transformers' list for a key (a fresh copy), or ``None``.
        model_types: every model type transformers knows (tells class-name keys apart).
        class_model_types: the model type of each class-name key, where known; a class
            key with no built-in list of its own starts from its model type's list, as
            the loader would have used that one.
        class_keys_supported: whether the installed transformers looks conversions up
            by class name (5.3 looks up the root model type only); when not, class-name
            converters are folded into their model type's list.

    Raises:
        ConverterConflictError: two packs convert the same tensors with the same rank.
    """
    known_types = frozenset(model_types)
    class_types = dict(class_model_types or {})

    def lookup_key(claim: ConverterClaim) -> str:
        key = claim.key
        if not class_keys_supported and not is_model_type(key, known_types) and key in class_types:
            return class_types[key]
        return key

    lost: list[tuple[ConverterClaim, str]] = []
    winners: list[ConverterClaim] = []
    ranked = sorted(claims, key=_rank)
    for claim in ranked:
        beaten = False
        for winner in winners:
            if winner.pack == claim.pack:
                continue
            same_scope = (
                lookup_key(winner) == lookup_key(claim)
                or class_types.get(winner.key) == lookup_key(claim)
                or class_types.get(claim.key) == lookup_key(winner)
            )
            patterns = _overlapping(winner, claim) if same_scope else []
            if not patterns:
                continue
            if (winner.priority, winner.converter.overwrite) == (claim.priority, claim.converter.overwrite):
                raise _conflict(winner, claim, claim.key, patterns)
            reason = (
                f"priority {claim.priority} < {winner.priority} of {winner.describe()}"
                if claim.priority < winner.priority
                else f"same priority; {winner.describe()} sets overwrite=True"
            )
            lost.append((claim, f"converts the same tensors {patterns}: {reason}"))
            beaten = True
            break
        if not beaten:
            winners.append(claim)

    by_key: dict[str, list[ConverterClaim]] = {}
    for claim in winners:
        if not class_keys_supported and not is_model_type(claim.key, known_types) and claim.key not in class_types:
            lost.append((claim, "this transformers release looks conversions up by model type only"))
            continue
        by_key.setdefault(lookup_key(claim), []).append(claim)

    lists: dict[str, tuple[ComposedTransform, ...]] = {}
    removed: list[Removal] = []
    unmatched: list[tuple[ConverterClaim, str]] = []
    for key in sorted(by_key):
        key_claims = by_key[key]
        base = builtin(key)
        if base is None and not is_model_type(key, known_types) and key in class_types:
            base = builtin(class_types[key])
            inherited = by_key.get(class_types[key], [])
            key_claims = sorted([*key_claims, *inherited], key=_rank)
        base = list(base or [])
        for claim in key_claims:
            for pattern in claim.converter.replaces:
                hits = [t for t in base if pattern in source_patterns_of(t)]
                if not hits:
                    unmatched.append((claim, pattern))
                for transform in hits:
                    removed.append(Removal(key, transform, claim.pack, pattern))
                    base.remove(transform)
        composed = [ComposedTransform(t, claim.pack) for claim in key_claims for t in claim.converter.transforms]
        composed += [ComposedTransform(t, BUILTIN) for t in base]
        lists[key] = tuple(composed)
    return Conversions(lists, tuple(removed), tuple(lost), tuple(unmatched), tuple(winners))


def unused_converters(
    converters: Sequence[tuple[Any, Converter]], claims: Iterable[Claim], plan: Plan, *, classes_known: bool
) -> dict[int, str]:
    """Which gathered converters must not apply because their patches are not applied.

    A patch is applied when it replaces a class of the model (or, when the model's
    classes are not known, when it won its target).  A converter with
    ``patch_targets`` applies while one of the pack's patches on those targets is
    applied; one without, while any patch of its pack is (a pack without patches keeps
    its converters).  A converter would otherwise reshape checkpoint tensors for modules
    that are not in the model, and the load would fail or load them under wrong names.
    (Gathering already refused a converter naming a patch its pack did not return.)

    Args:
        converters: ``(pack, converter)`` pairs as gathered.
        claims: every patch claim gathered for the load.
        plan: the resolved plan.
        classes_known: whether ``plan`` was resolved against the model's class names.

    Returns:
        The reason each unused converter (by position) does not apply.
    """
    applied = list(plan.replaced.values()) if classes_known else list(plan.entries)
    in_effect = {(claim.pack, claim.target) for claim in applied}
    with_patches = {claim.pack for claim in claims}
    unused: dict[int, str] = {}
    for index, (info, converter) in enumerate(converters):
        pack = info.name
        if not converter.patch_targets:
            if pack in with_patches and not any(claim.pack == pack for claim in applied):
                unused[index] = f"no patch of pack {pack!r} is applied"
        elif not any((pack, target) in in_effect for target in converter.patch_targets):
            unused[index] = "; ".join(_not_applied(pack, target, plan) for target in converter.patch_targets)
    return unused


def _not_applied(pack: str, target: str, plan: Plan) -> str:
    for lost in plan.lost:
        if lost.claim.pack == pack and lost.claim.target == target:
            where = f" on {lost.class_name}" if lost.class_name else ""
            return f"its patch {target!r} is not applied{where}: {lost.reason}"
    return f"its patch {target!r} replaces no class of this model"


def compose_for(
    context: Any,
    converters: Sequence[tuple[Any, Converter]],
    priority_offsets: Mapping[str, int] | None = None,
    unused: Mapping[int, str] | None = None,
) -> Conversions:
    """Compose the converters gathered for ``context`` against the installed transformers.

    Args:
        context: the load.
        converters: ``(pack, converter)`` pairs as gathered.
        priority_offsets: each pack's priority offset from the selection.
        unused: for the position in ``converters`` of each converter that must not
            apply (its patches are not applied), the reason; reported in ``lost``.
    """
    offsets = priority_offsets or {}
    unused = unused or {}
    every = [
        ConverterClaim(info.name, info.version, converter, converter.priority + offsets.get(info.name, 0), index)
        for index, (info, converter) in enumerate(converters)
    ]
    dropped = tuple((claim, unused[claim.index]) for claim in every if claim.index in unused)
    claims = [claim for claim in every if claim.index not in unused]
    if not claims:
        return Conversions(lost=dropped)
    import transformers
    from transformers import conversion_mapping
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    class_types: dict[str, str] = {}
    if context.model_type:
        class_types[context.model_class_name] = context.model_type
    for claim in claims:
        cls = getattr(transformers, claim.key, None) if claim.key not in CONFIG_MAPPING_NAMES else None
        model_type = getattr(getattr(cls, "config_class", None), "model_type", None)
        if isinstance(model_type, str) and model_type:
            class_types.setdefault(claim.key, model_type)
    composed = compose(
        claims,
        builtin=conversion_mapping.get_checkpoint_conversion_mapping,
        model_types=CONFIG_MAPPING_NAMES,
        class_model_types=class_types,
        class_keys_supported=_compat.class_keys_supported(),
    )
    return dataclasses.replace(composed, lost=dropped + composed.lost)
