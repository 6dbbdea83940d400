"""``authoring.calls.builds_by_name`` reads through decorators of ``__init__`` (issue 38: transformers'
``@use_kernelized_func`` wraps Qwen3Attention's, Gemma3Attention's and OlmoeAttention's ``__init__``
in a function that keeps the original only in its closure, and their q/k norms were refused)."""

from __future__ import annotations

import pytest
import torch.nn as nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.olmoe.modeling_olmoe import OlmoeAttention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from hfpatch_core.authoring.calls import builds_by_name


class Norm(nn.Module):
    pass


def closure_decorator(cls: type) -> type:
    """Wraps ``__init__`` as ``use_kernelized_func`` does: no ``functools.wraps``, the original in the closure."""
    original = cls.__init__

    def new_init(self, *args, **kwargs):
        original(self, *args, **kwargs)

    cls.__init__ = new_init  # type: ignore[method-assign]
    return cls


@closure_decorator
class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = Norm()


def test_a_closure_wrapped_init_is_read() -> None:
    assert builds_by_name(Wrapped, "Norm")
    assert not builds_by_name(Wrapped, "Other")


@pytest.mark.parametrize(
    ("owner", "name"),
    [(Qwen3Attention, "Qwen3RMSNorm"), (Gemma3Attention, "Gemma3RMSNorm"), (OlmoeAttention, "OlmoeRMSNorm")],
)
def test_transformers_kernelized_attentions_build_their_norms_by_name(owner: type, name: str) -> None:
    assert builds_by_name(owner, name)


def test_a_class_not_built_is_not_found() -> None:
    assert not builds_by_name(LlamaAttention, "LlamaRMSNorm")
