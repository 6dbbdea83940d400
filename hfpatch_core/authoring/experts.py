"""Loading checkpoints that store the experts 3-D into per-expert ``nn.Linear`` modules, and saving them back.

A pack that holds a MoE model's experts as one module per expert (linear-experts, qwen-moe)
meets the 3-D layout twice: as the checkpoint's own (below), and as a second layout of
families whose checkpoints are per expert, which transformers' own experts class holds and
``save_pretrained(save_original_format=False)`` writes (``LoadOnlySplitConverter``).

Families such as gpt_oss, granitemoe or aria store each experts tensor as one
``[experts, ...]`` tensor (``mlp.experts.gate_up_proj``), which is what their experts
class holds, so transformers' conversion mapping has nothing to stack.  Here, one
converter per 3-D tensor splits it at load into one tensor per expert and projection
(``mlp.experts.<e>.gate_proj.weight`` and ``up_proj``, the gate/up halves cut as the
class cuts them, or gpt_oss's interleaved ``gate_up_proj`` kept whole; transposed or not:
every part a view of the loaded tensor, no copy), and its reverse stacks
them back on save, so that ``save_pretrained`` writes the tensor vanilla writes, under
the name vanilla writes (transformers' renamings of the 3-D tensor apply around it).

transformers' loader collects a converter's inputs under the *first* target key of the
renamed checkpoint key, which must be a parameter of the model; with a ``*`` target
(``experts.*.gate_proj.weight``: one per expert) it is not, and the tensor would be
dropped as unexpected.  ``SplitExpertsConverter`` names expert 0's key instead; the
operation then names every expert's.  Its reverse (a transformers-style stacking, with
``experts.*`` sources) is what transformers' own ``save_pretrained`` runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming

from ..errors import WeightLayoutError
from .families import describe_scheme
from .sized import pattern_name

__all__ = [
    "ExpertsSlicing",
    "LoadOnlySplitConverter",
    "SplitExperts",
    "SplitExpertsConverter",
    "StackExperts",
    "split_converters",
]


@dataclasses.dataclass(frozen=True)
class ExpertsSlicing:
    """How one 3-D experts tensor maps to its per-expert tensors.

    Attributes:
        transposed: each expert's matrix is stored ``[in, out]`` (an ``nn.Linear`` weight is ``[out, in]``).
        halves: ``"concatenated"`` (``[gate; up]`` rows, cut into two parts) or ``None`` (one
            part per tensor).  Interleaved gate/up (gate, up, gate, ...) is one part: the
            columns of a transposed block no GEMM reads in place, and a copy is what this
            split avoids.
    """

    transposed: bool = False
    halves: str | None = None

    def __post_init__(self) -> None:
        if self.halves not in (None, "concatenated"):
            raise ValueError(
                f"ExpertsSlicing.halves must be None or 'concatenated', got {self.halves!r}; interleaved gate/up "
                "is split as one part (halves=None) and kept whole per expert"
            )


def _single(input_dict: dict[str, Any], what: str) -> torch.Tensor:
    if len(input_dict) != 1:
        raise ValueError(f"{what} takes one 3-D experts tensor, got {sorted(input_dict)}")
    value = next(iter(input_dict.values()))
    tensor = value[0] if isinstance(value, list) else value
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} takes a tensor, got {type(tensor).__name__}")
    return tensor


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` on a storage of its own: the bytes it spans in its storage, no copy.

    The storage slice holds a reference to the whole storage (the 3-D tensor's, often a
    view of the memory-mapped checkpoint), so the bytes stay valid.  Each expert's tensor
    then is a tensor of its own to the tools that group tensors by storage: transformers'
    ``save_pretrained`` takes tensors sharing a storage for tied weights, and fails on a
    non-contiguous one (``_end_ptr`` flattens it with ``view(-1)``).
    """
    if view.numel() == 0 or view.device.type == "meta":
        return view
    last = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True))
    size = view.element_size()
    start = view.storage_offset() * size
    storage = view.untyped_storage()
    if start == 0 and (last + 1) * size == storage.nbytes():
        return view
    own = storage[start : start + (last + 1) * size]
    return view.new_empty(0).set_(own, 0, view.shape, view.stride())


