"""The fused replacement classes: one ``qkv_proj`` per attention, one ``gate_up_proj`` per MLP.

Each replacement is built at runtime as a subclass of the installed transformers class it
replaces (as transformers' own ``fusion_mapping`` builds its fused patch embeddings), so
that ``__init__`` builds exactly what the original builds (norms, sliding window,
scaling, sizes from the config) before the projections are swapped, and ``isinstance``
checks (output recorders, ``_no_split_modules``, PEFT) still see the original class.

The forwards are the originals' with the projections fused:

* MLP: ``down_proj(act_fn(gate) * up)`` with ``gate, up = gate_up_proj(x).chunk(2)``;
* attention: the q/k/v states are three splits of one matmul; rotary, the q/k norms
  (qwen3), the KV cache, the attention interface, the sliding window and ``o_proj`` are
  as in the original.  The fusion and the forward are shared with the other packs
  (``hfpatch_core.authoring.fusion``, which also picks the installed class's cache
  convention); a family's ``AttentionFlavor`` sets what differs.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn as nn

from hfpatch_core.authoring.fusion import FusedQKVAttentionBase, forward_for, fuse_projections
from hfpatch_core.authoring.packing import packed_outputs


class SlidingWindow(enum.Enum):
    """Where an attention's forward takes the ``sliding_window=`` it passes to the attention function."""

    #: Passes none (llama, qwen2_moe: a window lives in the mask only).
    NONE = "none"
    #: ``getattr(self.config, "sliding_window", None)`` (mistral).
    CONFIG = "config"
    #: ``self.sliding_window``, set per layer from ``config.layer_types`` (qwen2, qwen3).
    LAYER = "layer"


@dataclasses.dataclass(frozen=True)
class AttentionFlavor:
    """What an attention family's forward does besides the projections.

    Attributes:
        name: the family whose forward this is (``"llama"``), for messages.
        qk_norm: ``q_norm`` / ``k_norm`` applied per head before rotary (qwen3).
        sliding_window: what the forward passes as ``sliding_window=``.
    """

    name: str
    qk_norm: bool = False
    sliding_window: SlidingWindow = SlidingWindow.NONE


#: The four attention forwards of the covered families (qwen2_moe's is llama's, qwen3_moe's
#: is qwen3's, token for token; the tests check this against the installed sources).
LLAMA = AttentionFlavor("llama")
MISTRAL = AttentionFlavor("mistral", sliding_window=SlidingWindow.CONFIG)
QWEN2 = AttentionFlavor("qwen2", sliding_window=SlidingWindow.LAYER)
QWEN3 = AttentionFlavor("qwen3", qk_norm=True, sliding_window=SlidingWindow.LAYER)


