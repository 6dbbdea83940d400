"""How each tensor of a quantized linear fuses and splits: compressed-tensors' tensor families.

llm-compressor saves a quantized ``nn.Linear`` in compressed-tensors' format (what vLLM
serves) as a family of tensors in place of, or beside, its ``weight``:

* ``weight_packed``: 4- or 8-bit integers packed into ``int32`` (or FP4 into ``uint8``)
  along the input dimension, one row per output row;
* ``weight_scale`` / ``weight_zero_point``: one row per output row (per channel, or per
  group of inputs), a zero point packed eight rows to an ``int32`` row; or one number for
  the whole tensor (FP8's per-tensor scale);
* ``weight_shape``: the unpacked ``[out, in]``, a 1-D record;
* ``weight_g_idx``, ``weight_global_scale``: one per input column, one per tensor;
* ``input_scale`` / ``input_zero_point`` / ``input_global_scale``: the static activation
  parameters, one per tensor.

transformers matches a converter's patterns by prefix, so a converter written for
``q_proj.weight`` is handed each member of ``q_proj``'s family in a call of its own (the
converted key's last component names the member), and a converter written for
``q_proj.input_`` the activation members.  ``fuse_member`` / ``split_member`` do for one
member what ``SizedConcatenate`` / ``SizedSplit`` do for the weight, exactly and both
ways, or refuse with a ``WeightLayoutError`` that names the tensor and the scheme.  Parts
fused along their output rows (``dim=0``: q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``) read the same input, so what is one per input or per tensor must be
equal in every part to be held once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import WeightLayoutError

__all__ = ["PLAIN", "describe_scheme", "fuse_member", "fused_quantization_problem", "member_of", "split_member"]

#: The members ``SizedConcatenate`` / ``SizedSplit`` fuse as tensors of rows (what they always did).
PLAIN = frozenset({"weight", "bias"})
#: One row (or a packed row) per output row; one number when quantized per tensor.
_ROWS = frozenset({"weight_packed", "weight_scale", "weight_zero_point"})
#: The 1-D ``[out, in]`` record of the unpacked weight.
_RECORD = frozenset({"weight_shape"})
#: One value for the input or the whole tensor, the same in every part of a fused linear.
_SHARED = frozenset({"weight_g_idx", "weight_global_scale", "input_scale", "input_zero_point", "input_global_scale"})
#: The activation members' common prefix: the pattern of a converter for them (``q_proj.input_``).
ACTIVATIONS = "input_"


def member_of(full_name: Any) -> str:
    """The member a converted key names: its last component (``weight_packed`` of
    ``model.layers.0.self_attn.qkv_proj.weight_packed``); ``"weight"`` when the loader
    passed no name (what every member was before quantized checkpoints)."""
    if not isinstance(full_name, str) or not full_name:
        return "weight"
    return full_name.rsplit(".", 1)[-1]


def _get(args: Any, name: str) -> Any:
    value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
    return getattr(value, "value", value)  # compressed-tensors' enums


def _describe_args(args: Any, *, activations: bool = False) -> str:
    if not args:
        return "unquantized"
    bits, kind, strategy, group = (_get(args, name) for name in ("num_bits", "type", "strategy", "group_size"))
    text = f"{bits}-bit {kind} per {strategy}" + (f" of {group}" if strategy == "group" and group else "")
    if activations:
        text += " (static)" if _get(args, "dynamic") in (None, False) else " (dynamic)"
    return text


def _scheme_object(model: Any, names: Sequence[str]) -> Any:
    """The ``quantization_scheme`` compressed-tensors set on the first of the modules ``names`` (a parameter's)."""
    for name in names:
        try:
            module = model.get_submodule(name.rpartition(".")[0])
        except (AttributeError, TypeError):
            continue
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            return scheme
    return None


def describe_scheme(model: Any = None, config: Any = None, names: Sequence[str] = ()) -> str:
    """The quantization scheme of the tensors ``names`` in one phrase, for an error message:
    ``compressed-tensors pack-quantized: weights 4-bit int per group of 128, activations
    unquantized``; read from the module's ``quantization_scheme`` (a model llm-compressor
    quantized), else the config's ``quantization_config`` (a quantized checkpoint)."""
    scheme = _scheme_object(model, names) if model is not None else None
    quantization = _quantization_dict(config)
    method = quantization.get("quant_method", "compressed-tensors")
    form = _get(scheme, "format") if scheme is not None else None
    form = form or quantization.get("format") or ""
    if scheme is None:
        groups = quantization.get("config_groups") or {}
        scheme = next(iter(groups.values()), None)
    if scheme is None:
        return f"{method} {form}".strip()
    weights = _describe_args(_get(scheme, "weights"))
    activations = _describe_args(_get(scheme, "input_activations"), activations=True)
    return f"{method} {form}".strip() + f": weights {weights}, activations {activations}"


def _quantization_dict(config: Any) -> Mapping[str, Any]:
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, Mapping):
        to_dict = getattr(quantization, "to_dict", None)
        quantization = to_dict() if callable(to_dict) else vars(quantization)
    return quantization or {}


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' match of one target (``is_match``) for an ``nn.Linear`` named ``name``:
    ``re:`` a regex from the name's start, else the whole name or a class in ``nn.Linear``'s bases."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target in (name, "Linear", "Module")


