"""Which of transformers' conversion lists a load reads: ``conversion_key`` and ``conversion_lists``.

transformers keeps its checkpoint conversions (renamings, the stacking of per-expert tensors,
...) in lists keyed by model type or by model class, and a load looks its model class's list up
first, then (where the class has none) its model type's.  A pack's converters join the list
the load reads (``Converter(key=conversion_key(context), ...)``); a pack that must know what
transformers itself does to the tensors reads every list the load's tensors go through
(``conversion_lists(context)``), which for a sub-model's load includes the outer model's.
"""

from __future__ import annotations

from typing import Any

from ..context import LoadContext

__all__ = ["conversion_key", "conversion_lists"]


def _builtin(key: str) -> Any:
    """transformers' list for ``key``, or ``None`` (none, or a release without the table)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return None
    return get_checkpoint_conversion_mapping(key)


def conversion_key(context: LoadContext) -> str:
    """The conversion list a load's converters join: the model class's where transformers keeps a
    list for it (a sub-model's ``SiglipVisionModel``, a composite model's
    ``Qwen2_5_VLForConditionalGeneration``), which a load looks up first and then not the model
    type's; else the model type's.

    Args:
        context: the load's context, as a hook is given it.

    Returns:
        The key (``""`` for a context without a model type or a class with a list).
    """
    if context.model_class_name and _builtin(context.model_class_name) is not None:
        return context.model_class_name
    return context.model_type or ""


def conversion_lists(context: LoadContext) -> list[str]:
    """Every conversion list a load's tensors go through, by key, without repeats: the model
    type's and the load's own (``conversion_key``), and for a sub-model's load (``context.parent``
    set) the outer model's class and model type, whose list transformers applies unscoped to
    every sub-model (kimi_k25's splits its vision tower's ``wqkv``).

    A key may have no list on the installed transformers: ``get_checkpoint_conversion_mapping``
    then answers ``None``.

    Args:
        context: the load's context, as a hook is given it.
    """
    keys = [context.model_type, conversion_key(context)]
    if context.parent is not None:
        keys += [context.root.model_class_name, context.root.model_type]
    return [key for key in dict.fromkeys(keys) if key]
