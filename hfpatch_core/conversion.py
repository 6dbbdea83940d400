"""The value a pack returns to map checkpoint tensors onto a patched layout."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

from transformers.core_model_loading import WeightTransform

from .errors import InvalidPatchError


@dataclasses.dataclass(frozen=True)
class Converter:
    """Checkpoint transforms a pack's patches need, for one model type or class.

    Args:
        key: a ``model_type`` (``"qwen2_moe"``) or a model class name
            (``"Qwen2MoeForCausalLM"``), as in transformers' conversion registry.
        transforms: transformers ``WeightTransform`` objects (``WeightConverter``,
            ``WeightRenaming``), applied in order with transformers' first-match rule.
        priority: higher wins when two packs convert the same checkpoint tensors.
        overwrite: wins a priority tie.
        replaces: source patterns of the transforms already registered for ``key``
            (transformers' built-in list) that these transforms make obsolete.
        patch_targets: the targets of the pack's own patches whose modules these
            transforms load (``("LlamaAttention",)``).  The converter applies only while
            one of those patches replaces a class of the model, so a pack that wins one
            class and loses another converts the checkpoint for the winner alone.  (A
            pattern patch that replaces one class and is shadowed on another counts as
            applied: tie converters to exact-name patches, one per class.)  Left
            empty, the converter applies while any patch of the pack is applied (or
            always, for a pack without patches).  A target the pack returned no patch
            for makes the pack fail for that load.

    Raises:
        InvalidPatchError: an argument has the wrong type.
    """

    key: str
    transforms: tuple[Any, ...]
    _: dataclasses.KW_ONLY
    priority: int = 0
    overwrite: bool = False
    replaces: tuple[str, ...] = ()
    patch_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key.strip():
            raise InvalidPatchError(
                f"Converter key must be a model_type or model class name, got {self.key!r}; "
                "e.g. Converter('qwen2_moe', [...])."
            )
        transforms = self.transforms
        if isinstance(transforms, WeightTransform):
            transforms = (transforms,)
        if not isinstance(transforms, Sequence) or isinstance(transforms, str):
            raise InvalidPatchError(
                f"Converter({self.key!r}): transforms must be a list of WeightTransform, "
                f"got {type(transforms).__name__}."
            )
        for transform in transforms:
            if not isinstance(transform, WeightTransform):
                raise InvalidPatchError(
                    f"Converter({self.key!r}): {transform!r:.80} is not a transformers WeightTransform; "
                    "use transformers.core_model_loading.WeightConverter or WeightRenaming."
                )
        object.__setattr__(self, "transforms", tuple(transforms))
        object.__setattr__(self, "replaces", self._strings("replaces", "source patterns", "'mlp.gate_proj'"))
        object.__setattr__(
            self, "patch_targets", self._strings("patch_targets", "targets of the pack's patches", "'LlamaAttention'")
        )
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidPatchError(f"Converter({self.key!r}): priority must be an int, got {self.priority!r}.")
        if not isinstance(self.overwrite, bool):
            raise InvalidPatchError(
                f"Converter({self.key!r}): overwrite must be True or False, got {self.overwrite!r}."
            )

    def _strings(self, field: str, what: str, example: str) -> tuple[str, ...]:
        value = getattr(self, field)
        values = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Iterable) else None
        if values is None or not all(isinstance(item, str) and item for item in values):
            raise InvalidPatchError(
                f"Converter({self.key!r}): {field} must be {what} (non-empty strings), got {value!r}; "
                f"e.g. {field}=({example},)."
            )
        return values


def pattern_regex(pattern: str) -> re.Pattern[str] | None:
    """A transform's source or target pattern as a regular expression (``*`` stands for an index), or None."""
    try:
        return re.compile(pattern.replace("*", r"\d+"))
    except re.error:
        return None


def source_patterns_of(transform: Any) -> tuple[str, ...]:
    """A transform's source patterns as written (before transformers compiles them)."""
    patterns = getattr(transform, "_original_source_patterns", None) or transform.source_patterns
    return (patterns,) if isinstance(patterns, str) else tuple(patterns)


def target_patterns_of(transform: Any) -> tuple[str, ...]:
    """A transform's target patterns as written."""
    patterns = getattr(transform, "_original_target_patterns", None) or transform.target_patterns
    return (patterns,) if isinstance(patterns, str) else tuple(patterns)


def describe_transform(transform: Any) -> str:
    """``WeightConverter(['a', 'b'] -> ['c'], [Concatenate(dim=0)])`` in one line."""
    operations = getattr(transform, "operations", None)
    ops = f", {list(operations)!r}" if operations else ""
    return (
        f"{type(transform).__name__}({list(source_patterns_of(transform))!r} -> "
        f"{list(target_patterns_of(transform))!r}{ops})"
    )
