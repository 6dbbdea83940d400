"""Example pack ``fused-mlp``: Llama's gate and up projections fused into one matmul.

The replacement stores one ``gate_up_proj`` instead of ``gate_proj`` and ``up_proj``, so
the pack also returns a converter: checkpoints load and save in the original layout.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers.core_model_loading import WeightConverter
from transformers.models.llama.modeling_llama import LlamaMLP

from hfpatch_core import Converter, LoadContext, Patch, SizedConcatenate, hookimpl
from hfpatch_core.authoring.packing import packed_outputs, record_sizes


class FusedGateUpMLP(LlamaMLP):
    """``LlamaMLP`` with one ``gate_up_proj`` linear: same maths, one matmul fewer."""

    # what gate_up_proj stands for: PEFT adapters keep naming gate_proj and up_proj
    hfpatch_packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        del self.gate_proj, self.up_proj
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.sizes = (config.intermediate_size, config.intermediate_size)
        record_sizes(self, "gate_up_proj", self.sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = packed_outputs(self, "gate_up_proj", self.sizes, x)
        return self.down_proj(self.act_fn(gate) * up)


@hookimpl
def provide_patches(context: LoadContext) -> list[Patch]:
    if context.model_type != "llama":
        return []
    return [Patch("LlamaMLP", FusedGateUpMLP)]


@hookimpl
def provide_converters(context: LoadContext) -> list[Converter]:
    if context.model_type != "llama" or context.config is None:
        return []
    size = context.config.intermediate_size
    fuse = WeightConverter(
        source_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        target_patterns="mlp.gate_up_proj.weight",
        operations=[SizedConcatenate(dim=0, sizes=(size, size))],
    )
    return [Converter("llama", [fuse])]