def _quantized_as(name: str, groups: Mapping[str, Any], ignore: Sequence[str]) -> tuple[str, ...]:
    """The config groups compressed-tensors applies to the ``nn.Linear`` ``name`` (none where ignored)."""
    if any(_matches(name, target) for target in ignore):
        return ()
    found = []
    for group, scheme in groups.items():
        targets = _get(scheme, "targets") or ()
        if any(_matches(name, target) for target in ([targets] if isinstance(targets, str) else targets)):
            found.append(group)
    return tuple(found)


def fused_quantization_problem(config: Any, fused: str, parts: Sequence[str]) -> str | None:
    """Why a quantized checkpoint's linears ``parts`` cannot load as one quantized linear ``fused``, or ``None``.

    A checkpoint of ``config`` with no ``quantization_config`` has no such problem.  One
    quantized by compressed-tensors (``quant_method: compressed-tensors``) loads fused when
    compressed-tensors quantizes ``fused`` (an ``nn.Linear`` by that name) with the config
    groups it gives each part, the same for every part (its ``config_groups`` targets and its
    ``ignore`` list, matched as compressed-tensors matches them); its tensor families then
    fuse and split as ``fuse_member`` / ``split_member`` do.  Any other quantization method
    (GPTQ, AWQ, bitsandbytes, torchao) replaces linears by modules of its own, which hfpatch does
    not fuse.

    Args:
        config: the checkpoint's config.
        fused: the fused linear's module name (``model.layers.0.self_attn.qkv_proj``).
        parts: the parts' module names, in row order.

    Returns:
        The reason, for a refusal; ``None`` where the parts load fused.
    """
    quantization = _quantization_dict(config)
    if not quantization:
        return None
    method = quantization.get("quant_method", "")
    if method != "compressed-tensors":
        return (
            f"a checkpoint quantized by {method or 'an unknown method'}, whose modules replace each linear; "
            "hfpatch fuses compressed-tensors' tensor families only"
        )
    if quantization.get("transform_config"):
        return "a compressed-tensors checkpoint with transforms (rotations per linear), which hfpatch does not fuse"
    groups = quantization.get("config_groups") or {}
    ignore = quantization.get("ignore") or ()
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    wanted = {part: _quantized_as(part, groups, ignore) for part in parts}
    if len(set(wanted.values())) > 1:
        described = ", ".join(
            f"{part.rsplit('.', 1)[-1]}: {list(found) or 'unquantized'}" for part, found in wanted.items()
        )
        return f"its quantization config quantizes the parts differently ({described}); one fused linear has one scheme"
    found = _quantized_as(fused, groups, ignore)
    expected = next(iter(wanted.values()), ())
    if found != expected:
        return (
            f"its quantization config quantizes {fused.rsplit('.', 1)[-1]} as {list(found) or 'unquantized'}, not as "
            f"its parts ({list(expected) or 'unquantized'}): its targets or ignore list name the parts"
        )
    return None


def _refuse(what: str, keys: Sequence[str], model: Any, config: Any, names: Sequence[str]) -> WeightLayoutError:
    return WeightLayoutError(
        f"{', '.join(keys)}: {what} ({describe_scheme(model, config, names)}). Nothing was converted; load or "
        "save this checkpoint without the pack, or quantize the model with a scheme the pack converts "
        "(per-channel or per-group weights: W4A16, W8A16, W8A8, FP8_DYNAMIC)."
    )


def _meta(tensors: Sequence[torch.Tensor]) -> bool:
    return any(tensor.device.type == "meta" for tensor in tensors)


def _ratio(rows: Sequence[int], sizes: Sequence[int]) -> int | None:
    """The one integer ``k`` with ``rows[i] * k == sizes[i]`` for every part (packed rows: 8), else None."""
    if not rows or rows[0] <= 0 or sizes[0] % rows[0]:
        return None
    k = sizes[0] // rows[0]
    return k if all(row * k == size for row, size in zip(rows, sizes, strict=True)) else None