class FusedGateUpMLP(nn.Module):
    """Mixin for a SiLU-gated MLP class: fuses ``gate_proj`` and ``up_proj`` into ``gate_up_proj``.

    First among the bases, before the original MLP class.  Rows ``[0, I)`` of
    ``gate_up_proj.weight`` are ``gate_proj``'s, rows ``[I, 2I)`` ``up_proj``'s (the
    pack's converter concatenates them in this order).
    """

    #: Under tensor parallelism ``gate_up_proj`` is column-parallel where the model's plan
    #: shards this MLP (``gate_proj`` / ``up_proj`` colwise): each rank holds its rows of the
    #: gate and of the up part, which the converter concatenates from their shards.
    hfpatch_tp_plan: ClassVar[dict[str, str]] = {"gate_up_proj": "colwise"}
    #: Under FSDP2 ``gate_up_proj`` shards with its layer, as the model's plan wraps it: the
    #: converter (``SizedConcatenate``) gives each rank its contiguous cut of the fused tensor.
    hfpatch_fsdp_plan: ClassVar[dict[str, str]] = {}
    #: Expert parallelism shards a MoE's experts only: a dense MLP (a qwen2_moe shared
    #: expert included) stays whole on every rank.
    hfpatch_ep_plan: ClassVar[dict[str, str]] = {}

    gate_up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    #: What ``gate_up_proj`` stands for (``hfpatch_core.authoring.packing``): adapters name these.
    hfpatch_packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        gate, up = fuse_projections(self, ("gate_proj", "up_proj"), "gate_up_proj")
        #: The intermediate size (the output size of each half).
        self.gate_up_sizes: tuple[int, int] = (gate, up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = packed_outputs(self, "gate_up_proj", self.gate_up_sizes, x)
        return self.down_proj(self.act_fn(gate) * up)


class FusedQKVAttention(FusedQKVAttentionBase):
    """Mixin for an attention class: fuses ``q_proj`` / ``k_proj`` / ``v_proj`` into ``qkv_proj``.

    First among the bases, before the original attention class; the fusion and the
    forward are ``hfpatch_core.authoring.fusion.FusedQKVAttentionBase``'s, with the q/k norms
    and the ``sliding_window=`` argument as ``flavor`` says.

    Class attributes set by ``fused_attention_class``:
        flavor: what the original forward does besides the projections.
        qk_norm: ``flavor.qk_norm``, which the base class reads.
        family_module: the original's modeling module (see the base class).
    """

    flavor: ClassVar[AttentionFlavor]
    #: Under tensor parallelism ``qkv_proj`` is column-parallel where the model's plan shards
    #: q/k/v colwise: each rank holds its own heads of q, of k and of v (grouped-query
    #: included), which the converter concatenates from their shards.
    hfpatch_tp_plan: ClassVar[dict[str, str]] = {"qkv_proj": "colwise"}
    #: Under FSDP2 ``qkv_proj`` shards with its layer, as the model's plan wraps it: the
    #: converter (``SizedConcatenate``) gives each rank its contiguous cut of the fused tensor.
    hfpatch_fsdp_plan: ClassVar[dict[str, str]] = {}
    #: Expert parallelism shards a MoE's experts only: the attention stays whole on every rank.
    hfpatch_ep_plan: ClassVar[dict[str, str]] = {}

    def _attention_kwargs(self) -> dict[str, Any]:
        window = self.flavor.sliding_window
        if window is SlidingWindow.LAYER:
            return {"sliding_window": self.sliding_window}
        if window is SlidingWindow.CONFIG:
            return {"sliding_window": getattr(self.config, "sliding_window", None)}
        return {}


_CLASSES: dict[tuple[type[nn.Module], str], type[nn.Module]] = {}
_CLASSES_LOCK = threading.Lock()


def _publish(name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> type[nn.Module]:
    cls: type[nn.Module] = type(name, bases, {"__module__": __name__, "__qualname__": name, **namespace})
    # Reachable as hfpatch_pack_fused_dense.modules.<name> once built (pickle, copy by reference).
    setattr(sys.modules[__name__], name, cls)
    return cls


def fused_mlp_class(original: type[nn.Module]) -> type[nn.Module]:
    """The ``gate_up_proj`` replacement of MLP class ``original`` (``FusedGateUp<Original>``), built once."""
    with _CLASSES_LOCK:
        key = (original, "mlp")
        if key not in _CLASSES:
            _CLASSES[key] = _publish(
                f"FusedGateUp{original.__name__}",
                (FusedGateUpMLP, original),
                {"__doc__": f"``{original.__name__}`` with one fused ``gate_up_proj`` (hfpatch-pack-fused-dense)."},
            )
        return _CLASSES[key]


def fused_attention_class(original: type[nn.Module], flavor: AttentionFlavor) -> type[nn.Module]:
    """The ``qkv_proj`` replacement of attention class ``original`` (``FusedQKV<Original>``), built once.

    Raises:
        TypeError: the installed class takes neither ``cache`` nor ``past_key_values``
            (see ``hfpatch_core.authoring.fusion.forward_for``).
    """
    with _CLASSES_LOCK:
        key = (original, f"attention/{flavor.name}")
        if key not in _CLASSES:
            _CLASSES[key] = _publish(
                f"FusedQKV{original.__name__}",
                (FusedQKVAttention, original),
                {
                    "__doc__": f"``{original.__name__}`` with one fused ``qkv_proj`` (hfpatch-pack-fused-dense).",
                    "flavor": flavor,
                    "qk_norm": flavor.qk_norm,
                    "family_module": sys.modules[original.__module__],
                    "forward": forward_for(original, pack="hfpatch-pack-fused-dense"),
                },
            )
        return _CLASSES[key]


def __getattr__(name: str) -> type[nn.Module]:
    """``FusedQKV<Attention>`` / ``FusedGateUp<MLP>`` of a covered family, built on first access.

    Pickle finds classes by module and name; this lets a process that has not loaded a
    model of that family yet unpickle one (``torch.load`` of a whole model, a copy sent
    to a worker process).
    """
    if not name.startswith("Fused"):  # e.g. __path__, asked while the package itself imports
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import FAMILIES, _modeling

    for model_type, family in FAMILIES.items():
        if name == f"FusedQKV{family.attention}":
            return fused_attention_class(getattr(_modeling(model_type), family.attention), family.flavor)
        if name == f"FusedGateUp{family.mlp}":
            return fused_mlp_class(getattr(_modeling(model_type), family.mlp))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
