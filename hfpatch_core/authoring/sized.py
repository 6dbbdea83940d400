"""Exactly reversible fusing operations for converters: ``SizedConcatenate`` and ``SizedSplit``.

transformers' ``Concatenate`` cannot be reversed without the sizes of its parts, so a pack
that fuses tensors of different sizes (q and a smaller k/v) uses these: each records the
sizes and splits back exactly on save.  Under transformers' sharded loads (tensor
parallelism, FSDP2) they cut each rank's share of the fused tensor from the checkpoint's
parts, and release the checkpoint pages they read (``_pages``).  A quantized checkpoint's
tensors (compressed-tensors' ``weight_packed``, ``weight_scale``, ``weight_shape``,
``input_scale``, ...) fuse and split member by member (``families``);
``fused_linear_converters`` builds the converters of a whole family.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Sequence
from typing import Any

from transformers.core_model_loading import ConversionOps, WeightConverter

from ..errors import InvalidPatchError
from ._pages import release, trim_heap
from .families import ACTIVATIONS, PLAIN, fuse_member, member_of, split_member

__all__ = ["SizedConcatenate", "SizedSplit", "fused_linear_converters"]


#: model being loaded -> the parts of fused tensors a ``SizedConcatenate`` did not find in the
#: checkpoint (``parts_not_in_checkpoint``).  transformers gives a conversion
#: no way to report a key of its own: ``missing_keys`` holds the model's parameter names only
#: (its ``_move_missing_keys_from_meta_to_device`` looks each one up), and any conversion
#: error fails the whole load.
_NOT_IN_CHECKPOINT: weakref.WeakKeyDictionary[Any, list[PartNotInCheckpoint]] = weakref.WeakKeyDictionary()

#: What a source or target pattern holds besides the name it matches: look-arounds (hfpatch's
#: ``(?!@llama)`` marks, transformers' own), anchors.
_NOT_A_NAME = re.compile(r"\(\?<?[!=][^)]*\)|^\^|\$$")


def pattern_name(pattern: str) -> str:
    """The name a converter's source or target ``pattern`` matches, as a checkpoint spells it:
    look-arounds and anchors dropped, escaped dots plain (``self_attn.k_proj.weight(?!@llama)``
    -> ``self_attn.k_proj.weight``)."""
    return _NOT_A_NAME.sub("", pattern).replace("\\.", ".")


def _checkpoint_key(full_target: str | None, target_pattern: str, source_pattern: str) -> str:
    """The checkpoint key of ``source_pattern`` whose tensor makes ``full_target`` (a parameter
    name the target pattern matches): ``model.layers.0.self_attn.k_proj.weight`` for
    ``model.layers.0.self_attn.qkv_proj.weight``; the source's name alone where the target
    is not in it."""
    target, source = pattern_name(target_pattern), pattern_name(source_pattern)
    if not full_target or target not in full_target:
        return source
    prefix, _, suffix = full_target.partition(target)
    return prefix + source + suffix


@dataclasses.dataclass(frozen=True)
class PartNotInCheckpoint:
    """A part of a fused parameter that the checkpoint lacks, which ``SizedConcatenate`` zero-filled.

    Attributes:
        key: the checkpoint key it would have had (``model.layers.0.self_attn.k_proj.weight``).
        target: the model's fused parameter (``model.layers.0.self_attn.qkv_proj.weight``).
        dim: the dimension the parts are concatenated along.
        start: where the part starts along ``dim``.
        size: its size along ``dim``.
    """

    key: str
    target: str
    dim: int
    start: int
    size: int


def parts_not_in_checkpoint(model: Any) -> list[PartNotInCheckpoint]:
    """The fused parts that ``SizedConcatenate`` did not find in the checkpoint while loading
    ``model`` (left zero), forgotten once read.  hfpatch's load check calls it after each
    patched ``from_pretrained``, initialises them as the model initialises a missing weight
    and reports their keys as transformers reports a missing key (``missing_keys``, a
    warning; an error in strict mode)."""
    return _NOT_IN_CHECKPOINT.pop(model, [])


def _sizes(sizes: Sequence[int], what: str) -> tuple[int, ...]:
    values = tuple(sizes)
    if not values or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in values):
        raise InvalidPatchError(f"{what}: sizes must be positive ints, one per part, got {sizes!r}.")
    return values


def _rank_shares(found: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """Whether ``found`` is each of ``sizes`` divided by one number of ranks of the running process group.

    In a sharded load transformers reads each source tensor of a converter already cut to
    the fused parameter's placement on this rank: under tensor parallelism (``colwise``)
    every part arrives as this rank's rows of it, and their concatenation is exactly this
    rank's shard of the fused parameter (its own heads of q, of k and of v).
    """
    import torch.distributed as dist

    if len(found) != len(sizes) or not dist.is_available() or not dist.is_initialized():
        return False
    shards, rest = divmod(sizes[0], found[0]) if found[0] else (0, 1)
    return (
        not rest
        and shards > 1
        and dist.get_world_size() % shards == 0
        and all(part * shards == size for part, size in zip(found, sizes, strict=True))
    )


#: The device-mesh dimensions of FSDP2 sharding (transformers 5.25's ``initialize_distributed_mesh``;
#: ``efsdp`` shards the experts when expert parallelism is on too).
_FSDP_MESH_DIMS = frozenset({"fsdp", "efsdp"})


def _shard_start(size: int, ranks: int, rank: int) -> int:
    """The first of ``size`` rows that ``rank``'s ``Shard`` over ``ranks`` holds (``torch.chunk``'s cut)."""
    return min(rank * -(-size // ranks), size)


def _shard_length(size: int, ranks: int, rank: int) -> int:
    """How many of ``size`` rows ``rank``'s ``Shard`` over ``ranks`` holds (``torch.chunk``'s cut)."""
    return _shard_start(size, ranks, rank + 1) - _shard_start(size, ranks, rank)


def _fully_sharded_target(model: Any, name: Any, dim: int) -> Any:
    """The target parameter, when FSDP2 shards it along ``dim`` (``None`` otherwise).

    Under FSDP2, unlike tensor parallelism, the parameter is all-gathered whole for
    each forward: its shard on a rank must be a contiguous cut of the *fused* tensor
    (rank 0 of two holds all of q, rank 1 k and v), not a concatenation of each part's
    share, which is what transformers reads for each source tensor.

    Raises:
        ValueError: tensor parallelism shards the same dimension too (a 2-D mesh), which
            no fused layout of a rank's share fits.
    """
    parameter = _target_tensor(model, name)
    if parameter is None:
        return None
    placements = getattr(parameter, "placements", None)
    mesh = getattr(parameter, "device_mesh", None)
    if placements is None or mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    sharding = [
        names[index] if index < len(names) else None
        for index, placement in enumerate(placements)
        if placement.is_shard() and placement.dim % parameter.ndim == dim % parameter.ndim
    ]
    if not any(name in _FSDP_MESH_DIMS for name in sharding):
        return None
    if len(sharding) > 1:
        raise ValueError(
            f"{name}: sharded along dim {dim} by FSDP2 and by {sharding} at once; a fused tensor of parts of "
            "different sizes cannot be sharded twice along the dimension it fuses. Load it with one of them."
        )
    return parameter


def _gathered(tensor: Any, size: int, dim: int, ranks: int, group: Any) -> Any:
    """The whole part of ``size`` rows along ``dim`` from each rank's ``Shard`` of it, on every rank of ``group``."""
    import torch
    import torch.distributed as dist

    step = -(-size // ranks)
    local = tensor.movedim(dim, 0).contiguous()  # gathered along the first dimension: the pieces are rows of one buffer
    if local.shape[0] < step:  # the last ranks' shards of an uneven cut are short: pad, then trim
        local = torch.cat([local, local.new_zeros((step - local.shape[0], *local.shape[1:]))])
    buffer = local.new_empty((ranks * step, *local.shape[1:]))
    dist.all_gather_into_tensor(buffer, local, group=group)
    return buffer[:size].movedim(0, dim)


def _whole_of_share(share: Any, size: int, dim: int, ranks: int, rank: int) -> Any:
    """The whole source part that ``share``, ``rank``'s ``Shard`` of it along ``dim``, is a view of (else ``None``).

    transformers reads a safetensors checkpoint through lazy slices of its memory map,
    and a rank's share is a view of the storage that holds the whole tensor in the file
    (``get_slice(name)[a:b]``): the other ranks' rows are in the same storage, and a view
    of them costs nothing until read, and then file pages that ``release`` gives back.
    It is used only when the storage holds exactly the whole tensor, row-major, with the
    share at its own offset; a share that is a copy (a cast to another dtype, a move to
    another device, an empty share) has a storage of its own and gives ``None``.
    """
    if share.numel() == 0:
        return None
    start = _shard_start(size, ranks, rank)
    shape = [*share.shape]
    shape[dim] = size
    strides = [1] * len(shape)
    for index in range(len(shape) - 2, -1, -1):
        strides[index] = strides[index + 1] * shape[index + 1]
    numel = strides[0] * shape[0]
    if (
        tuple(share.stride()) != tuple(strides)
        or share.storage_offset() != start * strides[dim]
        or share.untyped_storage().nbytes() != numel * share.element_size()
    ):
        return None
    return share.as_strided(shape, strides, 0)


def _every_rank_can(can: bool, device: Any, group: Any) -> bool:
    """Whether ``can`` holds on every rank of ``group`` (a one-number all-reduce, on every rank alike).

    Every rank calls it once per fused tensor, so that either none gathers or all do: a
    rank that read a copy makes every rank take ``_gathered``, whose collectives match.
    """
    import torch
    import torch.distributed as dist

    agreed = torch.tensor([int(can)], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return bool(agreed.item())


def _cut_of_gathered(tensors: list[Any], sizes: tuple[int, ...], dim: int, parameter: Any, what: str) -> Any:
    """This rank's FSDP2 shard of the fused tensor, from each part's shard as transformers read it.

    Where the shares are views of the memory-mapped checkpoint (a safetensors load in
    the checkpoint's dtype, on every rank), each rank copies its rows of the fused
    tensor from the whole parts in the file, with no collective but one agreement, and
    gives their file pages back.  Otherwise each part's shares are all-gathered over
    the FSDP2 group (every rank, every part, in the same order: the collectives match),
    one part held whole at a time, and the heap memory the gathered parts leave is
    given back.  Either way the cut is allocated once (``bench/load_memory.py --fsdp``).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = parameter.device_mesh
    names = tuple(mesh.mesh_dim_names)
    axis = next(
        index
        for index, placement in enumerate(parameter.placements)
        if placement.is_shard() and names[index] in _FSDP_MESH_DIMS
    )
    group, ranks, rank = mesh.get_group(axis), mesh.size(axis), mesh.get_local_rank(axis)
    expected = tuple(_shard_length(size, ranks, rank) for size in sizes)
    found = tuple(int(tensor.shape[dim]) for tensor in tensors)
    if found not in (expected, sizes):
        raise ValueError(
            f"{what}: under FSDP2 over {ranks} ranks, rank {rank} read parts of sizes {list(found)} along dim "
            f"{dim}; the converter expects them whole, {list(sizes)}, or as this rank's shards, {list(expected)}"
        )
    shape, offset = compute_local_shape_and_global_offset(parameter.shape, mesh, parameter.placements)
    start, length = int(offset[dim]), int(shape[dim])
    cut_shape = list(tensors[0].shape)
    cut_shape[dim] = length
    cut = tensors[0].new_empty(cut_shape)
    if found == sizes:  # read whole (on this rank at least): its shares, should the ranks gather
        firsts = (_shard_start(size, ranks, rank) for size in sizes)
        shares = [tensor.narrow(dim, first, n) for tensor, first, n in zip(tensors, firsts, expected, strict=True)]
        views: list[Any] = list(tensors)
    else:
        shares = tensors
        views = [_whole_of_share(tensor, size, dim, ranks, rank) for tensor, size in zip(tensors, sizes, strict=True)]
    local = all(view is not None for view in views)
    wholes = views if _every_rank_can(local, tensors[0].device, group) else None
    at = 0  # where the part starts in the fused tensor
    for index, (share, size) in enumerate(zip(shares, sizes, strict=True)):
        part = wholes[index] if wholes is not None else _gathered(share, size, dim, ranks, group)
        low, high = max(start, at), min(start + length, at + size)
        if low < high:
            cut.narrow(dim, low - start, high - low).copy_(part.narrow(dim, low - at, high - low))
        del part
        at += size
    if wholes is not None:
        release(wholes)  # the file pages of the whole parts, just copied: see pages.py
        return cut
    release(tensors)
    trim_heap()  # the gathered parts, freed: see pages.trim_heap
    return cut


class SizedConcatenate(ConversionOps):
    """Concatenate the source tensors along ``dim``; reverses to ``SizedSplit``.

    transformers' ``Concatenate`` reverses to ``Chunk``, which splits into equal parts:
    a grouped-query ``qkv_proj`` (query wider than key and value) would be saved with
    wrong shapes.  This operation knows the size of each part, checks them when loading
    and splits by them when saving.  In a load sharded by transformers the parts arrive
    as this rank's share of each.  Under tensor parallelism their concatenation is this
    rank's shard of the fused tensor (its own heads of q, k and v).  Under FSDP2, which
    all-gathers the fused parameter whole for each forward, the rank keeps its contiguous
    cut of the fused tensor (read from the whole parts the shares view in the
    memory-mapped checkpoint, or else from the gathered shares), so the gathered
    parameter (and a saved checkpoint) is the fused layout.

    Args:
        dim: the dimension to concatenate along.
        sizes: the size of each source along ``dim``, in source-pattern order (e.g.
            ``(num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)``).
    """

    def __init__(self, dim: int = 0, sizes: Sequence[int] = ()) -> None:
        self.dim = dim
        self.sizes = _sizes(sizes, "SizedConcatenate")

    def __repr__(self) -> str:
        return f"SizedConcatenate(dim={self.dim}, sizes={list(self.sizes)})"

    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
    ) -> dict[str, Any]:
        import torch

        if len(target_patterns) != 1:
            raise ValueError(f"{self!r} makes one tensor, got targets {target_patterns}")
        target = kwargs.get("full_layer_name")
        present = [pattern in input_dict for pattern in source_patterns]
        tensors = []
        for pattern in source_patterns:
            if pattern not in input_dict:
                continue
            value = input_dict.pop(pattern)
            tensors.extend(value if isinstance(value, list) else [value])
        keys = [_checkpoint_key(target, target_patterns[0], pattern) for pattern in source_patterns]
        member = member_of(target)
        if member not in PLAIN:  # a quantized linear's scale, packed weight, shape record, ...
            fused_member = fuse_member(
                member,
                tensors,
                self.sizes,
                self.dim,
                keys,
                model=kwargs.get("model"),
                config=kwargs.get("config"),
                target=str(target or ""),
            )
            release(tensors)
            return {target_patterns[0]: _in_model_dtype(fused_member, kwargs.get("model"), target)}
        found = tuple(int(tensor.shape[self.dim]) for tensor in tensors)
        if len(present) == len(self.sizes) and not all(present) and tensors:
            return {target_patterns[0]: self._with_parts_missing(tensors, present, keys, kwargs)}
        fully_sharded = _fully_sharded_target(kwargs.get("model"), target, self.dim)
        if fully_sharded is not None:
            fused = _cut_of_gathered(tensors, self.sizes, self.dim, fully_sharded, f"{self!r} for {keys}")
            return {target_patterns[0]: fused}
        if found != self.sizes and not _rank_shares(found, self.sizes):
            raise ValueError(
                f"{self!r}: the checkpoint tensors {keys} have sizes {list(found)} along dim {self.dim}; "
                f"the converter expects {list(self.sizes)} (a checkpoint of another configuration of the model?)"
            )
        fused = torch.cat(tensors, dim=self.dim)
        release(tensors)  # the checkpoint pages just copied: see pages.py
        return {target_patterns[0]: _in_model_dtype(fused, kwargs.get("model"), target)}

    def _with_parts_missing(self, tensors: list[Any], present: list[bool], keys: list[str], kwargs: Any) -> Any:
        """The fused tensor of a checkpoint that lacks some of its parts (``present``): the parts
        it has copied in, the others zero and recorded (``parts_not_in_checkpoint``) for the
        load check, which initialises and reports them as vanilla transformers initialises
        and reports a weight the checkpoint lacks.

        Raises:
            ValueError: a part it has is not of its size, or the load is sharded (a rank's
                share of a part cannot be told from a part of another size).
        """
        expected = tuple(size for size, here in zip(self.sizes, present, strict=True) if here)
        found = tuple(int(tensor.shape[self.dim]) for tensor in tensors)
        missing = [key for key, here in zip(keys, present, strict=True) if not here]
        there = [key for key, here in zip(keys, present, strict=True) if here]
        model = kwargs.get("model")
        if found != expected:
            raise ValueError(
                f"{self!r}: the checkpoint lacks {missing}, and its other parts {there} have sizes {list(found)} "
                f"along dim {self.dim}, not {list(expected)} (a checkpoint of another configuration of the model, "
                "or a sharded load: sharded, every part must be in the checkpoint)"
            )
        if _fully_sharded_target(model, kwargs.get("full_layer_name"), self.dim) is not None:
            raise ValueError(
                f"{self!r}: the checkpoint lacks {missing}; a load sharded by FSDP2 cuts each rank's rows of the "
                "fused tensor from every part, so every part must be in the checkpoint (load it on one process)"
            )
        target = str(kwargs.get("full_layer_name"))
        shape = list(tensors[0].shape)
        shape[self.dim] = sum(self.sizes)
        fused = tensors[0].new_zeros(shape)
        at, parts, absent = 0, iter(tensors), []
        for size, key, here in zip(self.sizes, keys, present, strict=True):
            if here:
                fused.narrow(self.dim, at, size).copy_(next(parts))
            else:
                absent.append(PartNotInCheckpoint(key, target, self.dim, at, size))
            at += size
        release(tensors)  # the checkpoint pages just copied: see pages.py
        if model is not None:
            _NOT_IN_CHECKPOINT.setdefault(model, []).extend(absent)
        return fused

    @property
    def reverse_op(self) -> ConversionOps:
        return SizedSplit(self.dim, self.sizes)


def _in_model_dtype(tensor: Any, model: Any, name: Any) -> Any:
    """``tensor`` in the dtype of the model's tensor ``name``, where both are floating point and differ.

    transformers loads a pre-quantized checkpoint's tensors that a converter builds in the
    checkpoint's dtype (``core_model_loading``: a renamed key of a pre-quantized load is read
    with ``dtype=None``), and the same tensors unconverted in the model's: a float32 checkpoint
    loaded in bfloat16 would give a fused linear float32 scales (and biases) beside the bfloat16
    ones of every other linear, and its forward would fail.  Elsewhere they are in the model's
    dtype already.
    """
    if not getattr(tensor, "is_floating_point", lambda: False)():
        return tensor
    expected = _target_tensor(model, name, buffers=True)
    if expected is not None and expected.is_floating_point() and expected.dtype != tensor.dtype:
        return tensor.to(expected.dtype)
    return tensor


def _target_tensor(model: Any, name: Any, *, buffers: bool = False) -> Any:
    """The model's parameter ``name`` a converter's output loads into (or buffer, with ``buffers``);
    ``None`` where the loader passed no model or name, or the model has no such tensor."""
    if model is None or not isinstance(name, str):
        return None
    for find in (model.get_parameter, model.get_buffer) if buffers else (model.get_parameter,):
        try:
            return find(name)
        except (AttributeError, TypeError):
            continue
    return None


class SizedSplit(ConversionOps):
    """Split one tensor along ``dim`` into parts of the given sizes; reverses to ``SizedConcatenate``."""

    def __init__(self, dim: int = 0, sizes: Sequence[int] = ()) -> None:
        self.dim = dim
        self.sizes = _sizes(sizes, "SizedSplit")

    def __repr__(self) -> str:
        return f"SizedSplit(dim={self.dim}, sizes={list(self.sizes)})"

    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
    ) -> dict[str, Any]:
        import torch

        if len(input_dict) != 1 or len(target_patterns) != len(self.sizes):
            raise ValueError(f"{self!r} splits one tensor into {len(self.sizes)}, got targets {target_patterns}")
        value = next(iter(input_dict.values()))
        tensor = value[0] if isinstance(value, list) else value
        key = kwargs.get("full_layer_name")
        member = member_of(key)
        if member not in PLAIN:  # a quantized linear's scale, packed weight, shape record, ...
            fused = str(key).replace(pattern_name(target_patterns[0]), pattern_name(source_patterns[0]))
            members = split_member(
                member,
                tensor,
                self.sizes,
                self.dim,
                str(key),
                model=kwargs.get("model"),
                config=kwargs.get("config"),
                fused=fused,
            )
            return dict(zip(target_patterns, members, strict=True))
        if int(tensor.shape[self.dim]) != sum(self.sizes):
            raise ValueError(
                f"{self!r}: tensor of shape {tuple(tensor.shape)} has {tensor.shape[self.dim]} along dim {self.dim}, "
                f"expected {sum(self.sizes)}"
            )
        parts = torch.split(tensor, list(self.sizes), dim=self.dim)
        return {target: part.contiguous() for target, part in zip(target_patterns, parts, strict=True)}

    @property
    def reverse_op(self) -> ConversionOps:
        return SizedConcatenate(self.dim, self.sizes)


def fused_linear_converters(
    path: str, parts: Sequence[str], fused: str, sizes: Sequence[int], *, bias: bool = False
) -> list[WeightConverter]:
    """The converters that fuse the ``nn.Linear`` children ``parts`` of the modules at ``path`` into ``fused``.

    One ``SizedConcatenate`` converter for the weights (their quantized tensors too:
    transformers matches the pattern ``q_proj.weight`` by prefix, so ``weight_packed``,
    ``weight_scale``, ``weight_shape``, ... reach it one at a time), one for the biases
    when ``bias``, and one for a quantized linear's static activation parameters
    (``input_scale``, ``input_zero_point``, ``input_global_scale``); ``save_pretrained``
    reverses each to an exact ``SizedSplit``.  A pattern no checkpoint tensor matches
    converts nothing.

    Args:
        path: the parent modules' attribute path as the checkpoint's keys spell it (``"self_attn"``).
        parts: the linears fused, in order (``("q_proj", "k_proj", "v_proj")``).
        fused: the fused linear's name (``"qkv_proj"``).
        sizes: each part's output rows, in order.
        bias: the parts have biases.
    """
    prefix = f"{path}." if path else ""
    suffixes = ("weight", "bias", ACTIVATIONS) if bias else ("weight", ACTIVATIONS)
    # operations= by keyword: the third positional field differs between 5.3 and later
    return [
        WeightConverter(
            source_patterns=[f"{prefix}{part}.{suffix}" for part in parts],
            target_patterns=f"{prefix}{fused}.{suffix}",
            operations=[SizedConcatenate(dim=0, sizes=sizes)],
        )
        for suffix in suffixes
    ]
