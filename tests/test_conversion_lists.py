"""``authoring.conversion_key`` / ``conversion_lists``: which of transformers' conversion lists a load's
converters join and which lists its tensors go through (one rule for every pack; it was written in
fused-dense and linear-experts each)."""

from __future__ import annotations

import pytest

from hfpatch_core import LoadContext
from hfpatch_core._compat import conversion_cache
from hfpatch_core.authoring import conversion_key, conversion_lists


@pytest.fixture
def class_list(monkeypatch: pytest.MonkeyPatch) -> str:
    """A list transformers keeps for a model class (5.25 has some, 5.3 none): LlavaForConditionalGeneration's."""
    monkeypatch.setitem(conversion_cache(), "LlavaForConditionalGeneration", [])
    return "LlavaForConditionalGeneration"


def test_the_model_types_list_where_the_class_has_none() -> None:
    assert conversion_key(LoadContext("mixtral", "MixtralForCausalLM")) == "mixtral"
    assert conversion_lists(LoadContext("mixtral", "MixtralForCausalLM")) == ["mixtral"]


def test_the_class_list_where_transformers_keeps_one(class_list: str) -> None:
    outer = LoadContext("llava", class_list)
    assert conversion_key(outer) == class_list
    assert conversion_lists(outer) == ["llava", class_list]


def test_a_sub_model_reads_the_outer_models_lists_too(class_list: str) -> None:
    outer = LoadContext("llava", class_list)
    text = LoadContext("llama", "LlamaModel", parent=outer)
    inner = LoadContext("mistral", "MistralModel", parent=text)  # nested twice: the root's lists
    assert conversion_key(text) == "llama"
    assert conversion_lists(text) == ["llama", class_list, "llava"]
    assert conversion_lists(inner) == ["mistral", class_list, "llava"]


def test_a_list_read_twice_is_listed_once() -> None:
    # a head's base model, built in a load of its own inside the head's, reads the same model type's list
    head = LoadContext("llama", "LlamaForCausalLM")
    assert conversion_lists(LoadContext("llama", "LlamaModel", parent=head)) == ["llama", "LlamaForCausalLM"]
