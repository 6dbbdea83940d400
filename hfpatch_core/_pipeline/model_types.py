"""Look-ups of the installed transformers' model types: their configs, classes and modeling modules.

``hfpatch explain`` / ``check`` / ``verify`` and the testing helpers name a model by a
checkpoint directory or a model type; these turn either into what planning needs.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
from collections.abc import Iterator
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
    "load_classes",
    "load_config",
    "model_class_for",
    "modeling_module_classes",
    "transformers_notices_off",
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
    """The ``nn.Module`` classes of ``transformers.models.<type>.modeling_<type>`` (empty if none);
    a load resolves more (``load_classes``)."""
    module = modeling_module(model_type)
    return module_classes(module) if module is not None else {}


def load_classes(model_type: str, config: Any = None) -> dict[str, type]:
    """The module classes a load of ``model_type`` resolves patch targets against.

    Those of its modeling module, and of the modules its model class and its sub-models'
    classes are defined in: ``gemma3_text`` loads ``Gemma3ForCausalLM`` of ``modeling_gemma3``,
    ``exaone`` loads ``LlamaForCausalLM``; transformers' patch registry replaces a name in every
    module that holds it, so a claim on a class of those modules is applied.

    Args:
        model_type: the model type.
        config: its config (default: its default config; without one, only its modeling module).
    """
    classes = dict(modeling_module_classes(model_type))
    config = default_config(model_type) if config is None else config
    pending, seen = [config] if config is not None else [], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        try:
            module = sys.modules.get(model_class_for(current).__module__)
        except (ModelNotFoundError, ValueError, KeyError):  # a sub-config with no model class of its own
            module = None
        found = module_classes(module) if module is not None else {}
        # a sub-model's own modeling module too: its model class may be mapped to another
        # family's (pixtral's is llava's in transformers 5.3)
        sub_type = getattr(current, "model_type", None)
        found.update(modeling_module_classes(sub_type) if isinstance(sub_type, str) and sub_type else {})
        classes.update((name, cls) for name, cls in found.items() if name not in classes)
        for name in getattr(current, "sub_configs", None) or {}:
            sub = getattr(current, name, None)
            if sub is not None and getattr(sub, "model_type", None):
                pending.append(sub)
    return classes


def default_config(model_type: str) -> Any:
    """The default config of ``model_type``, or ``None`` when it cannot be built."""
    try:
        return config_for_model(model_type)
    except Exception:  # some model types cannot build a default config
        return None


def config_for_model(model_type: str, **values: Any) -> Any:
    """``AutoConfig.for_model(model_type, **values)`` with the Hub offline.

    A few default configs fetch a sub-model's config from the Hub while they are built
    (edgetam's backbone on transformers 5.3): online, each waits through huggingface_hub's
    retries (~46 s here, without a network); a probe of every model type must not wait on, or
    reach, the network.  Offline, such a config fails at once, as one that cannot be built.
    """
    import huggingface_hub.constants as hub

    offline = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = True
    try:
        return AutoConfig.for_model(model_type, **values)
    finally:
        hub.HF_HUB_OFFLINE = offline


@contextlib.contextmanager
def transformers_notices_off() -> Iterator[None]:
    """transformers' notices off (its errors still shown) while a command builds or loads models:
    "falling back to ...", deprecations of a default config's fields, load reports, progress bars'
    logging. Not the pack's problems, and they would interleave with the command's own lines."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
