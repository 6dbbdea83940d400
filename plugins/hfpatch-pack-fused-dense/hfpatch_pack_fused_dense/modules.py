"""The fused replacement classes: the installed class, with its projections as views of one fused projection.

Each replacement is built at runtime as a subclass of the installed class it replaces
(``hfpatch_core.authoring.views.fused_views_class``), so that ``__init__`` builds exactly
what the original builds before the projections are fused, ``forward`` is the
original's, token for token, and ``isinstance`` checks (output recorders,
``_no_split_modules``, PEFT) still see the original class:

* an attention gets ``qkv_proj`` (rows: q, k, v), and ``q_proj`` / ``k_proj`` / ``v_proj``
  become views of it (``FusedQKV<Original>``);
* a gated MLP gets ``gate_up_proj`` (rows: gate, up), and ``gate_proj`` / ``up_proj`` become
  views of it (``FusedGateUp<Original>``);
* a class with both gets both (``FusedQKVGateUp<Original>``);
* a compressed-tensors checkpoint's load gets ``QuantizableFused...<Original>``, whose fused
  projection is the ``nn.Linear`` its quantizer takes, the parts views of its output.

The first view the original forward calls with an input computes the fused matmul for
that input; the others take their slice of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch.nn as nn

from hfpatch_core.authoring.views import fused_views_class


class FusedDense:
    """The pack's mixin (after ``FusedViewsMixin``): what every fused class declares for sharded loads.

    Under tensor parallelism each fused projection is column-parallel (``hfpatch_tp_plan``,
    set per class by ``fused_class``: ``{"qkv_proj": "colwise"}``, ``{"gate_up_proj":
    "colwise"}``), where the model's plan shards the module at all: each rank holds its
    own heads of q, k and v (its rows of gate and up), which the converter
    (``SizedConcatenate``) cuts from each part.  The views keep the model's own rules
    (``q_proj``: ``colwise``): they own no parameter, and their hooks see what the
    original projections saw.
    """

    #: Under FSDP2 the fused projection shards with its layer, as the model's plan wraps it:
    #: the converter (``SizedConcatenate``) gives each rank its contiguous cut of the fused
    #: tensor; the views own no parameter.
    hfpatch_fsdp_plan: ClassVar[dict[str, str]] = {}
    #: Expert parallelism shards a MoE's experts only: an attention or a dense MLP (a shared
    #: expert included) stays whole on every rank.
    hfpatch_ep_plan: ClassVar[dict[str, str]] = {}


def class_name(original: type, groups: Mapping[str, Sequence[str]], *, quantizable: bool = False) -> str:
    """``FusedQKVLlamaAttention``, ``FusedGateUpLlamaMLP``, ``FusedQKVGateUp<Original>``; ``FusedKV<Original>``
    where only ``k_proj`` / ``v_proj`` are fused (the parts' stems, capitalised, in order); prefixed
    ``Quantizable`` for a quantized checkpoint's (``fused_class``)."""
    stems = "".join(part.removesuffix("_proj").capitalize() for parts in groups.values() for part in parts)
    return f"{'Quantizable' if quantizable else ''}Fused{stems}{original.__name__}"


def fused_class(
    original: type[nn.Module], groups: Mapping[str, Sequence[str]], *, quantizable: bool = False
) -> type[nn.Module]:
    """The replacement of ``original`` fusing ``groups`` (fused name -> parts, in ``KINDS`` order), built once
    and published here (``Detection.groups`` gives them).

    With ``quantizable=True``, for a compressed-tensors checkpoint's load, each fused projection
    is an ``nn.Linear`` the quantizer takes as one linear, and the original names are views of
    its output that it leaves alone (``hfpatch_core.authoring.views.SharedLinear`` /
    ``OutputView``); otherwise the views are ``nn.Linear`` for PEFT to wrap."""
    frozen = {fused: tuple(parts) for fused, parts in groups.items()}
    return fused_views_class(
        original,
        frozen,
        module=__name__,
        name=class_name(original, frozen, quantizable=quantizable),
        mixins=(FusedDense,),
        namespace={"hfpatch_tp_plan": dict.fromkeys(frozen, "colwise")},
        quantizable=quantizable,
    )
