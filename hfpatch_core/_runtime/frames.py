"""What hfpatch reads from Python frames: the config a running loader builds with, and
which replacement class raised.

Both read frames because transformers gives no other way: the config object the model
receives exists only as a local of ``from_pretrained`` / ``_from_config`` once keyword
overrides are applied, and an exception from deep inside model construction names the
module whose code raised only through the ``self`` of its traceback frames.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from typing import Any

from .. import _compat
from ..conversion import source_patterns_of
from ..errors import ConverterConflictError, HfPatchError, PackError, WeightLayoutError
from ..plan import BUILTIN, Claim, Plan
from ..settings import PACKS_ENV

_INTERNAL = ("hfpatch_core", "transformers", "contextlib", "importlib")


def caller_stacklevel() -> int:
    """The stack level of the first frame outside hfpatch, transformers and contextlib,
    so that a warning points at the user's ``from_pretrained`` line."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_INTERNAL):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 1


@dataclasses.dataclass(frozen=True)
class Loader:
    """A transformers loader hfpatch wraps: the class it builds and the code of the loader function."""

    model_class: type
    code: types.CodeType

    def _locals(self) -> dict[str, Any]:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is self.code:
                return frame.f_locals
            frame = frame.f_back  # type: ignore[assignment]
        return {}

    def config(self) -> Any:
        """The ``config`` local of the running loader (the config it is about to build with)."""
        return self.arguments()[0]

    def parallel(self) -> tuple[str, ...]:
        """The parallelisms the running loader shards the model with (``_compat.parallel_modes``
        of its ``distributed_config``, ``tp_plan`` and ``device_mesh`` locals, which every rank
        passes alike); ``()`` for ``_from_config``, which does not shard."""
        return self.arguments()[1]

    def arguments(self) -> tuple[Any, tuple[str, ...]]:
        """``(config(), parallel())`` read from one look at the loader's frame (a loader has
        many locals, and reading them copies them all)."""
        found = self._locals()
        get = found.get
        return get("config"), _compat.parallel_modes(get("distributed_config"), get("tp_plan"), get("device_mesh"))

    def expert_mesh(self) -> Any:
        """The expert-parallel mesh the running loader built (``mesh_manager.get_mesh("ep")`` of
        5.25's ``from_pretrained``), or ``None`` where it has none."""
        get_mesh = getattr(self._locals().get("mesh_manager"), "get_mesh", None)
        return get_mesh("ep") if callable(get_mesh) else None


def unwind_entered_contexts() -> None:
    """Exit the contexts transformers' loader entered before the failing one, as a ``with`` would.

    The loader enters its init contexts (``local_torch_dtype``, ``no_tie_weights``,
    ``apply_patches``, ...) through ``transformers.utils.generic.ContextManagers``,
    whose ``__enter__`` does not exit the ones already entered when a later one
    raises: planning that raises inside ``apply_patches`` would leave tying disabled
    and the default dtype changed for the rest of the process.  Called from that
    failing ``__enter__``; does nothing when no such frame is running.
    """
    from transformers.utils.generic import ContextManagers

    code = ContextManagers.__enter__.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            owner = frame.f_locals.get("self")
            stack = getattr(owner, "stack", None)
            if stack is not None:
                stack.close()
            return
        frame = frame.f_back  # type: ignore[assignment]


def blame(exc: BaseException, plan: Plan) -> HfPatchError | None:
    """A PackError naming the replacement class whose code raised ``exc``, if one did; else the
    claim that replaced the class of a model being built (a catch-all pattern such as ``".*"``
    also replaces the model class and every config class, and transformers' code then fails
    far from the pack); a ``ConverterConflictError`` when ``exc`` is transformers refusing a
    fused module's transform that a pack's converter competes with (see ``fusion_conflict``);
    or a ``WeightLayoutError`` when a pack's converter failed on the checkpoint's tensors
    (see ``conversion_failure``)."""
    conflict = fusion_conflict(exc, plan)
    if conflict is not None:
        return conflict
    failed = conversion_failure(exc, plan)
    if failed is not None:
        return failed
    claims: dict[type, Claim] = {claim.patch.replacement: claim for each in plan.all_plans() for claim in each.entries}
    culprit = None
    traceback = exc.__traceback__
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if type(owner) in claims:
            culprit = claims[type(owner)]
        traceback = traceback.tb_next
    if culprit is None:
        return _blame_model_class_patch(exc, plan)
    where = plan.context.model_class_name if plan.context else "the model"
    return PackError(
        culprit.pack,
        f"pack {culprit.pack!r}: {culprit.patch.replacement_name} (replacing {culprit.target!r}) raised "
        f"{type(exc).__name__}: {exc} while building {where}; the load was undone, nothing is left patched.",
        stage="load",
    )


