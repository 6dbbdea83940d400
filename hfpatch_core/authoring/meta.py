"""Building a model on the meta device from inside a hook, to read its structure.

A pack that finds what it patches by structure builds the model it is asked about on the
meta device (no memory, no initialisation) and walks its modules.  Inside a load that hfpatch
manages, a composite model's ``__init__`` builds its sub-models with ``from_config``, which
hfpatch's wrappers would plan and patch as loads of their own, registering conversions for
them while the pack's hook runs: the hook would then be blamed for changing transformers'
registries.  ``build_on_meta`` builds as vanilla transformers does, outside every session.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .._scope import vanilla
from ..context import LoadContext

__all__ = ["build_on_meta", "nested_loads"]

#: Set on each sub-model ``build_on_meta`` saw built with ``from_config`` (see ``nested_loads``).
_NESTED = "hfpatch_nested_load"
#: One build at a time swaps ``from_config``'s recorder in and out (the swap is process-wide).
_RECORDING = threading.Lock()


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
    with vanilla(), torch.device("meta"), warnings.catch_warnings(), _recording_nested_loads(), meta_init_skipped():
        warnings.simplefilter("ignore")  # what building on the meta device says is not the load's business
        return model_class(copy.deepcopy(config))


#: torch's initialisers (the names ``transformers.initialization`` calls through too)
_INITIALISERS = (
    "uniform_",
    "normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "trunc_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def meta_init_skipped() -> Iterator[None]:
    """torch's weight initialisers return a meta tensor as it is while the block runs.

    Initialising a tensor on the meta device writes nothing, but under ``torch.device("meta")``
    each initialiser still runs every torch call it makes through the device mode's Python
    dispatch: most of the time building a model on meta takes.  A tensor on any other device is
    initialised as always (another thread's model is built as it would be).  Each replaced
    function is put back only if it is still the one put in: an initialiser another library
    replaced meanwhile (transformers' ``no_init_weights``) stays its."""
    import torch.nn.init as init

    try:
        from transformers import initialization
    except ImportError:  # a transformers without it: torch's own functions only
        tables: list[Any] = []
    else:
        table = getattr(initialization, "TORCH_INIT_FUNCTIONS", None)
        tables = [table] if isinstance(table, dict) else []
    replaced: list[tuple[Any, str, Any, Any]] = []

    def skipping(original: Any) -> Any:
        def initialise(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return tensor if getattr(tensor, "is_meta", False) else original(tensor, *args, **kwargs)

        return initialise

    for name in _INITIALISERS:
        original = getattr(init, name, None)
        if original is not None:
            replacement = skipping(original)
            setattr(init, name, replacement)
            replaced.append((init, name, original, replacement))
        for table in tables:
            if name in table:
                replacement = skipping(table[name])
                replaced.append((table, name, table[name], replacement))
                table[name] = replacement
    try:
        yield
    finally:
        for owner, name, original, replacement in reversed(replaced):
            if isinstance(owner, dict):
                if owner.get(name) is replacement:
                    owner[name] = original
            elif getattr(owner, name, None) is replacement:
                setattr(owner, name, original)


def nested_loads(model: nn.Module) -> dict[str, nn.Module]:
    """The sub-models of ``model`` (built by ``build_on_meta``) that load in loads of their own.

    A composite model's ``__init__`` builds some sub-models with ``from_config``
    (``AutoModel.from_config(config.text_config)``): at load time each is a load of its own,
    whose hooks are called with a ``LoadContext`` whose ``parent`` is the composite's, and
    whose classes come from its own modeling module.  A pack that walks the composite's
    modules claims those classes in the sub-model's load (with converters in that load's
    lists), not in the composite's; a class claimed in the composite's load but built only in
    a nested one is still replaced (the registration is live while the composite builds),
    and the composite's plan lists it.  Sub-models built by calling their class directly are
    part of the composite's own load and are not here.

    Args:
        model: a model ``build_on_meta`` built.

    Returns:
        Module path (``"model.language_model"``) -> the sub-model, outermost first; the ones
        nested in a nested load are left out (they are that load's business).
    """
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if not path or not getattr(module, _NESTED, False):
            continue
        if any(path.startswith(f"{outer}.") for outer in found):
            continue
        found[path] = module
    return found


@contextlib.contextmanager
def _recording_nested_loads() -> Iterator[None]:
    """Mark each model built through ``from_config`` while the block runs (``nested_loads``)."""
    from transformers import PreTrainedModel

    with _RECORDING:
        current = PreTrainedModel.__dict__["_from_config"]

        def recording(cls: type, config: Any, **kwargs: Any) -> Any:
            built = current.__get__(None, cls)(config, **kwargs)
            if isinstance(built, nn.Module):
                object.__setattr__(built, _NESTED, True)
            return built

        PreTrainedModel._from_config = classmethod(recording)  # type: ignore[assignment,method-assign]
        try:
            yield
        finally:
            PreTrainedModel._from_config = current  # type: ignore[method-assign]
