"""Exceptions and warnings raised by hfpatch.

Every message says what was wrong, which input caused it and how to fix it.  The errors
are grouped by how a caller reacts to them (catch the group, not each error):

* ``ConfigurationError``: the choice of packs or the installed set is wrong; fix
  ``HF_PATCH_PACKS`` / ``enable(packs=...)`` or the environment (``SelectionError``,
  ``DuplicatePackError``, ``LockError``).
* ``ConflictError``: packs disagree about a target and no rule decides; choose one, e.g.
  ``HF_PATCH_PACKS=all,pack@+1`` (``PatchConflictError``, ``ConverterConflictError``).
* ``PackError``: a pack failed (import, hook, load); skipped with a ``PackWarning`` unless strict.
* ``ModelError``: this model cannot be patched, loaded or adapted as asked; the model is
  as it was (``WeightLayoutError``, ``ApplyError``, ``AdapterError``).
* ``InvalidPatchError``: a pack built a ``Patch`` or ``Converter`` from bad input.
"""

from __future__ import annotations


class HfPatchError(Exception):
    """Base class of every error hfpatch raises."""


class InvalidPatchError(HfPatchError, ValueError):
    """A ``Patch`` or ``Converter`` was built from bad input."""


class ConfigurationError(HfPatchError):
    """The selection of packs, or the set of installed packs, is wrong: fix it and run again."""


class ModelError(HfPatchError):
    """This model cannot be patched, loaded or adapted as asked; nothing was changed."""


class SelectionError(ConfigurationError, ValueError):
    """``HF_PATCH_PACKS`` (or ``enable(packs=...)``) is malformed or names a pack that is not installed."""


class DuplicatePackError(ConfigurationError):
    """Two installed distributions declare a pack of the same name."""


class LockError(ConfigurationError):
    """The packs a load would use, or its plan, differ from the lock (``HF_PATCH_LOCK``,
    ``enable(lock=...)``); raised before any weight is read, or the lock file cannot be read.

    Attributes:
        lock: the lock file.
        changes: what differs, one phrase each, every one naming its pack or model type.
    """

    def __init__(self, message: str, *, lock: str = "", changes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.lock = lock
        self.changes = changes


class PackError(HfPatchError):
    """A pack could not be used: its import failed, a hook raised or returned the wrong type.

    In the default mode this is reported as a ``PackWarning`` and the pack is skipped;
    in strict mode it is raised before anything is registered.

    Attributes:
        pack: the pack's name.
        stage: where it failed: ``"import"`` (its module could not be imported or
            registered), ``"hook"`` (a hook raised or returned something wrong),
            ``"selection"`` (incompatible or ambiguous), ``"load"`` (its code failed
            while the model was built or loaded), ``"calibration"`` (in strict mode: a
            quantizer's calibration would have missed a module it holds, see
            ``authoring.calibration.report_unrouted``) or ``"step"`` (in strict mode: what a
            pack's model step installed was bypassed when the model ran, another library
            computing it instead).
    """

    STAGES = ("import", "hook", "selection", "load", "calibration", "step")

    def __init__(self, pack: str, message: str, *, stage: str = "hook") -> None:
        if stage not in self.STAGES:
            raise ValueError(f"PackError stage must be one of {self.STAGES}, got {stage!r}")
        super().__init__(message)
        self.pack = pack
        self.stage = stage


class ConflictError(HfPatchError):
    """Packs claim the same thing and no rule decides between them: raise one's priority or leave one out.

    Attributes:
        problem: what ties, naming every claimant of the target.
        remedy: how to settle it (a selection the resolver checked, when planning found one).
        packs: the packs whose claims tie, sorted.
        target: the patch target, or the converter key, they tie on.
        selection: the ``HF_PATCH_PACKS`` value the remedy names, checked to settle every
            conflict of the load's model type; ``None`` when none was checked or found.
    """

    def __init__(
        self,
        problem: str,
        remedy: str = "",
        *,
        packs: tuple[str, ...] = (),
        target: str = "",
        selection: str | None = None,
    ) -> None:
        super().__init__(f"{problem} {remedy}".strip())
        self.problem = problem
        self.remedy = remedy
        self.packs = packs
        self.target = target
        self.selection = selection

    def with_remedy(self, remedy: str, selection: str | None) -> ConflictError:
        """The same conflict, with ``remedy`` in place of the generic one."""
        return type(self)(self.problem, remedy, packs=self.packs, target=self.target, selection=selection)


class PatchConflictError(ConflictError):
    """Two packs claim the same target with the same priority and neither (or both) overwrite."""


class ConverterConflictError(ConflictError):
    """Two packs' converters claim the same checkpoint tensors with the same priority."""


class ForeignPatchError(ConflictError):
    """A pack's claim replaces, for a load, a class that code outside hfpatch swapped into
    transformers (a modeling module's attribute, or a patch registry entry no pack made).

    In the default mode this is reported once as a ``PackWarning`` and the pack's class is
    used for the load (the foreign class is put back when it ends); strict mode raises it.
    """


class WeightLayoutError(ModelError):
    """A patched model does not match its checkpoint: a weight would be missing, unexpected,
    of the wrong shape, or saved in a layout vanilla transformers cannot read."""


class PackWarning(UserWarning):
    """A pack was skipped (failure, incompatibility) or one of its claims was not applied."""


class ApplyError(ModelError):
    """``hfpatch_core.apply`` / ``revert`` cannot patch (or unpatch) a built model in place;
    the message names the pack and the reason, and the model is as it was."""


class AdapterError(ModelError, ValueError):
    """An adapter (PEFT) cannot be put on a patched model as asked: it would target a module a pack
    fused (and so not load on an unpatched model), or a fused module cannot be split for it."""
