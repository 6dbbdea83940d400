"""Attention with one fused ``qkv_proj`` instead of ``q_proj`` / ``k_proj`` / ``v_proj``.

One matmul instead of three for the input projections, and one ``nn.Linear`` for a
quantizer or adapter to handle.  The checkpoint keeps its three tensors: the pack's
converter concatenates them on load with an exactly reversible operation
(``hfpatch_core.conversion.SizedConcatenate``) and ``save_pretrained`` splits them
back (grouped-query attention makes the three parts of different sizes).

The fusion and the forward are ``hfpatch_core.authoring.fusion``'s, shared with the other
packs: the original forward with the three projections replaced by one projection and
a split, in whichever cache convention the installed class has (transformers changed
it after 5.3), so both behave exactly like the original.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

from hfpatch_core.authoring.fusion import FusedQKVAttentionBase, forward_for

_DISTRIBUTION = "hfpatch-pack-qwen-moe"


class FusedQKVAttention(FusedQKVAttentionBase):
    """Mixin for a family's attention class: fuses its q/k/v projections into ``qkv_proj``.

    Put it first among the bases, before the family's attention class (see
    ``hfpatch_core.authoring.fusion.FusedQKVAttentionBase``, which also defines
    ``family_module`` and ``qk_norm``, the q/k norms of qwen3_moe).

    Class attributes a family sets:
        passes_sliding_window: pass ``sliding_window=`` to the attention function
            (qwen3_moe; qwen2_moe's sliding window lives in its attention mask only).
    """

    passes_sliding_window: ClassVar[bool] = False
    #: Under tensor parallelism ``qkv_proj`` is column-parallel where the model's plan shards
    #: q/k/v colwise: each rank holds its own heads of q, of k and of v (grouped-query
    #: included), which the converter concatenates from their shards.
    hfpatch_tp_plan: ClassVar[dict[str, str]] = {"qkv_proj": "colwise"}
    #: Under FSDP2 ``qkv_proj`` shards with its layer, as the model's plan wraps it: the
    #: converter (``SizedConcatenate``) gives each rank its contiguous cut of the fused tensor.
    hfpatch_fsdp_plan: ClassVar[dict[str, str]] = {}
    #: Expert parallelism shards the experts only: the attention stays whole on every rank.
    hfpatch_ep_plan: ClassVar[dict[str, str]] = {}

    def _attention_kwargs(self) -> dict[str, Any]:
        return {"sliding_window": self.sliding_window} if self.passes_sliding_window else {}


# forward_for runs as the pack imports: on a release it does not support, the pack's
# import fails (ImportError), which hfpatch reports as the pack failing to load.
class Qwen2MoeFusedQKVAttention(FusedQKVAttention, Qwen2MoeAttention):
    """``Qwen2MoeAttention`` with a fused ``qkv_proj`` (bias as ``config.qkv_bias``)."""

    family_module = sys.modules[Qwen2MoeAttention.__module__]
    forward = forward_for(Qwen2MoeAttention, pack=_DISTRIBUTION, error=ImportError)


class Qwen3MoeFusedQKVAttention(FusedQKVAttention, Qwen3MoeAttention):
    """``Qwen3MoeAttention`` with a fused ``qkv_proj`` (bias as ``config.attention_bias``), q/k norms kept."""

    family_module = sys.modules[Qwen3MoeAttention.__module__]
    qk_norm = True
    passes_sliding_window = True
    forward = forward_for(Qwen3MoeAttention, pack=_DISTRIBUTION, error=ImportError)
