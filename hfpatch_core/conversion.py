"""The value a pack returns to map checkpoint tensors onto a patched layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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

    Raises:
        InvalidPatchError: an argument has the wrong type.
    """

    key: str
    transforms: tuple[Any, ...]
    _: dataclasses.KW_ONLY
    priority: int = 0
    overwrite: bool = False
    replaces: tuple[str, ...] = ()

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
        replaces = (self.replaces,) if isinstance(self.replaces, str) else tuple(self.replaces)
        if not all(isinstance(pattern, str) and pattern for pattern in replaces):
            raise InvalidPatchError(
                f"Converter({self.key!r}): replaces must be source patterns (strings), got {self.replaces!r}."
            )
        object.__setattr__(self, "replaces", replaces)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidPatchError(f"Converter({self.key!r}): priority must be an int, got {self.priority!r}.")
        if not isinstance(self.overwrite, bool):
            raise InvalidPatchError(
                f"Converter({self.key!r}): overwrite must be True or False, got {self.overwrite!r}."
            )
