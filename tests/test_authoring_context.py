"""What a hook gets from its ``LoadContext``: the model class, and ``build_on_meta(context)`` (issue 38:
authors wrote ``getattr(transformers, context.model_class_name)`` by hand)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config
from hfpatch_core import LoadContext
from hfpatch_core.authoring import build_on_meta


def test_the_context_names_the_model_class() -> None:
    assert LoadContext("llama", "LlamaForCausalLM").model_class is LlamaForCausalLM
    assert LoadContext("llama", "NoSuchModelForCausalLM").model_class is None


def test_build_on_meta_takes_the_context() -> None:
    config = tiny_llama_config()
    model = build_on_meta(LoadContext.for_model(LlamaForCausalLM, config))
    assert type(model) is LlamaForCausalLM and all(p.device == torch.device("meta") for p in model.parameters())
    assert model.config is not config  # a copy: the load's config is not written
    with pytest.raises(ValueError, match="no config"):
        build_on_meta(LoadContext("llama", "LlamaForCausalLM"))
    with pytest.raises(ValueError, match="exports no class 'Custom'"):
        build_on_meta(LoadContext("llama", "Custom", config=config))
