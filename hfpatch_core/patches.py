"""The values a pack returns to replace a module class, to change the loaded model, or to say why it will not."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch.nn as nn

from .errors import InvalidPatchError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _describe(value: object) -> str:
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    return f"an instance of {type(value).__qualname__}"


@dataclasses.dataclass(frozen=True)
class Patch:
    """Replace every module class whose name matches ``target`` with ``replacement``.

    ``target`` follows transformers' registry rules: a class name equal to ``target``
    matches first; otherwise ``target`` is a regular expression matched with
    ``re.search`` (so ``"Attention$"`` matches ``LlamaAttention``, and a plain name
    also matches longer names that contain it).

    Args:
        target: a class name (``"LlamaMLP"``) or a regular expression (``".*RMSNorm$"``).
        replacement: a class deriving from ``torch.nn.Module``, built with the
            same ``__init__`` arguments as the classes it replaces.
        priority: higher wins when several packs claim the same target, and is
            matched first among regular expressions.
        overwrite: wins a priority tie, and replaces a mapping that user code
            registered directly with ``register_patch_mapping``.

    Raises:
        InvalidPatchError: ``target`` is empty or not a valid regular expression, or
            ``replacement`` is not a ``torch.nn.Module`` subclass.
    """

    target: str
    replacement: type[nn.Module]
    _: dataclasses.KW_ONLY
    priority: int = 0
    overwrite: bool = False

    def __post_init__(self) -> None:
        target, replacement = self.target, self.replacement
        if not isinstance(target, str) or not target.strip():
            raise InvalidPatchError(
                f"Patch target must be a non-empty class name or regular expression, got {target!r}; "
                "pass the name of the transformers class to replace, e.g. Patch('LlamaMLP', MyMLP)."
            )
        try:
            re.compile(target)
        except re.error as exc:
            raise InvalidPatchError(
                f"Patch target {target!r} is not a valid regular expression ({exc}); "
                "fix the pattern, or escape a literal name with re.escape()."
            ) from None
        if not isinstance(replacement, type):
            hint = (
                f"; pass the class itself: Patch({target!r}, {type(replacement).__qualname__})"
                if isinstance(replacement, nn.Module)
                else ""
            )
            raise InvalidPatchError(
                f"Patch({target!r}): replacement must be a class deriving from torch.nn.Module, "
                f"got {_describe(replacement)}{hint}."
            )
        if not issubclass(replacement, nn.Module):
            raise InvalidPatchError(
                f"Patch({target!r}): replacement {_describe(replacement)} does not derive from "
                "torch.nn.Module; subclass the transformers class you replace (or nn.Module)."
            )
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidPatchError(f"Patch({target!r}): priority must be an int, got {self.priority!r}.")
        if not isinstance(self.overwrite, bool):
            raise InvalidPatchError(f"Patch({target!r}): overwrite must be True or False, got {self.overwrite!r}.")

    @property
    def is_pattern(self) -> bool:
        """Whether ``target`` is written as a regular expression rather than a plain class name."""
        return _IDENTIFIER.fullmatch(self.target) is None

    @property
    def replacement_name(self) -> str:
        """``module.QualName`` of the replacement class, as shown in plans and fingerprints."""
        return f"{self.replacement.__module__}.{self.replacement.__qualname__}"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A class the pack found to patch but will not replace, and why.

    A pack that finds what it patches by structure returns one from ``provide_patches``
    beside its ``Patch`` values for each candidate it cannot make exact (the projections
    read different inputs, a layout it cannot convert, ...).  Nothing is replaced for it;
    the plan keeps the reason, and ``hfpatch explain``, ``hfpatch check`` and the zoo table
    show it, so a user learns in one line why a model was left alone.

    Args:
        target: the class name the pack refused (``"GptOssExperts"``).
        reason: why, in words a user can act on (``"biases on the transposed experts
            cannot be split per expert"``).

    Raises:
        InvalidPatchError: ``target`` or ``reason`` is not a non-empty string.
    """

    target: str
    reason: str

    def __post_init__(self) -> None:
        for field, value in (("target", self.target), ("reason", self.reason)):
            if not isinstance(value, str) or not value.strip():
                raise InvalidPatchError(
                    f"Refusal.{field} must be a non-empty string, got {value!r}; "
                    "e.g. Refusal('GptOssExperts', 'transposed experts with biases are not supported')."
                )


def _callable_name(function: object) -> str:
    module = getattr(function, "__module__", None) or "?"
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"


@dataclasses.dataclass(frozen=True)
class ModelStep:
    """Change the loaded model itself (its forward, its loss), once it is built and its weights are loaded.

    What a ``Patch`` cannot reach: the top-level ``*ForCausalLM`` class is built before
    transformers consults its patch registry, and some changes (a loss computed in chunks)
    depend on probing the loaded model.  A pack returns one from ``provide_model_steps``;
    the winner of each ``target`` is installed on the model a root load returns (and by
    ``hfpatch_core.apply``), recorded on its plan (``Plan.steps``), locked and shown like a
    patch, and ``hfpatch_core.revert(model)`` uninstalls it.

    Args:
        target: what on the model the step changes, a free name (``"causal-lm-loss"``):
            steps of several packs with the same target compete like patches on one class.
        install: called as ``install(model)`` with the loaded model (on its device and
            dtype, autograd enabled whatever the caller's mode); changes only that instance
            (an instance attribute, a hook), never a class or a module-level name, so that
            other models and later loads are vanilla.
            Returns ``None`` once installed, or a ``Refusal`` (with the step's ``target``)
            when the model is not one it can change exactly; it must then leave the model
            as it was.
        uninstall: called as ``uninstall(model)`` by ``revert``: gives the model back what
            ``install`` changed.
        priority: higher wins when several packs offer a step for the same target.
        overwrite: wins a priority tie.

    Raises:
        InvalidPatchError: ``target`` is not a non-empty string, ``install`` or
            ``uninstall`` is not callable, or ``priority`` / ``overwrite`` has the wrong type.
    """

    target: str
    install: Callable[[nn.Module], Refusal | None]
    uninstall: Callable[[nn.Module], None]
    _: dataclasses.KW_ONLY
    priority: int = 0
    overwrite: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise InvalidPatchError(
                f"ModelStep target must be a non-empty name of what the step changes, got {self.target!r}; "
                "e.g. ModelStep('causal-lm-loss', install, uninstall)."
            )
        for field in ("install", "uninstall"):
            value = getattr(self, field)
            if not callable(value):
                raise InvalidPatchError(
                    f"ModelStep({self.target!r}): {field} must be a callable taking the model, got {_describe(value)}."
                )
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidPatchError(f"ModelStep({self.target!r}): priority must be an int, got {self.priority!r}.")
        if not isinstance(self.overwrite, bool):
            raise InvalidPatchError(
                f"ModelStep({self.target!r}): overwrite must be True or False, got {self.overwrite!r}."
            )

    @property
    def install_name(self) -> str:
        """``module.QualName`` of ``install``, as shown in plans, locks and fingerprints."""
        return _callable_name(self.install)