class SplitExperts(ConversionOps):
    """A 3-D ``[experts, ...]`` tensor into one tensor per expert and part (the targets, ``*`` the expert).

    The targets are the per-expert patterns in the converter's order (gate then up for a
    gate/up tensor); each expert's slice is transposed if stored ``[in, out]`` and cut in
    halves as the class cuts it.  Reverse: ``StackExperts``.
    """

    def __init__(self, slicing: ExpertsSlicing) -> None:
        self.slicing = slicing

    def __repr__(self) -> str:
        return f"SplitExperts({self.slicing})"

    @torch.no_grad()
    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
    ) -> dict[str, Any]:
        tensor = _single(input_dict, "SplitExperts")
        parts = 2 if self.slicing.halves else 1
        if len(target_patterns) != parts or tensor.dim() < 2:
            raise ValueError(
                f"SplitExperts({self.slicing}) cuts a [experts, ...] tensor into {parts} part(s) per expert, "
                f"got a {tuple(tensor.shape)} tensor for targets {target_patterns}"
            )
        result: dict[str, torch.Tensor] = {}
        for expert in range(tensor.shape[0]):
            for pattern, piece in zip(target_patterns, self._pieces(tensor[expert]), strict=True):
                result[pattern.replace("*", str(expert), 1)] = _own_storage(piece)
        return result

    def _pieces(self, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One expert's parts, as views of ``value``.

        The loader hands over the checkpoint's tensor as a view of the memory-mapped file,
        as vanilla keeps it: a view costs no copy and reads no page until a forward does.
        A transposed part is the ``.t()`` view of the stored ``[in, out]`` block, whose
        ``F.linear`` is a plain GEMM on the stored layout (no copy per call); concatenated
        halves are column blocks of it (or row blocks, untransposed).
        """
        transposed = self.slicing.transposed and value.dim() == 2
        if self.slicing.halves is None:
            return (value.t() if transposed else value,)
        if transposed:  # [in, 2 * out]: the halves are column blocks, each a transposed view
            first, second = value.chunk(2, dim=-1)
            return first.t(), second.t()
        return tuple(value.chunk(2, dim=0))

    @property
    def reverse_op(self) -> ConversionOps:
        return StackExperts(self.slicing)


def _refuse_quantized(kwargs: dict[str, Any], target_pattern: str) -> None:
    """Refuse to stack a quantized linear's tensors (``weight_packed``, ``weight_scale``, ...) into one 3-D tensor.

    transformers matches ``experts.*.gate_proj.weight`` by prefix, so a quantized model's
    ``weight_packed`` reaches this reverse too; stacked, it would be saved under a name
    (``gate_up_proj_packed``) that neither transformers nor vLLM reads.  Raised while the
    save guard runs the conversions on meta tensors, before anything is written.
    """
    full = kwargs.get("full_layer_name")
    if not isinstance(full, str):
        return
    stem = pattern_name(target_pattern).rsplit(".", 1)[-1]
    last = full.rsplit(".", 1)[-1]
    if last == stem or not last.startswith(stem):
        return
    raise WeightLayoutError(
        f"{full}: the per-expert linears are quantized ({describe_scheme(kwargs.get('model'), kwargs.get('config'))}), "
        f"and the checkpoint of this family stores its experts 3-D ({pattern_name(target_pattern)}), which holds no "
        "quantized tensors. Nothing was written; save the per-expert layout with "
        "save_pretrained(..., save_original_format=False), which transformers loads with the pack."
    )


class StackExperts(ConversionOps):
    """Per-expert tensors (the sources, ``*`` the expert, in expert order) back into the 3-D tensor.

    What ``save_pretrained`` runs to write the checkpoint's layout: the parts of each
    expert joined as the class joins them, transposed back, stacked.  Reverse: ``SplitExperts``.
    """

    def __init__(self, slicing: ExpertsSlicing) -> None:
        self.slicing = slicing

    def __repr__(self) -> str:
        return f"StackExperts({self.slicing})"

    @torch.no_grad()
    def convert(
        self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str], **kwargs: Any
    ) -> dict[str, Any]:
        if len(target_patterns) != 1:
            raise ValueError(f"StackExperts writes one 3-D tensor, got targets {target_patterns}")
        _refuse_quantized(kwargs, target_patterns[0])
        # the parts in the converter's order (gate, then up), whatever order the dict holds them in
        lists = [input_dict.pop(pattern) for pattern in source_patterns if pattern in input_dict]
        lists = [value if isinstance(value, list) else [value] for value in lists]
        if len(lists) != (2 if self.slicing.halves else 1) or input_dict or len({len(v) for v in lists}) != 1:
            raise ValueError(
                f"StackExperts({self.slicing}) needs every expert's {source_patterns}, got "
                f"{[len(v) for v in lists]} tensor(s) per part and {sorted(input_dict)} left over"
            )
        experts = []
        for pieces in zip(*lists, strict=True):
            if self.slicing.halves == "concatenated":
                value = torch.cat(pieces, dim=0)
            else:
                (value,) = pieces
            if self.slicing.transposed and value.dim() == 2:
                value = value.t()
            experts.append(value)
        return {target_patterns[0]: torch.stack(experts, dim=0).contiguous()}

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitExperts(self.slicing)


class SplitExpertsConverter(WeightConverter):
    """A ``WeightConverter`` whose ``*`` targets load: the renamed key is expert 0's, a parameter of the model.

    transformers collects a converter's input under the first target pattern with the
    source's prefix; ``experts.*.gate_proj.weight`` is no parameter, so the key is named
    ``experts.0.gate_proj.weight`` instead, and the operation names all of them.  The
    reverse (``experts.*`` sources, one 3-D target) needs no change: transformers' own
    stacking converters have that shape.
    """

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        renamed, pattern = super().rename_source_key(source_key)
        if pattern is not None and len(self.source_patterns) == 1 and "*" in self.target_patterns[0]:
            renamed = renamed.replace("*", "0", 1)
        return renamed, pattern


#: A key no checkpoint or model has (a ``-`` never occurs in a parameter name): the pattern of
#: ``LoadOnlySplitConverter``'s reverse, which therefore renames nothing.
_NO_KEY = "hfpatch-load-only-no-key"


class LoadOnlySplitConverter(SplitExpertsConverter):
    """A ``SplitExpertsConverter`` for a second layout at load only: a save writes what the model holds.

    For families whose checkpoints store the experts per expert (mixtral, qwen3_moe),
    transformers' own ``save_pretrained(save_original_format=False)`` and the state dict of
    an unpatched model hold the experts stacked 3-D, as its experts class does; vanilla
    loads both.  This converter splits such a stacked tensor into the per-expert modules at
    load; the per-expert keys of the original layout load unchanged, and are what a save
    writes, so its reverse is a renaming that matches no key (a save stacking them would
    write the other layout).  hfpatch's save guard makes a model loaded from the stacked
    layout save with all of its conversions reversed (the renamings of the original layout
    included, which such a load did not use): the original layout.
    """

    def reverse_transform(self) -> WeightRenaming:
        return WeightRenaming(source_patterns=_NO_KEY, target_patterns=_NO_KEY)


def split_converters(
    path: str, parameters: dict[str, tuple[tuple[str, ...], ExpertsSlicing]], *, load_only: bool = False
) -> list[SplitExpertsConverter]:
    """One converter per 3-D tensor of the experts at ``path`` (``"mlp.experts"``).

    Args:
        path: the experts module's attribute path under its decoder layer, as the
            checkpoint's keys end (after transformers' renamings).
        parameters: per 3-D parameter name (``"gate_up_proj"``), the per-expert suffixes
            it is cut into, in order (``("gate_proj.weight", "up_proj.weight")``), and how.
        load_only: the stacked tensors are a second layout the model loads, not the one
            it saves (``LoadOnlySplitConverter``).
    """
    kind = LoadOnlySplitConverter if load_only else SplitExpertsConverter
    converters = []
    for name, (suffixes, slicing) in parameters.items():
        # a name boundary, not an anchor: transformers drops lookarounds when it reverses the pattern
        source = f"{path}.{name}(?!\\w)"
        targets = [f"{path}.*.{suffix}" for suffix in suffixes]
        converters.append(kind(source, targets, operations=[SplitExperts(slicing)]))
    return converters
