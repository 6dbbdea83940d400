"""State dicts of patched models in the original layout: reading them, and loading them back.

A patched model saves in the original layout (``save_pretrained`` reverses the packs'
conversions), and so do the checkpoints ``Trainer`` writes.  Resuming loads such a
checkpoint with ``model.load_state_dict(state_dict, strict=False)`` (``Trainer``,
accelerate and DeepSpeed all end there), which knows nothing of conversions: the fused
weights would be reported missing, the original ones unexpected, and training would go
on from the weights the model had.  A patched model's ``load_state_dict`` therefore
accepts both layouts: keys of the original layout are written through the model's own
conversions, reversed: ``revert_weight_conversion`` (what a save runs) gives, for the
converters hfpatch packs use, *views* of the model's tensors under the original names
(a split of a fused weight is a set of views of its rows), and the loaded values are
copied into those views.  Where a reversed conversion copies instead (transformers 5.25
stacks a Qwen2-MoE's experts into 3-D tensors at load and splits them into per-expert
copies on save), those keys go forward through the same conversions a load runs:
transformers' own ``convert_and_load_state_dict_in_model`` with the model's conversions
(``_weight_conversions``: the packs' converters and transformers' own), into a copy of
the model whose tensors are on the meta device, and the values it produces are copied
into the model's tensors.  A key that reaches none of them is a ``WeightLayoutError``
naming it, never a silent skip.

``original_state_dict(model)`` gives the original layout (the same views, detached).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .. import _compat
from ..authoring.packing import full_shape, is_partitioned
from ..errors import WeightLayoutError

__all__ = ["LoadGuard", "full_shapes", "guard_loading", "original_state_dict", "refuse_partitioned_save"]

_LOAD_GUARD = "_hfpatch_load_guard"


def original_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` in the layout its checkpoint has (the one ``save_pretrained`` writes).

    For a patched model the packs' conversions are reversed (``qkv_proj.weight`` gives
    ``q_proj.weight``, ``k_proj.weight`` and ``v_proj.weight``); for any other model
    transformers' own conversions are.  The tensors are detached views of the model's
    weights wherever the reversed conversion allows it (clone them to keep a snapshot).

    Args:
        model: a transformers model (patched or not).

    Returns:
        Checkpoint name -> tensor.
    """
    from transformers.core_model_loading import revert_weight_conversion

    state: dict[str, torch.Tensor] = revert_weight_conversion(model, model.state_dict())
    return state


def full_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """``model.state_dict()``'s keys -> the whole tensors' shapes, also where DeepSpeed ZeRO-3 partitioned them.

    A partitioned parameter is an empty placeholder on every rank (its ``state_dict`` entry has
    shape ``(0,)``, and loses the ``ds_shape`` a parameter carries): its full shape is read from
    the parameter (``hfpatch_core.authoring.packing.full_shape``), under every name it has (a tied
    head's too).  Used by the save guard's layout check, which runs on shapes alone.
    """
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name in shapes:
            shapes[name] = full_shape(parameter)
    return shapes


def refuse_partitioned_save(model: nn.Module, state_dict: Mapping[str, Any] | None) -> None:
    """Refuse ``save_pretrained`` of a ZeRO-3 partitioned model given no state dict (before anything is written).

    Its own ``state_dict()`` holds each rank's empty placeholders: reversing the packs'
    conversions on them fails (a ``SizedSplit`` of a ``(0,)`` tensor), and without conversions
    transformers would write empty tensors.  The whole weights come from a collective every rank
    runs (``Trainer.save_model``: ``accelerator.get_state_dict(engine)``, DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict``), which a save on some ranks cannot start: a
    rank gathering alone would wait for ever.

    Raises:
        WeightLayoutError: ``state_dict`` is ``None`` and some parameter of ``model`` is partitioned.
    """
    if state_dict is not None:
        return
    partitioned = [name for name, parameter in model.named_parameters() if is_partitioned(parameter)]
    if partitioned:
        raise WeightLayoutError(
            f"refusing to save {type(model).__name__} without a state_dict: DeepSpeed ZeRO-3 partitioned its "
            f"parameters ({partitioned[0]} and {len(partitioned) - 1} more), so each rank holds empty placeholders. "
            "Save with Trainer.save_model (it gathers them on every rank), or pass the gathered weights: "
            "state_dict = engine._zero3_consolidated_16bit_state_dict() on every rank, then "
            "model.save_pretrained(path, state_dict=state_dict, is_main_process=rank == 0). On CPU, create the "
            "TrainingArguments with use_cpu=True: otherwise accelerate counts one process, and every rank saves."
        )


def _storages(tensors: Mapping[str, torch.Tensor]) -> set[int]:
    return {tensor.untyped_storage().data_ptr() for tensor in tensors.values() if tensor.device.type != "meta"}


def _incompatible(missing: list[str], unexpected: list[str]) -> Any:
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys(missing, unexpected)


