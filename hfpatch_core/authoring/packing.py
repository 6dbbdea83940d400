"""Packed modules: which original projections a fused one stands for, and showing them again.

A replacement class that fuses several ``nn.Linear`` children into one (``q_proj`` /
``k_proj`` / ``v_proj`` into ``qkv_proj``) declares it, as vLLM's
``packed_modules_mapping`` does::

    hfpatch_packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

and each instance records the output sizes of the parts, in row order, in
``hfpatch_packed_sizes`` (``hfpatch_core.authoring.fusion.fuse_projections`` does both for the
instance).  Tools that work by module name on the *original* names (PEFT's
``target_modules``, an adapter trained on an unpatched model) then get them back:
``expose_parts`` puts one ``PackedPart`` per original name next to the fused weight,
an ``nn.Linear`` whose weight and bias are views of the fused rows, so that PEFT
wraps it like the original projection; the fused module's forward (``packed_outputs``)
runs the parts one by one while any of them is wrapped, and the one fused matmul
otherwise.  The fused weight stays the only parameter: ``state_dict`` and saving are
unchanged.

Imported by its full name (``hfpatch_core.authoring.packing``): it imports torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import AdapterError

__all__ = [
    "PACKED_MODULES",
    "PACKED_SIZES",
    "PackedLinear",
    "PackedPart",
    "expose_parts",
    "exposed_parts",
    "full_shape",
    "gathered",
    "is_partitioned",
    "mark_exposed",
    "packed_modules",
    "packed_outputs",
    "record_sizes",
]

#: The class attribute declaring fused child name -> the original child names, in row order.
PACKED_MODULES = "hfpatch_packed_modules"
#: The instance attribute holding fused child name -> the parts' output sizes, in row order.
PACKED_SIZES = "hfpatch_packed_sizes"
#: The instance attribute set by ``expose_parts``: fused child name -> the part names shown.
_EXPOSED = "_hfpatch_exposed_parts"


def full_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of the whole of ``tensor``: its own, or the full shape of a parameter DeepSpeed ZeRO-3 partitioned.

    Under ZeRO-3 (``deepspeed.zero.Init``, or a model handed to ``deepspeed.initialize`` with stage 3)
    each rank's parameter is an empty placeholder (``shape == (0,)``) between the gathers of its
    module's forward; the full shape is ``ds_shape``.  Code that reads sizes from a parameter
    (an ``in_features``, a layout) reads them here.
    """
    shape = getattr(tensor, "ds_shape", None)
    return torch.Size(shape) if shape is not None else tensor.shape


def is_partitioned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter managed by DeepSpeed ZeRO-3 (``ds_id``): its values are
    spread over the ranks and must be gathered (``gathered``) before they are read or written."""
    return getattr(tensor, "ds_id", None) is not None


@contextlib.contextmanager
def gathered(tensors: Iterable[torch.Tensor | None], *, modifier_rank: int | None = None) -> Iterator[None]:
    """Inside: the ZeRO-3 parameters among ``tensors`` whole on every rank (``deepspeed.zero.GatheredParameters``).

    Every rank must enter it with the same parameters (it is a collective).  With
    ``modifier_rank=r`` what rank ``r`` writes into them is kept (sent to every rank's
    partition on exit); with ``None`` (the default) they are read only.  Where none of
    ``tensors`` is partitioned (no DeepSpeed, or ZeRO stage 0-2) it does nothing.
    """
    partitioned = [tensor for tensor in tensors if tensor is not None and is_partitioned(tensor)]
    if not partitioned:
        yield
        return
    import deepspeed  # only reached where DeepSpeed made the parameters

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank):
        yield


def packed_modules(module: nn.Module) -> Mapping[str, tuple[str, ...]]:
    """What ``module``'s class declares: fused child name -> original child names (empty if nothing)."""
    declared = getattr(type(module), PACKED_MODULES, None)
    return declared if isinstance(declared, Mapping) else {}


def record_sizes(module: nn.Module, fused: str, sizes: tuple[int, ...]) -> None:
    """Record on ``module`` the output sizes of the parts of its fused child ``fused``, in row order."""
    module.__dict__.setdefault(PACKED_SIZES, {})[fused] = tuple(sizes)