def _blame_model_class_patch(exc: BaseException, plan: Plan) -> PackError | None:
    for each in plan.all_plans():
        model_class = each.context.model_class_name if each.context else None
        claim = each.replaced.get(model_class) if model_class else None
        if claim is None or claim.target == model_class:
            continue
        return PackError(
            claim.pack,
            f"pack {claim.pack!r}: pattern {claim.target!r} (-> {claim.patch.replacement_name}) matches "
            f"{model_class}, the model class itself, and so replaces it and every other class of the loaded "
            f"transformers modules whose name it matches (configs included); building {model_class} then "
            f"raised {type(exc).__name__}: {exc}. The load was undone, nothing is left patched. Anchor the "
            "pattern to the module classes it means (e.g. '^LlamaMLP$') or use exact names.",
            stage="load",
        )
    return None


def fusion_conflict(exc: BaseException, plan: Plan) -> ConverterConflictError | None:
    """The pack whose converter converts the tensors of a ``fusion_config`` fusion, named.

    transformers 5.25 appends the transforms of a load's fused modules to its conversion
    list and raises ``ValueError`` when one has the same source patterns as a registered
    transform (its loader uses the first match, so one of them would never run).  When
    that registered transform is a pack's, the pack and the fusion are named instead.
    """
    patterns = _compat.fusion_conflict_patterns(exc)
    if patterns is None:
        return None
    for each in plan.all_plans():
        for key, entries in each.conversions.lists.items():
            for entry in entries:
                if entry.origin == BUILTIN:
                    continue
                written = source_patterns_of(entry.transform)
                if patterns not in (written, tuple(entry.transform.source_patterns)):
                    continue
                config = each.context.config if each.context is not None else None
                fusions = sorted(getattr(config, "fusion_config", None) or {}) or ["fusion_config"]
                return ConverterConflictError(
                    f"pack {entry.origin!r}'s converter for {key!r} and transformers' fusion "
                    f"{', '.join(map(repr, fusions))} both convert checkpoint tensors {list(patterns)}: "
                    "transformers would apply only one of them. Load without that fusion "
                    f"(fusion_config={{{fusions[0]!r}: False}}), disable the pack "
                    f"({PACKS_ENV}=all,-{entry.origin}), "
                    "or tie the converter to the patch the fusion replaces (Converter(..., patch_targets=...))."
                )
    return None


#: A look-around in a conversion pattern (hfpatch's ``(?!@llama)`` marks, transformers' own):
#: no part of a name, dropped from what a message quotes.
_LOOK_AROUND = re.compile(r"\(\?<?[!=][^)]*\)")


def _conversion_errors(exc: BaseException) -> dict[str, str]:
    """The ``conversion_errors`` of the loading info of the load ``exc`` ended (``{}`` if none).

    transformers 5.25 records each failed conversion there (the target parameter -> the
    operation's traceback and message) and, once the load report is logged, raises a
    ``RuntimeError`` that only points at that report; the info itself is a local of the
    loader's frames that ``exc`` went through.
    """
    traceback = exc.__traceback__
    while traceback is not None:
        info = traceback.tb_frame.f_locals.get("loading_info")
        errors = getattr(info, "conversion_errors", None)
        if isinstance(errors, dict) and errors:
            return {str(key): str(value) for key, value in errors.items()}
        traceback = traceback.tb_next
    return {}


def _cause(recorded: str) -> str:
    """The operation's own message in one of transformers' ``conversion_errors`` entries
    (its traceback, then the message, then transformers' ``Error: ... destined for``
    line), look-arounds dropped."""
    message = recorded.rsplit("\nError", 1)[0]
    lines = [line for line in message.splitlines() if line.strip()]
    return _LOOK_AROUND.sub("", lines[-1] if lines else recorded).strip()


def conversion_failure(exc: BaseException, plan: Plan) -> WeightLayoutError | None:
    """The pack whose converter failed on the checkpoint's tensors, named with what it said.

    transformers turns a converter's exception into an entry of its loading report and a
    bare ``RuntimeError`` ("issues during automatic conversion of the weights") after the
    load; where the failed targets are a pack's converter's, the error names the pack, each
    target parameter and the operation's message (without the patterns' internal marks).
    Conversions of transformers' own are left to its error.
    """
    if not isinstance(exc, RuntimeError):
        return None
    errors = _conversion_errors(exc)
    if not errors:
        return None
    from .layout import converter_owner

    lines, packs = [], []
    for target, recorded in sorted(errors.items()):
        pack = converter_owner(target, plan)
        if pack is None:
            continue
        packs.append(pack)
        lines.append(f"{target} (converter of pack {pack!r}): {_cause(recorded)}")
    if not lines:
        return None
    named = ", ".join(repr(pack) for pack in dict.fromkeys(packs))
    return WeightLayoutError(
        f"the checkpoint's tensors do not convert into the patched model's ({len(lines)} parameters):\n  "
        + "\n  ".join(lines)
        + f"\nThe checkpoint does not fit what pack {named} expects (another configuration of the model, or a "
        f"checkpoint edited by hand); load it with the config it was saved with, or without the pack "
        f"({PACKS_ENV}=all,-{packs[0]})."
    )
