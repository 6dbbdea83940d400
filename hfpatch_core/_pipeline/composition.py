"""Building the conversion lists transformers receives for one load.

transformers keeps one list of weight transforms per model type or class name and a
registration replaces the whole list.  For one load, hfpatch computes each list the
packs touch: the winning converters' transforms (highest priority first, so that the
loader's first-matching converter honours priority), then transformers' built-in list
for that key minus the transforms a converter ``replaces``.  Which converters win is
``resolution``'s decision; this module only lays out the lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .. import _compat
from ..conversion import pattern_regex, source_patterns_of
from ..plan import BUILTIN, ComposedTransform, Conversions, ConverterClaim, Removal
from .resolution import rank

__all__ = [
    "BUILTIN",
    "ConversionScope",
    "compose",
    "patterns_overlap",
    "scope_for",
]


def _example(pattern: str) -> str:
    return pattern.replace("*", "0").replace("\\", "").strip("^$")


def patterns_overlap(first: str, second: str) -> bool:
    """Whether two source patterns can match the same checkpoint key (a close test)."""
    if first == second:
        return True
    for pattern, other in ((first, second), (second, first)):
        compiled = pattern_regex(pattern)
        if compiled is not None and compiled.search(_example(other)):
            return True
    return False


def is_model_type(key: str, model_types: Iterable[str]) -> bool:
    return key in model_types or key == key.lower()


@dataclasses.dataclass(frozen=True)
class ConversionScope:
    """Which list each converter lands in, on the installed transformers.

    Attributes:
        model_types: every model type transformers knows (tells class-name keys apart).
        class_model_types: the model type of each class-name key, where known; a class
            key with no built-in list of its own starts from its model type's list, as
            the loader would have used that one.
        class_keys_supported: whether transformers looks conversions up by class name
            (5.3 looks up the root model type only); when not, class-name converters are
            folded into their model type's list.
    """

    model_types: frozenset[str] = frozenset()
    class_model_types: Mapping[str, str] = dataclasses.field(default_factory=dict)
    class_keys_supported: bool = True

    def lookup_key(self, claim: ConverterClaim) -> str:
        """The list ``claim`` is registered in."""
        key = claim.key
        if not self.class_keys_supported and not is_model_type(key, self.model_types) and key in self.class_model_types:
            return self.class_model_types[key]
        return key

    def overlap(self, first: ConverterClaim, second: ConverterClaim) -> list[str]:
        """The source patterns both claims convert in one lookup scope (empty when they do not compete)."""
        types = self.class_model_types
        same_scope = (
            self.lookup_key(first) == self.lookup_key(second)
            or types.get(first.key) == self.lookup_key(second)
            or types.get(second.key) == self.lookup_key(first)
        )
        if not same_scope:
            return []
        found = []
        for a in (p for t in first.converter.transforms for p in source_patterns_of(t)):
            for b in (p for t in second.converter.transforms for p in source_patterns_of(t)):
                if patterns_overlap(a, b):
                    found.append(a if a == b else f"{a} / {b}")
        return found

    def unsupported(self, claim: ConverterClaim) -> bool:
        """A class-name key this transformers release cannot look up, with no model type to fold into."""
        return (
            not self.class_keys_supported
            and not is_model_type(claim.key, self.model_types)
            and claim.key not in self.class_model_types
        )


def compose(
    winners: Sequence[ConverterClaim],
    *,
    builtin: Callable[[str], list[Any] | None],
    scope: ConversionScope | None = None,
    lost: Sequence[tuple[ConverterClaim, str]] = (),
) -> Conversions:
    """Lay out the lists for the winning converters of one load.

    Args:
        winners: the converter claims that apply (``resolution.resolve_converters``).
        builtin: transformers' list for a key (a fresh copy), or ``None``.
        scope: which list each converter lands in.
        lost: the claims that do not apply, with the reason, recorded as they are.
    """
    scope = scope or ConversionScope()
    class_types = scope.class_model_types
    left_out = list(lost)
    by_key: dict[str, list[ConverterClaim]] = {}
    for claim in sorted(winners, key=rank):
        if scope.unsupported(claim):
            left_out.append((claim, "this transformers release looks conversions up by model type only"))
            continue
        by_key.setdefault(scope.lookup_key(claim), []).append(claim)

    lists: dict[str, tuple[ComposedTransform, ...]] = {}
    removed: list[Removal] = []
    unmatched: list[tuple[ConverterClaim, str]] = []
    for key in sorted(by_key):
        key_claims = by_key[key]
        base = builtin(key)
        if base is None and not is_model_type(key, scope.model_types) and key in class_types:
            base = builtin(class_types[key])
            inherited = by_key.get(class_types[key], [])
            key_claims = sorted([*key_claims, *inherited], key=rank)
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
    return Conversions(lists, tuple(removed), tuple(left_out), tuple(unmatched), tuple(winners))


def scope_for(model_type: str | None, model_class_name: str, claims: Iterable[ConverterClaim]) -> ConversionScope:
    """The ``ConversionScope`` of a load of ``model_class_name`` on the installed transformers."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    class_types: dict[str, str] = {}
    if model_type:
        class_types[model_class_name] = model_type
    for claim in claims:
        cls = getattr(transformers, claim.key, None) if claim.key not in CONFIG_MAPPING_NAMES else None
        found = getattr(getattr(cls, "config_class", None), "model_type", None)
        if isinstance(found, str) and found:
            class_types.setdefault(claim.key, found)
    return ConversionScope(frozenset(CONFIG_MAPPING_NAMES), class_types, _compat.class_keys_supported())
