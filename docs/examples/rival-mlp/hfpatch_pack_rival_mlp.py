"""Example pack ``rival-mlp``: another ``LlamaMLP`` replacement, which defers to other packs."""

from __future__ import annotations

from transformers.models.llama.modeling_llama import LlamaMLP

from hfpatch_core import LoadContext, Patch, hookimpl


class RivalMLP(LlamaMLP):
    """Keeps the original weights and maths."""


@hookimpl
def provide_patches(context: LoadContext) -> list[Patch]:
    if context.model_type != "llama":
        return []
    return [Patch("LlamaMLP", RivalMLP, priority=-1)]
