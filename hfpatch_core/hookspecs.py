"""The hooks a patch pack implements.

A pack is a module (or any object) whose functions are marked with ``hookimpl``
and named like the specifications below.  A pack implements only the hooks it needs::

    from hfpatch_core import Patch, hookimpl

    @hookimpl
    def provide_patches(context):
        if context.model_type == "llama":
            return [Patch("LlamaMLP", MyMLP)]
        return []
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .context import LoadContext
    from .conversion import Converter
    from .patches import ModelStep, Patch, Refusal

#: The pluggy project name shared by the markers and the plugin manager.
PROJECT_NAME = "hfpatch"

#: Marks a specification in this module.
hookspec = pluggy.HookspecMarker(PROJECT_NAME)

#: Marks a pack's implementation of a hook: ``@hfpatch_core.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def provide_patches(context: LoadContext) -> Iterable[Patch | Refusal]:
    """Return the module-class replacements this pack wants for one model load.

    Called once per pack for every model that loads while hfpatch is enabled
    (``from_pretrained``, ``from_config``, the Auto classes, ``hfpatch_core.patched``),
    after the pack was selected by ``HF_PATCH_PACKS`` and found compatible with the
    installed transformers, and before anything is registered.  Also called by
    ``hfpatch explain`` and ``hfpatch check`` with a context built from a config alone.

    Args:
        context: what is being loaded: model type, model class name, the config
            (``None`` when unknown) and the transformers version.

    Returns:
        An iterable (list, tuple, generator) of ``Patch``; an empty one when the pack
        has nothing for this model.  A pack that finds its targets by structure adds a
        ``Refusal`` for each class it found but will not replace, with the reason
        (``hfpatch explain`` and ``hfpatch check`` show it).  ``None`` or any other type
        is a pack error.
    """
    raise NotImplementedError


@hookspec
def provide_converters(context: LoadContext) -> Iterable[Converter]:
    """Return the checkpoint conversions this pack's patches need for one model load.

    Called with the same context and at the same moment as ``provide_patches``.
    A converter maps checkpoint tensors onto the layout a replacement class expects
    (and back, when the model is saved).

    Args:
        context: see ``provide_patches``.

    Returns:
        An iterable of ``Converter``; an empty one when the pack's patches keep the
        original weight layout.
    """
    raise NotImplementedError


@hookspec
def provide_model_steps(context: LoadContext) -> Iterable[ModelStep | Refusal]:
    """Return the changes this pack makes to the loaded model itself, for one model load.

    Called with the same context and at the same moment as ``provide_patches``, for a root
    load only (the model ``from_pretrained`` / ``from_config`` returns, or the model
    ``hfpatch_core.apply`` patches; not for a sub-model built inside another load), and by
    ``hfpatch explain``, ``lock``, ``check`` and ``verify``.  The winning step of each target
    is installed after the model is built and its weights are loaded (``ModelStep.install``,
    which may still refuse the loaded model), and recorded on its plan.

    Args:
        context: see ``provide_patches``; ``context.parallel`` says whether transformers
            shards the model (a step that cannot work on sharded weights refuses here).

    Returns:
        An iterable of ``ModelStep``; an empty one when the pack has nothing for this model.
        A ``Refusal`` (with the step's target) says why a step the pack would offer is not
        offered for this model; ``hfpatch explain``, ``verify`` and the zoo show it.
    """
    raise NotImplementedError


@hookspec
def provide_model_types() -> Iterable[str]:
    """Return the model types this pack can patch (``"llama"``, ``"qwen2_moe"``); optional.

    Called by ``hfpatch check`` and ``hfpatch verify`` only, never during a load: they
    check and verify the pack on each of these model types (with a tiny config), besides
    those it returns patches or converters for when asked with ``config=None``.  A pack
    whose hooks decide from the config implements it; without it, ``check`` asks such a
    pack with a tiny config of every model type transformers knows, which takes seconds.

    Returns:
        An iterable of model type strings; a name that is not a model type of the
        installed transformers is a problem ``check`` reports.
    """
    raise NotImplementedError