def exposed_parts(module: nn.Module) -> Mapping[str, tuple[str, ...]]:
    """The parts ``expose_parts`` put on ``module``: fused child name -> part names (empty before)."""
    exposed: Mapping[str, tuple[str, ...]] = module.__dict__.get(_EXPOSED, {})
    return exposed


def mark_exposed(module: nn.Module, fused: str, parts: Sequence[str]) -> None:
    """Record that ``module`` shows ``fused``'s parts under their own names already.

    For a module built with its parts in place (``hfpatch_core.authoring.views``):
    ``expose_parts`` then leaves ``fused`` as it is.
    """
    module.__dict__.setdefault(_EXPOSED, {})[fused] = tuple(parts)


class PackedLinear(nn.Module):
    """The fused projection while its parts are exposed: the same ``weight`` / ``bias`` parameters
    (the same objects, under the same names), but no longer an ``nn.Linear``, so that tools that
    look for every ``nn.Linear`` (PEFT's ``"all-linear"``) find the parts and not the fused matrix."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedPart(nn.Linear):
    """One original projection of a fused one: rows ``[start, stop)`` of the fused weight (and bias).

    An ``nn.Linear`` (PEFT wraps ``nn.Linear`` children) that owns no parameter: ``weight``
    and ``bias`` are views of the fused ones, read at each access, so that in-place
    updates (PEFT's ``merge``) write into the fused weight and the fused module's
    ``state_dict`` stays the checkpoint's.  Assigning a tensor of the part's shape to
    ``weight`` or ``bias`` copies it into those rows.
    """

    def __init__(self, fused: PackedLinear, start: int, stop: int) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would register parameters of its own
        # not a child: the fused module is its parent's, and its parameters must be listed once
        object.__setattr__(self, "_fused", fused)
        self._fused: PackedLinear
        self.start, self.stop = start, stop
        self.in_features = int(full_shape(fused.weight)[1])  # the full width under ZeRO-3 too
        self.out_features = stop - start

    @property
    def weight(self) -> torch.Tensor:
        weight: torch.Tensor = self._fused.weight[self.start : self.stop]
        return weight

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        self._assign(self.weight, value, "weight")

    @property  # type: ignore[override]
    def bias(self) -> torch.Tensor | None:
        bias: torch.Tensor | None = self._fused.bias
        return None if bias is None else bias[self.start : self.stop]

    @bias.setter
    def bias(self, value: torch.Tensor | None) -> None:
        current = self.bias
        if current is None or value is None:
            if current is not value:
                raise ValueError(f"{type(self).__name__}: cannot add or remove a bias of a fused projection's part")
            return
        self._assign(current, value, "bias")

    def _assign(self, current: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if value.data_ptr() == current.data_ptr() and value.shape == current.shape:
            return  # the same rows (PEFT reassigns a layer's own weight when it unwraps it)
        if value.shape != current.shape:
            raise ValueError(
                f"{type(self).__name__}.{name}: got a {list(value.shape)} tensor for rows "
                f"[{self.start}, {self.stop}) of a fused projection ({list(current.shape)})"
            )
        with torch.no_grad():
            current.copy_(value)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Refuse a tensor of its own: a part is rows of the fused weight and owns none.

        A tool that quantizes ``nn.Linear`` modules by adding tensors to them
        (compressed-tensors' ``weight_scale`` under llm-compressor's ``oneshot``) would act on
        a view whose forward reads the fused weight: it would calibrate and save scales of
        weights the model never quantizes.  ``weight`` / ``bias`` assigned as parameters are
        copied into the part's rows, as a tensor assigned to them is.
        """
        if name in ("weight", "bias") and param is not None:
            setattr(self, name, param.data)
            return
        raise AdapterError(
            f"{type(self).__name__} (rows [{self.start}, {self.stop}) of a fused projection) owns no tensor, so "
            f"{name!r} cannot be added to it: a tool that adds tensors to nn.Linear modules (a quantizer's scales: "
            "llm-compressor, compressed-tensors) would act on a view of the fused weight, not on what the forward "
            "computes. Quantize the model loaded without the pack that fused it (HF_PATCH_PACKS=all,-PACK), then "
            "load the quantized checkpoint with the pack where it loads quantized checkpoints fused (fused-dense "
            "does); vLLM fuses a quantized checkpoint's projections itself."
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.stop}) of the fused projection, in_features={self.in_features}"


