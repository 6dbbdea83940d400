"""``tiny_checkpoint`` across the causal-LM model types of the installed transformers (issue 29 item 1).

Measured (``USE_HUB_KERNELS=0 python bench/zoo_checkpoints.py``: saves, loads, finite logits, at
most 20M parameters): transformers 5.25.0, 198 of 200 model types (the two gemma4 assistants
are draft models whose forward needs a target model's key/values); 5.3.0, 150 of 151 (recurrent_gemma:
UPSTREAM_BUGS).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hfpatch_core.testing import tiny_checkpoint
from hfpatch_core.testing.checkpoints import (
    TINY_PARAMETERS,
    TinyCheckpointError,
    _built_from,
    check_tiny_checkpoint,
    parameter_count,
    tiny_config,
)
from hfpatch_core.testing.models import causal_lm_loader
from hfpatch_core.testing.zoo import verdict_of, zoo_model_types
from packs import PackSpec

#: The share of the causal-LM model types of any supported transformers that must work (the
#: goal of issue 29), for the whole enumeration and for the sample alike.
FLOOR = 0.95


#: transformers' own load bugs a variant meets, with the first release that fixes each.  Before
#: 5.4 recurrent_gemma's ``_init_weights`` skips its rotary module: ``from_pretrained`` leaves the
#: buffers as allocated (finite or NaN by chance: one CI run failed on it).
UPSTREAM_BUGS = {
    "recurrent_gemma": (
        Version("5.4.0"),
        "load: from_pretrained left buffers uninitialized: model.layers.1.temporal_block.rotary_emb.inv_freq, "
        "model.layers.1.temporal_block.rotary_emb.original_inv_freq",
    )
}


@pytest.mark.parametrize(
    "model_type",
    # one of each variant the shrinking rules handle: composites (text + vision sub-configs, a
    # text-only causal LM of a composite type), MLA, MoE with dense first layers, hybrids, a
    # state-space model, layer counts that add up, an encoder-decoder's causal decoder
    [
        "got_ocr2",
        "llama4",
        "qwen3_5_moe",
        "deepseek_v3",
        "glm_moe_dsa",
        "qwen3_next",
        "jamba",
        "mamba2",
        "dory",
        "bart",
        # a layer pattern with more kinds than layers, one without an attention layer, one that
        # repeats, shared key/values, a derived attention width, a text-only causal LM of a
        # composite type whose full model needs a missing library, a decoder of codebooks
        "nemotron_h",
        "bamba",
        "recurrent_gemma",
        "gemma3n_text",
        "zamba",
        "gemma3n",
        "musicgen",
        # a vision tower sized by embed_dim (not hidden_size), projected to the text width
        "qwen2_vl",
    ],
)
def test_tiny_checkpoint_works_for_each_variant(model_type: str) -> None:
    if model_type not in zoo_model_types():
        pytest.skip(f"no {model_type!r} causal LM in this transformers")
    fixed_in, problem = UPSTREAM_BUGS.get(model_type, (None, None))
    if fixed_in is not None and Version(transformers.__version__) < fixed_in:
        assert check_tiny_checkpoint(model_type) == problem
    else:
        assert check_tiny_checkpoint(model_type) is None


def test_a_buffer_the_load_never_writes_is_named_on_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # the recurrent_gemma bug made on any transformers: an _init_weights that skips rotary modules
    from transformers import PreTrainedModel

    initialize = PreTrainedModel._init_weights

    def skipping_rotary(self: PreTrainedModel, module: torch.nn.Module) -> None:
        if not hasattr(module, "original_inv_freq"):
            initialize(self, module)

    monkeypatch.setattr(PreTrainedModel, "_init_weights", skipping_rotary)
    for _ in range(2):
        assert check_tiny_checkpoint("llama") == (
            "load: from_pretrained left buffers uninitialized: "
            "model.rotary_emb.inv_freq, model.rotary_emb.original_inv_freq"
        )
    # and the process's own settings are as they were
    assert not torch.are_deterministic_algorithms_enabled()


def test_composite_sub_configs_are_shrunk() -> None:
    config = tiny_config("got_ocr2")
    assert config.text_config.hidden_size == 64 and config.vision_config.hidden_size == 64
    assert config.text_config.num_hidden_layers == 2 and len(config.text_config.layer_types) == 2
    assert parameter_count(config) <= TINY_PARAMETERS


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_moe", "glm_moe_dsa", "jamba", "lfm2_moe", "ernie4_5_moe"])
def test_every_layer_of_a_tiny_moe_model_keeps_its_experts(model_type: str) -> None:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"no {model_type!r} causal LM in this transformers")
    model_class, config, _ = _built_from(tiny_config(model_type))
    with torch.device("meta"):
        model = model_class(config)
    layers = next(module for name, module in model.named_modules() if name.endswith("layers"))
    sparse = [any("experts" in name for name, _ in layer.named_modules()) for layer in layers]
    assert sparse and all(sparse), f"{model_type}: layers with experts {sparse}"


def test_a_latent_attention_config_is_consistent() -> None:
    config = tiny_config("deepseek_v3")
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.head_dim == config.qk_rope_head_dim and config.num_key_value_heads == config.num_attention_heads


def _listed(failures: dict[str, str], total: int) -> str:
    listing = "\n".join(f"{t}: {problem}" for t, problem in sorted(failures.items()))
    return f"{total - len(failures)} of {total} work; failures:\n{listing}"


def test_every_model_type_of_the_zoo_shrinks_to_a_tiny_model() -> None:
    """Every causal-LM model type of the installed transformers (a new release's types are in the
    day it is tested): its shrunk config builds a model of at most 20M parameters on the meta device."""
    failures = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            count = parameter_count(tiny_config(model_type))
        except Exception as exc:
            failures[model_type] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            continue
        if count > TINY_PARAMETERS:
            failures[model_type] = f"{count:,} parameters"
    total = len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert total - len(failures) >= FLOOR * total, _listed(failures, total)


def test_a_sample_of_the_zoo_saves_loads_and_runs() -> None:
    """Every fifth model type, sorted (deterministic; the whole zoo: bench/zoo_checkpoints.py, 2-5 min)."""
    sample = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[::5]
    failures = {t: problem for t in sample if (problem := check_tiny_checkpoint(t))}
    assert len(sample) - len(failures) >= FLOOR * len(sample), _listed(failures, len(sample))


def test_a_default_config_that_does_not_validate_is_a_tiny_checkpoint_error() -> None:
    # gemma4_assistant's default config is invalid: tiny_config builds it with its override, and
    # without one (an explicit override breaking it) the error says which type and what to do
    if "gemma4_assistant" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip("no gemma4_assistant in this transformers")
    assert tiny_config("gemma4_assistant").text_config.hidden_size_per_layer_input == 0
    wrong = r"(?s)'gemma4_assistant'.*must be 0, got 16.*pass an explicit config"
    with pytest.raises(TinyCheckpointError, match=wrong):
        tiny_config("gemma4_assistant", text_config={"hidden_size_per_layer_input": 16})


def test_a_text_only_causal_lm_of_a_composite_type_loads_with_the_class_it_names(tmp_path: Path) -> None:
    config = tiny_config("mllama").text_config
    config.architectures = ["MllamaForCausalLM"]
    path = tiny_checkpoint(config, tmp_path / "text")
    assert json.loads((path / "config.json").read_text())["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    loader = causal_lm_loader(path)
    assert loader.__name__ == "MllamaForCausalLM"
    assert type(loader.from_pretrained(path)).__name__ == "MllamaForCausalLM"
    assert causal_lm_loader(tiny_checkpoint("llama", tmp_path / "llama")) is AutoModelForCausalLM


#: Replaces mllama's text MLP (a composite type whose causal LM takes the text config).
MLLAMA_MLP_PACK = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.mllama.modeling_mllama import MllamaTextMLP

    class PackMLP(MllamaTextMLP):
        pass

    @hookimpl
    def provide_patches(context):
        return [Patch("MllamaTextMLP", PackMLP)] if context.model_type.startswith("mllama") else []
"""


def test_the_zoo_verifies_a_causal_lm_that_takes_the_text_config(install, tmp_path: Path) -> None:
    # the round trip reloads what the patched MllamaForCausalLM saved (a MllamaTextConfig), which
    # AutoModelForCausalLM refuses: the zoo said "failed" for mllama and emu3 with every pack
    install(PackSpec("mllama-mlp", MLLAMA_MLP_PACK))
    torch.manual_seed(0)
    row = verdict_of("mllama-mlp", "mllama", tmp_path, generate_tokens=2)
    assert (row.verdict, row.detail) == ("exact", "MllamaTextMLP <- PackMLP")
