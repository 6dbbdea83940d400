"""Building a model on the meta device from inside a hook, to read its structure.

A pack that finds what it patches by structure builds the model it is asked about on the
meta device (no memory, no initialisation) and walks its modules.  Inside a load that hfpatch
manages, a composite model's ``__init__`` builds its sub-models with ``from_config``, which
hfpatch's wrappers would plan and patch as loads of their own, registering conversions for
them while the pack's hook runs: the hook would then be blamed for changing transformers'
registries.  ``build_on_meta`` builds as vanilla transformers does, outside every session.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn as nn

from .._scope import vanilla
from ..context import LoadContext

__all__ = ["build_on_meta"]


def build_on_meta(model_class: type[nn.Module] | LoadContext, config: Any = None) -> nn.Module:
    """``model_class(config)`` built on the meta device, as vanilla transformers builds it.

    Safe to call from a hook during a load: no pack applies to it, hfpatch's loader wrappers
    skip it, and transformers' registries are left as they were.  The config is copied, so
    that what ``__init__`` writes into it does not reach the load's config.

    Args:
        model_class: a transformers model class (``LlamaForCausalLM``, a composite model),
            or a hook's ``LoadContext``: the load's class (``context.model_class``) and config.
        config: the config to build it from (default: the context's).

    Raises:
        ValueError: a context whose class transformers does not export, or with no config.

    Returns:
        The model, every parameter and buffer on the meta device.

    Raises:
        Exception: whatever building the model raises (some models cannot be built on meta).
    """
    if isinstance(model_class, LoadContext):
        context = model_class
        found, config = context.model_class, config if config is not None else context.config
        if found is None or config is None:
            missing = "no config" if config is None else f"transformers exports no class {context.model_class_name!r}"
            raise ValueError(f"build_on_meta({context.model_class_name} load): {missing}; pass a class and a config")
        model_class = found
    with vanilla(), torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what building on the meta device says is not the load's business
        return model_class(copy.deepcopy(config))