def expose_parts(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Give ``module`` back its original projections, as ``PackedPart`` views of its fused ones.

    Each fused child ``nn.Linear`` declared in ``hfpatch_packed_modules`` becomes a
    ``PackedLinear`` holding the same parameters, and each original name a
    ``PackedPart``.  Idempotent.  The output is unchanged; ``packed_outputs`` runs the
    parts separately only once a tool has wrapped one of them.

    Returns:
        Fused child name -> the original names now exposed.

    Raises:
        TypeError: a fused child is not a plain ``nn.Linear`` with a floating-point
            weight (a quantized or already wrapped one cannot be split into views);
            ``module`` declares no sizes for it; or an original name is taken.
    """
    exposed: dict[str, tuple[str, ...]] = dict(exposed_parts(module))
    sizes_of: Mapping[str, tuple[int, ...]] = getattr(module, PACKED_SIZES, {})
    for fused, parts in packed_modules(module).items():
        if fused in exposed:
            continue
        linear = module._modules.get(fused)
        weight = getattr(linear, "weight", None)
        plain = type(weight) is nn.Parameter and type(weight.data) is torch.Tensor and weight.is_floating_point()
        if type(linear) is not nn.Linear or not plain:
            raise TypeError(
                f"{type(module).__name__}.{fused} is a {type(linear).__module__}.{type(linear).__qualname__}, not a "
                "plain nn.Linear with a floating-point weight (quantized?): "
                f"its parts {list(parts)} cannot be views of it"
            )
        sizes = tuple(sizes_of.get(fused, ()))
        if len(sizes) != len(parts) or sum(sizes) != linear.out_features:
            raise TypeError(
                f"{type(module).__name__} declares {fused} as {list(parts)} but records the sizes {list(sizes)} "
                f"for its {linear.out_features} rows; set {PACKED_SIZES}[{fused!r}] (fuse_projections does)"
            )
        taken = [part for part in parts if part in module._modules or part in module.__dict__]
        if taken:
            raise TypeError(f"{type(module).__name__} already has {taken}: cannot expose the parts of {fused}")
        holder = PackedLinear(linear)
        setattr(module, fused, holder)
        start = 0
        for part, size in zip(parts, sizes, strict=True):
            setattr(module, part, PackedPart(holder, start, start + size))
            start += size
        exposed[fused] = tuple(parts)
    module.__dict__[_EXPOSED] = exposed
    return exposed


def packed_outputs(module: nn.Module, fused: str, sizes: tuple[int, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of ``module``'s fused projection ``fused``, split into its parts.

    One matmul and a split, unless ``expose_parts`` showed the parts and a tool has
    wrapped one of them (a PEFT LoRA layer): then each part runs on its own, through
    whatever wraps it.

    Args:
        module: the fused module.
        fused: the fused child's name.
        sizes: the parts' output sizes, in row order.
        x: the input.

    Returns:
        One output per part, in row order.
    """
    parts = exposed_parts(module).get(fused)
    if parts is not None:
        children = [module._modules[part] for part in parts]
        if any(type(child) is not PackedPart for child in children):
            return tuple(child(x) for child in children)  # type: ignore[misc]
    output: torch.Tensor = getattr(module, fused)(x)
    return tuple(output.split(local_sizes(sizes, output.shape[-1]), dim=-1))


def local_sizes(sizes: Sequence[int], width: int) -> tuple[int, ...]:
    """The split sizes of a fused output ``width`` wide: ``sizes``, or this rank's share of each.

    Under tensor parallelism (``colwise``) each rank computes its shard of the fused
    output, which the converter built as each part's shard concatenated (``q_r; k_r;
    v_r``: its own heads of each), so the parts keep their proportions.

    Raises:
        ValueError: ``width`` is not ``sum(sizes)`` divided by a whole number that divides every size.
    """
    total = sum(sizes)
    if width == total:
        return tuple(sizes)
    shards, rest = divmod(total, width) if width else (0, 1)
    if rest or not shards or any(size % shards for size in sizes):
        raise ValueError(f"a fused output of width {width} is no whole share of parts {list(sizes)}")
    return tuple(size // shards for size in sizes)
