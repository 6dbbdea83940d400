"""PEFT adapters in a model ``apply`` / ``revert`` patch in place.

A PEFT model (``peft.get_peft_model``, ``PeftModel.from_pretrained``, or transformers'
own ``model.add_adapter`` / ``load_adapter``) is a transformers model with adapter layers
injected: a ``lora.Linear`` in place of each targeted ``nn.Linear`` (the original kept as
its ``base_layer``), a ``ModulesToSaveWrapper`` around each module it trains in full.
``apply`` patches the transformers model inside (``base_model_of``), writes its weights
out without the adapters (``plain_state``: what the checkpoint it came from holds), and
swaps only modules that hold no adapter layer, so every adapter stays where it is, with
its weights, its ``requires_grad`` and its place in the adapter's ``save_pretrained``.

A module a pack would swap that holds adapter layers is refused (``refuse_adapters``):
its replacement is a new module with other parameters (``q_proj`` / ``v_proj`` fused into
``qkv_proj``), and the adapters would be lost with the module they sit in.  Carrying
adapters over onto a replacement (LoRA on fused modules) would plug in there.

peft is never imported here: a model can only hold peft's classes once peft is imported,
so its modules are looked up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
import torch.nn as nn

from ..errors import ApplyError


def _peft_class(module: str, name: str) -> type | None:
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def _adapter_layer_types() -> tuple[type, ...]:
    """peft's classes of modules that hold adapter weights (a tuner layer, a ``modules_to_save`` copy)."""
    found = (
        _peft_class("peft.tuners.tuners_utils", "BaseTunerLayer"),
        _peft_class("peft.utils.other", "AuxiliaryTrainingWrapper"),
    )
    return tuple(cls for cls in found if cls is not None)


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of peft's adapter layers (``lora.Linear``, ``ModulesToSaveWrapper``, ...)."""
    types = _adapter_layer_types()
    return bool(types) and isinstance(module, types)


def base_model_of(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``PeftModel``, a tuner such as ``LoraModel``);
    ``model`` itself when it is not one."""
    peft_model = _peft_class("peft.peft_model", "PeftModel")
    tuner = _peft_class("peft.tuners.tuners_utils", "BaseTuner")
    for _ in range(4):  # PeftModel -> LoraModel -> the transformers model
        if peft_model is not None and isinstance(model, peft_model):
            inner = model.base_model
        elif tuner is not None and isinstance(model, tuner):
            inner = model.model
        else:
            break
        if not isinstance(inner, nn.Module):  # pragma: no cover - peft always wraps a module
            break
        model = inner
    return model


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> module for each outermost adapter layer in ``model`` (empty without PEFT)."""
    if not _adapter_layer_types():
        return {}
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if is_adapter_layer(module) and not any(_within(path, outer) for outer in found):
            found[path] = module
    return found


def _within(path: str, outer: str) -> bool:
    return path == outer or not outer or path.startswith(outer + ".")


def _wrapped(layer: nn.Module) -> nn.Module:
    """The module an adapter layer wraps: a tuner layer's base layer, a wrapper's original module."""
    get_base_layer = getattr(layer, "get_base_layer", None)
    base = get_base_layer() if callable(get_base_layer) else getattr(layer, "original_module", None)
    if not isinstance(base, nn.Module):  # pragma: no cover - every peft adapter layer wraps a module
        raise ApplyError(f"cannot find the module the PEFT layer {type(layer).__name__} wraps")
    return base


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as it would be without its adapters: each adapter layer's
    entries replaced by those of the module it wraps, under the layer's own path.  The
    tensors are the live ones (not copies).  Without adapters: ``model.state_dict()``."""
    layers = adapter_layers(model)
    if "" in layers:
        return plain_state(_wrapped(model))
    state = {key: value for key, value in model.state_dict().items() if not any(_within(key, p) for p in layers)}
    for path, layer in layers.items():
        state.update({f"{path}.{key}": value for key, value in plain_state(_wrapped(layer)).items()})
    return state


def refuse_adapters(model: nn.Module, swaps: Iterable[tuple[str, str]], *, after: bool = False) -> None:
    """Raise ``ApplyError`` if a module to swap holds adapter layers, or sits inside one.

    Args:
        model: the transformers model (``base_model_of``).
        swaps: ``(path, pack)`` for each module a pack would swap (or swapped).
        after: ``revert`` is asking (adapters added since ``apply``).

    This is where support for adapters on a pack's replacement (LoRA on fused modules)
    would plug in: instead of refusing, map each adapter onto the replacement's parameters.
    """
    layers = adapter_layers(model)
    if not layers:
        return
    blocked: list[tuple[str, str, list[str]]] = []
    for path, pack in swaps:
        inside = [p for p in layers if _within(p, path)]
        around = [p for p in layers if _within(path, p) and p not in inside]
        if inside or around:
            shown = [f"{p[len(path) + 1 :] or p} ({_name(layers[p])})" for p in inside]
            shown += [f"{p} ({_name(layers[p])}) around it" for p in around]
            blocked.append((path, pack, shown))
    if not blocked:
        return
    path, pack, shown = blocked[0]
    current = dict(model.named_modules()).get(path)
    what = f"{type(current).__name__} at {path}" if current is not None else f"the module at {path}"
    more = f" (and {len(blocked) - 1} more module{'s' if len(blocked) > 2 else ''})" if len(blocked) > 1 else ""
    if after:
        raise ApplyError(
            f"cannot revert {type(model).__name__}: {path}, which pack {pack!r} put there, holds PEFT adapter "
            f"layers added since apply(): {', '.join(shown)}{more}; they would be lost with the module. Merge them "
            "(merge_and_unload()) or remove them (unload()) first"
        )
    raise ApplyError(
        f"pack {pack!r} cannot replace {what}: it holds PEFT adapter layers "
        f"({', '.join(shown)}){more}, which would be lost with the module it replaces. Apply the packs before "
        f"adding adapters (apply() the base model, then get_peft_model), or leave the pack out "
        f'(packs="all,-{pack}")'
    )


def _name(module: nn.Module) -> str:
    cls = type(module)
    short = cls.__module__.removeprefix("peft.tuners.").split(".")[0]
    return f"{short}.{cls.__name__}" if cls.__module__.startswith("peft.tuners.") else cls.__name__