def fuse_member(
    member: str,
    tensors: Sequence[torch.Tensor],
    sizes: Sequence[int],
    dim: int,
    keys: Sequence[str],
    *,
    model: Any = None,
    config: Any = None,
    target: str = "",
) -> torch.Tensor:
    """The fused ``member`` of the parts' families (``tensors``, in ``sizes`` order), as ``SizedConcatenate`` fuses
    weights.

    Raises:
        WeightLayoutError: the member cannot be held fused exactly (per-tensor scales that
            differ between the parts, a member hfpatch does not know, parts fused along
            their inputs), naming ``keys`` (the checkpoint tensors) and the scheme.
    """
    names = [target, *keys]
    if dim != 0:
        raise _refuse(f"quantized tensors ({member}) of parts fused along dim {dim}", keys, model, config, names)
    if len(tensors) != len(sizes):
        raise _refuse(
            f"the checkpoint has {len(tensors)} of the {len(sizes)} parts' {member}", keys, model, config, names
        )
    if member in _RECORD:
        if any(tensor.dim() != 1 or tensor.numel() != 2 for tensor in tensors):
            raise _refuse(f"{member} is not an [out, in] record", keys, model, config, names)
        if _meta(tensors):
            return tensors[0].new_empty((2,))
        records = [[int(value) for value in tensor.tolist()] for tensor in tensors]
        if [record[0] for record in records] != list(sizes) or len({record[1] for record in records}) != 1:
            raise _refuse(
                f"the parts' {member} records {records} do not fit sizes {list(sizes)} of one input",
                keys,
                model,
                config,
                names,
            )
        return torch.tensor([sum(sizes), records[0][1]], dtype=tensors[0].dtype)
    if member in _SHARED or (member in _ROWS and all(tensor.numel() == 1 for tensor in tensors)):
        if not _meta(tensors) and not all(torch.equal(tensors[0], tensor) for tensor in tensors[1:]):
            values = [tensor.flatten()[:1].tolist() for tensor in tensors]
            raise _refuse(
                f"{member} differs between the parts ({values}); the fused linear holds one for all of them",
                keys,
                model,
                config,
                names,
            )
        return tensors[0].clone()
    if member in _ROWS:
        rows = [int(tensor.shape[0]) if tensor.dim() else 0 for tensor in tensors]
        if _ratio(rows, sizes) is None:
            raise _refuse(
                f"{member} has {rows} rows, not the parts' sizes {list(sizes)} (or a common fraction of them)",
                keys,
                model,
                config,
                names,
            )
        return torch.cat(list(tensors), dim=0)
    raise _refuse(f"hfpatch does not know how to fuse the quantized tensor {member!r}", keys, model, config, names)


def split_member(
    member: str,
    tensor: torch.Tensor,
    sizes: Sequence[int],
    dim: int,
    key: str,
    *,
    model: Any = None,
    config: Any = None,
    fused: str = "",
) -> list[torch.Tensor]:
    """The parts' ``member`` (in ``sizes`` order) from the fused one, as ``SizedSplit`` splits weights.

    ``key`` is the first part's key, ``fused`` the fused tensor's (whose module holds the scheme).

    Raises:
        WeightLayoutError: the fused ``member`` does not split exactly, naming ``key`` and the scheme.
    """
    keys, names = [key], [fused, key]
    if dim != 0:
        raise _refuse(f"quantized tensors ({member}) of parts fused along dim {dim}", keys, model, config, names)
    if member in _RECORD:
        if tensor.dim() != 1 or tensor.numel() != 2:
            raise _refuse(f"{member} is not an [out, in] record", keys, model, config, names)
        if tensor.device.type == "meta":
            return [tensor.new_empty((2,)) for _ in sizes]
        out, inputs = (int(value) for value in tensor.tolist())
        if out != sum(sizes):
            raise _refuse(f"{member} records {out} rows, not {sum(sizes)}", keys, model, config, names)
        return [torch.tensor([size, inputs], dtype=tensor.dtype) for size in sizes]
    if member in _SHARED or (member in _ROWS and tensor.numel() == 1):
        return [tensor.clone() for _ in sizes]
    if member in _ROWS:
        rows = int(tensor.shape[0]) if tensor.dim() else 0
        ratio = sum(sizes) // rows if rows and not sum(sizes) % rows else None
        if ratio is None or any(size % ratio for size in sizes):
            raise _refuse(
                f"{member} has {rows} rows, which do not split into the parts' sizes {list(sizes)}",
                keys,
                model,
                config,
                names,
            )
        return [part.contiguous() for part in torch.split(tensor, [size // ratio for size in sizes], dim=0)]
    raise _refuse(f"hfpatch does not know how to split the quantized tensor {member!r}", keys, model, config, names)
