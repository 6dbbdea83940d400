"""The public authoring surface: what a pack may import from hfpatch_core beyond its top level.

A pack imports ``hfpatch_core`` (``Patch``, ``Converter``, ``LoadContext``, ``hookimpl``, the
errors) and this package; nothing under a leading underscore.  What is here is stable
within a minor release:

* ``sized``: ``SizedConcatenate`` / ``SizedSplit``, exactly reversible fusing of tensors of
  different sizes, with each rank's cut under transformers' sharded loads;
* ``packing``: packed modules, which original projections a fused one stands for
  (``PACKED_MODULES``, ``packed_outputs``, ``expose_parts``);
* ``fusion``: fusing ``nn.Linear`` projections that read the same input
  (``fuse_projections``, ``FusedQKVAttentionBase``, ``forward_for``);
* ``peft``: what PEFT sees of a patched model (``HIDDEN_FROM_ADAPTERS``);
* ``probes``: questions about the installed transformers (``class_keys_supported``, ...);
* ``source_patterns_of`` / ``target_patterns_of``: a transform's patterns as written.
"""

from __future__ import annotations

from ..conversion import source_patterns_of, target_patterns_of
from . import fusion, packing, peft, probes, sized
from .fusion import QKV_PROJECTIONS, FusedQKVAttentionBase, forward_for, fuse_projections, linear_like, local_sizes
from .packing import PACKED_MODULES, PACKED_SIZES, PackedLinear, PackedPart, packed_modules, packed_outputs
from .peft import HIDDEN_FROM_ADAPTERS
from .probes import class_keys_supported, parallel_modes
from .sized import SizedConcatenate, SizedSplit

__all__ = [
    "HIDDEN_FROM_ADAPTERS",
    "PACKED_MODULES",
    "PACKED_SIZES",
    "QKV_PROJECTIONS",
    "FusedQKVAttentionBase",
    "PackedLinear",
    "PackedPart",
    "SizedConcatenate",
    "SizedSplit",
    "class_keys_supported",
    "forward_for",
    "fuse_projections",
    "fusion",
    "linear_like",
    "local_sizes",
    "packed_modules",
    "packed_outputs",
    "packing",
    "parallel_modes",
    "peft",
    "probes",
    "sized",
    "source_patterns_of",
    "target_patterns_of",
]
