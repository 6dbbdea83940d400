"""Look-ups of the installed transformers' model types: their configs, classes and modeling modules.

``hfpatch explain`` / ``check`` / ``verify`` and the testing helpers name a model by a
checkpoint directory or a model type; these turn either into what planning needs.
"""

from __future__ import annotations

import difflib
import os
import sys
import types
from typing import Any

import torch.nn as nn
import transformers
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from ..errors import HfPatchError
from .planning import default_class_names, modeling_module, module_classes

__all__ = [
    "ModelNotFoundError",
    "default_config",
    "load_config",
    "model_class_for",
    "modeling_module_classes",
    "unknown_model_type",
]


class ModelNotFoundError(HfPatchError, ValueError):
    """``explain``/``check`` was given neither a checkpoint directory nor a known model type."""


def unknown_model_type(model_type: str) -> str | None:
    """Why ``model_type`` is not a model type of the installed transformers, with the closest
    names; ``None`` when it is one."""
    if model_type in CONFIG_MAPPING_NAMES:
        return None
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"{model_type!r} is not a model type of transformers {transformers.__version__}{hint}"


def load_config(model: str) -> Any:
    """The config of a local checkpoint directory, or the default config of a model type.

    A model type's name is read as a directory only when written as a path (``./llama``):
    a folder named ``llama`` in the working directory is not llama's default config.
    """
    as_path = os.sep in model or "/" in model or model.startswith(".")
    if model in CONFIG_MAPPING_NAMES and not as_path:
        return AutoConfig.for_model(model)
    if os.path.isdir(model):
        return AutoConfig.from_pretrained(model)
    close = difflib.get_close_matches(model, list(CONFIG_MAPPING_NAMES), n=3)
    hint = f"; did you mean {', '.join(repr(name) for name in close)}?" if close else ""
    raise ModelNotFoundError(
        f"{model!r} is neither a checkpoint directory nor a model type known to transformers "
        f"{transformers.__version__}{hint}"
    )


def model_class_for(config: Any) -> type[nn.Module]:
    """The class a checkpoint of ``config`` loads as: its architecture, else a causal LM, else the base model."""
    model_type = getattr(config, "model_type", "")
    for name in default_class_names(config, model_type):
        model_class = getattr(transformers, name, None)
        if isinstance(model_class, type) and issubclass(model_class, nn.Module):
            return model_class
    raise ModelNotFoundError(f"transformers {transformers.__version__} has no model class for {model_type!r}")


def modeling_module_classes(model_type: str) -> dict[str, type]:
    """The ``nn.Module`` classes a load of ``model_type`` resolves claims against, by name.

    A load resolves against the modeling module of the class it builds
    (``class_names_for``), which is not always ``transformers.models.<type>.modeling_<type>``:
    gemma3_text's ``Gemma3ForCausalLM`` lives in ``modeling_gemma3``, exaone loads as
    ``LlamaForCausalLM``.  So: the modules of every class transformers' auto mappings build
    for the model type, its own modeling module where there is one, and, for a composite
    model, the same for each sub-config's model type (its sub-models load in loads of their
    own, against their own modules).  Empty when none can be imported.
    """
    classes: dict[str, type] = {}
    for module in _load_modules(model_type, set()):
        for name, cls in module_classes(module).items():
            classes.setdefault(name, cls)
    return classes


def _load_modules(model_type: str, seen: set[str]) -> list[types.ModuleType]:
    if model_type in seen:
        return []
    seen.add(model_type)
    from transformers.models.auto import modeling_auto

    found: dict[str, types.ModuleType] = {}
    own = modeling_module(model_type)
    if own is not None:
        found[own.__name__] = own
    for mapping_name in dir(modeling_auto):
        mapping = getattr(modeling_auto, mapping_name)
        if not mapping_name.endswith("MAPPING_NAMES") or not isinstance(mapping, dict):
            continue
        names = mapping.get(model_type)
        for name in (names,) if isinstance(names, str) else names or ():
            try:
                cls = getattr(transformers, name, None)
            except Exception:  # a class whose module needs a library that is not installed
                continue
            module = sys.modules.get(getattr(cls, "__module__", "")) if isinstance(cls, type) else None
            if module is not None:
                found.setdefault(module.__name__, module)
    modules = list(found.values())
    config = default_config(model_type)
    for value in vars(config).values() if config is not None else ():
        sub_type = getattr(value, "model_type", None) if isinstance(value, transformers.PretrainedConfig) else None
        if isinstance(sub_type, str) and sub_type in CONFIG_MAPPING_NAMES:
            modules += [m for m in _load_modules(sub_type, seen) if m not in modules]
    return modules


def default_config(model_type: str) -> Any:
    """The default config of ``model_type``, or ``None`` when it cannot be built."""
    try:
        return AutoConfig.for_model(model_type)
    except Exception:  # some model types cannot build a default config
        return None