def load_original_layout(
    model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> Any:
    """``nn.Module.load_state_dict`` for ``model``, accepting the original layout too (see the module).

    Returns:
        ``(missing_keys, unexpected_keys)`` as ``load_state_dict`` returns them; for a
        state dict in the original layout, named in that layout.

    Raises:
        RuntimeError: ``strict`` and keys are missing or unexpected, or a shape differs
            (as ``load_state_dict``).
        WeightLayoutError: original-layout keys that reach none of the model's weights
            through its conversions (a partial group of experts, a conversion that fails on
            them), or ``assign=True`` with the original layout.
    """
    own = model.state_dict()
    foreign = [key for key in state_dict if key not in own]
    if not foreign:
        return nn.Module.load_state_dict(model, state_dict, strict, assign)
    original = original_state_dict(model)
    converted = [key for key in foreign if key in original]
    if not converted:  # not the original layout either: torch reports the keys as usual
        return nn.Module.load_state_dict(model, state_dict, strict, assign)
    name = type(model).__name__
    if assign:
        raise WeightLayoutError(
            f"{name}.load_state_dict(assign=True) got the original layout ({converted[:3]} ...), which its packs "
            "convert; assign cannot put those tensors in place: load with assign=False (the values are copied)"
        )
    storages = _storages(own)
    copies = [key for key in converted if original[key].untyped_storage().data_ptr() not in storages]
    mismatched = [
        f"{key}: checkpoint {list(state_dict[key].shape)}, model {list(original[key].shape)}"
        for key in converted
        if tuple(state_dict[key].shape) != tuple(original[key].shape)
    ]
    if mismatched:
        shown = "\n\t".join(mismatched)
        raise RuntimeError(f"Error(s) in loading state_dict for {name}:\n\tsize mismatch for {shown}")
    forward = _convert_forward(model, {key: state_dict[key] for key in copies}) if copies else {}
    direct = {key: value for key, value in state_dict.items() if key in own}
    nn.Module.load_state_dict(model, direct, strict=False)
    with torch.no_grad():
        for key in converted:
            if key not in copies:
                original[key].copy_(state_dict[key])
        for key, value in forward.items():
            own[key].copy_(value)
    missing = [key for key in original if key not in state_dict]
    unexpected = [key for key in foreign if key not in original]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {name} (original layout): missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    return _incompatible(missing, unexpected)


def reversible_conversions(model: Any) -> list[Any]:
    """The conversions a model built from a config should save with (``get_model_conversion_mapping``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    prefix_change = _compat.prefix_change_type()
    return [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, prefix_change)]


def _conversions(model: Any) -> list[Any]:
    """The conversions in force for ``model``, forward: those its load ran, else the ones a save reverses."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = reversible_conversions(model)
    return copy.deepcopy(list(conversions))  # the loader records use on them: never on the model's own


def _meta_copy(model: nn.Module) -> Any:
    """``model`` with every parameter and buffer on the meta device: its modules, classes and
    config, none of its memory (the tensors are not copied, only described)."""
    memo: dict[int, Any] = {}
    for tensor in model.parameters():
        memo[id(tensor)] = nn.Parameter(torch.empty_like(tensor, device="meta"), requires_grad=tensor.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def _convert_forward(model: Any, sources: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sources`` (original-layout keys) converted into ``model``'s layout by transformers' loader.

    Raises:
        WeightLayoutError: the conversion fails, or a source key reaches no tensor of the model.
        RuntimeError: a converted tensor's shape differs from the model's (as ``load_state_dict``).
    """
    from transformers.core_model_loading import convert_and_load_state_dict_in_model, revert_weight_conversion
    from transformers.modeling_utils import LoadStateDictConfig

    name = type(model).__name__
    device = next(iter(sources.values())).device
    config = LoadStateDictConfig(weight_mapping=_conversions(model), device_map={"": device})
    kwargs: dict[str, Any] = {}
    if "tp_plan" in inspect.signature(convert_and_load_state_dict_in_model).parameters:  # transformers 5.3
        kwargs["tp_plan"] = None
    try:
        shadow = _meta_copy(model)
        info, _ = convert_and_load_state_dict_in_model(shadow, dict(sources), config, **kwargs)
    except Exception as exc:
        raise WeightLayoutError(
            f"{name}.load_state_dict: the keys {list(sources)[:5]} of the original layout go through a conversion "
            f"({type(exc).__name__}: {exc}), which failed; load the checkpoint with from_pretrained instead"
        ) from exc
    if info.mismatched_keys:
        shown = "\n\t".join(
            f"{key}: converted {list(got)}, model {list(want)}" for key, got, want in info.mismatched_keys
        )
        raise RuntimeError(f"Error(s) in loading state_dict for {name}:\n\tsize mismatch for {shown}")
    produced = {
        key: value for key, value in shadow.state_dict().items() if key not in info.missing_keys and not value.is_meta
    }
    # which source keys the produced tensors stand for: the same conversions reversed, on meta tensors
    covered = revert_weight_conversion(model, {key: value.to("meta") for key, value in produced.items()})
    lost = [key for key in sources if key not in covered]
    if lost:
        raise WeightLayoutError(
            f"{name}.load_state_dict: the keys {lost[:5]} of the original layout reach no weight of the model "
            "through the conversions it was loaded with (a partial group: all the experts, or all the parts of "
            "a fused weight, must be in the state dict); pass them all, or load with from_pretrained"
        )
    return produced


def _guarded_load_state_dict(
    self: Any, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> Any:
    return load_original_layout(self, state_dict, strict, assign)


class LoadGuard:
    """A patched model's ``load_state_dict``: both layouts (``load_original_layout``).

    A bound-method look-alike that pickles with the model, as ``layout.SaveGuard``.
    """

    __slots__ = ("__self__",)
    __func__ = staticmethod(_guarded_load_state_dict)

    def __init__(self, model: nn.Module) -> None:
        self.__self__ = model

    def __call__(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return _guarded_load_state_dict(self.__self__, state_dict, strict, assign)

    def __reduce__(self) -> tuple[type, tuple[nn.Module]]:
        return (LoadGuard, (self.__self__,))


def guard_loading(model: nn.Module) -> None:
    """Make ``model.load_state_dict`` accept the original layout (this instance only)."""
    object.__setattr__(model, "load_state_dict", LoadGuard(model))
    object.__setattr__(model, _LOAD_GUARD, True)
