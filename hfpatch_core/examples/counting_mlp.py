"""An example pack: Llama-family MLPs and RMSNorms that count their calls.

It keeps the math and the weight layout, so a patched model must give the same
logits as the original: ``hfpatch demo`` checks exactly that.
"""

from __future__ import annotations

from typing import Any

from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from hfpatch_core import LoadContext, Patch, hookimpl


class CountingMLP(LlamaMLP):
    """``LlamaMLP`` that counts its forward calls."""

    calls = 0

    def forward(self, x: Any) -> Any:
        type(self).calls += 1
        return super().forward(x)


class CountingRMSNorm(LlamaRMSNorm):
    """``LlamaRMSNorm`` that counts its forward calls."""

    calls = 0

    def forward(self, hidden_states: Any) -> Any:
        type(self).calls += 1
        return super().forward(hidden_states)


@hookimpl
def provide_patches(context: LoadContext) -> list[Patch]:
    if context.model_type != "llama":
        return []
    return [Patch("LlamaMLP", CountingMLP), Patch("^Llama.*RMSNorm$", CountingRMSNorm)]
