"""The public authoring surface: what a pack may import from hfpatch_core beyond its top level.

A pack imports ``hfpatch_core`` (``Patch``, ``Converter``, ``LoadContext``, ``hookimpl``, the
errors) and this package; nothing under a leading underscore.  What is here is stable
within a minor release:

* ``sized``: ``SizedConcatenate`` / ``SizedSplit``, exactly reversible fusing of tensors of
  different sizes, with each rank's cut under transformers' sharded loads, and
  ``fused_linear_converters``, the converters of fused linears' whole tensor families;
* ``families``: how each tensor of a quantized linear (compressed-tensors' ``weight_packed``,
  ``weight_scale``, ``weight_shape``, ``input_scale``, ...) fuses and splits (``fuse_member``,
  ``split_member``, ``describe_scheme``), and whether a checkpoint's linears can load fused
  (``fused_quantization_problem``);
* ``packing``: packed modules, which original projections a fused one stands for
  (``PACKED_MODULES``, ``packed_outputs``, ``expose_parts``);
* ``fusion``: fusing ``nn.Linear`` projections that read the same input
  (``fuse_projections``, ``FusedQKVAttentionBase``, ``forward_for``);
* ``views``: fusing them without re-writing the forward: the parts become views of one
  projection computed once per input (``fused_views_class``, ``fuse_as_views``,
  ``fusable_parts``, ``SharedProjection``, ``ProjectionView``; for a quantized checkpoint
  ``SharedLinear`` and ``OutputView``);
* ``experts``: loading experts stored 3-D (``[experts, ...]``, transformers' own layout) into
  one module per expert and saving them back (``split_converters``, ``ExpertsSlicing``,
  ``SplitExpertsConverter``, ``LoadOnlySplitConverter``, ``SplitExperts`` / ``StackExperts``);
* ``calibration``: what routed experts owe a quantizer's calibration: every expert sees every
  token (``calibrating_all_experts``, ``observed``, ``report_unrouted``);
* ``classes``: replacement classes built at runtime that pickle as the call that builds
  them (``runtime_class``);
* ``calls``: proving from a forward's source that it gives several children the same
  input (``same_input``);
* ``peft``: what PEFT sees of a patched model (``HIDDEN_FROM_ADAPTERS``);
* ``meta``: ``build_on_meta``, a model built on the meta device from inside a hook, as vanilla
  transformers builds it, and ``nested_loads``, its sub-models that load in loads of their own;
* ``shrink``: one instance of a real module class built with the load's config scaled down, to
  probe what it computes without its real sizes (``shrunk_instance``, ``shrunk_config``);
* ``probes``: questions about the installed transformers (``class_keys_supported``, ...);
* ``randomness``: ``isolated_rng``, a probe run on random generators of its own: the caller's
  seeded stream (torch's CPU and accelerator generators, ``random``, NumPy) is left as it was;
* ``drift``: the drift record a pack ships, what its replacements were built against
  (``DriftRecord``, ``Target``, ``compare``: what ``hfpatch check`` writes and compares);
* ``configs``: ``text_decoder_config``, the sub-config a composite model's decoder is built
  from (``get_text_config()`` raises where a model also has a text encoder);
* ``lists``: which of transformers' conversion lists a load reads (``conversion_key``,
  ``conversion_lists``);
* ``source_patterns_of`` / ``target_patterns_of``: a transform's patterns as written;
* ``release_pages``: give back the memory-mapped checkpoint pages a conversion has copied.
"""

from __future__ import annotations

from ..conversion import source_patterns_of, target_patterns_of
from . import (
    calibration,
    calls,
    classes,
    configs,
    drift,
    experts,
    families,
    fusion,
    lists,
    meta,
    packing,
    peft,
    probes,
    randomness,
    shrink,
    sized,
    views,
)
from ._pages import release as release_pages
from .calibration import calibrating_all_experts, observed, report_unrouted
from .calls import same_input
from .classes import RuntimeClassMeta, runtime_class
from .configs import text_decoder_config
from .experts import (
    ExpertsSlicing,
    LoadOnlySplitConverter,
    SplitExperts,
    SplitExpertsConverter,
    StackExperts,
    split_converters,
)
from .families import describe_scheme, fuse_member, fused_quantization_problem, member_of, split_member
from .fusion import QKV_PROJECTIONS, FusedQKVAttentionBase, forward_for, fuse_projections, linear_like, local_sizes
from .lists import conversion_key, conversion_lists
from .meta import build_on_meta, nested_loads
from .packing import PACKED_MODULES, PACKED_SIZES, PackedLinear, PackedPart, packed_modules, packed_outputs
from .peft import HIDDEN_FROM_ADAPTERS
from .probes import class_keys_supported, parallel_modes
from .randomness import isolated_rng
from .shrink import SHRUNK_SIZES, shrunk_config, shrunk_instance
from .sized import SizedConcatenate, SizedSplit, fused_linear_converters
from .views import (
    FusedViewsMixin,
    OutputView,
    ProjectionView,
    SharedLinear,
    SharedProjection,
    fusable_parts,
    fuse_as_views,
    fused_views_class,
)

__all__ = [
    "HIDDEN_FROM_ADAPTERS",
    "PACKED_MODULES",
    "PACKED_SIZES",
    "QKV_PROJECTIONS",
    "SHRUNK_SIZES",
    "ExpertsSlicing",
    "FusedQKVAttentionBase",
    "FusedViewsMixin",
    "LoadOnlySplitConverter",
    "OutputView",
    "PackedLinear",
    "PackedPart",
    "ProjectionView",
    "RuntimeClassMeta",
    "SharedLinear",
    "SharedProjection",
    "SizedConcatenate",
    "SizedSplit",
    "SplitExperts",
    "SplitExpertsConverter",
    "StackExperts",
    "build_on_meta",
    "calibrating_all_experts",
    "calibration",
    "calls",
    "class_keys_supported",
    "classes",
    "configs",
    "conversion_key",
    "conversion_lists",
    "describe_scheme",
    "drift",
    "experts",
    "families",
    "forward_for",
    "fusable_parts",
    "fuse_as_views",
    "fuse_member",
    "fuse_projections",
    "fused_linear_converters",
    "fused_quantization_problem",
    "fused_views_class",
    "fusion",
    "isolated_rng",
    "linear_like",
    "lists",
    "local_sizes",
    "member_of",
    "meta",
    "nested_loads",
    "observed",
    "packed_modules",
    "packed_outputs",
    "packing",
    "parallel_modes",
    "peft",
    "probes",
    "randomness",
    "release_pages",
    "report_unrouted",
    "runtime_class",
    "same_input",
    "shrink",
    "shrunk_config",
    "shrunk_instance",
    "sized",
    "source_patterns_of",
    "split_converters",
    "split_member",
    "target_patterns_of",
    "text_decoder_config",
    "views",
]
