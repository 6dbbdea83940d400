"""``hfpatch_core.authoring.shrink``: a candidate module built with the load's config scaled down."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from hfpatch_core import LoadContext
from hfpatch_core.authoring import SHRUNK_SIZES, shrunk_config, shrunk_instance


def test_a_config_is_copied_with_its_sizes_and_its_sub_configs_sizes_lowered() -> None:
    config = AutoConfig.for_model("llava")  # a composite: a text and a vision sub-config
    text_hidden, vision_hidden = config.text_config.hidden_size, config.vision_config.hidden_size
    small = shrunk_config(config)
    assert small.text_config.hidden_size == small.vision_config.hidden_size == SHRUNK_SIZES["hidden_size"]
    assert small.text_config.num_hidden_layers == 2
    assert (config.text_config.hidden_size, config.vision_config.hidden_size) == (text_hidden, vision_hidden)
    # a size already small stays, and sizes= chooses others
    assert shrunk_config(LlamaConfig(hidden_size=32)).hidden_size == 32
    assert shrunk_config(LlamaConfig(), {"hidden_size": 128}).intermediate_size == LlamaConfig().intermediate_size


def test_a_real_mlp_is_probed_on_kilobytes_and_computes_as_its_class_does() -> None:
    config = LlamaConfig()  # 4096 x 11008: 135M parameters per MLP at its real sizes
    mlp = shrunk_instance(LlamaForCausalLM, LlamaMLP, config)
    assert type(mlp) is LlamaMLP
    assert mlp.gate_proj.weight.shape == (128, 64) and mlp.gate_proj.weight.device.type == "cpu"
    assert sum(parameter.numel() for parameter in mlp.parameters()) == 3 * 128 * 64
    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = mlp.down_proj(mlp.act_fn(mlp.gate_proj(hidden)) * mlp.up_proj(hidden))
        assert torch.equal(mlp(hidden), expected)
    # the parameters are drawn from the seed, not transformers' initial values (a norm's ones)
    again = shrunk_instance(LlamaForCausalLM, LlamaMLP, config)
    assert all(torch.equal(a, b) for a, b in zip(mlp.parameters(), again.parameters(), strict=True))
    other = shrunk_instance(LlamaForCausalLM, LlamaMLP, config, seed=1)
    assert not torch.equal(mlp.gate_proj.weight, other.gate_proj.weight)
    norm = shrunk_instance(LlamaForCausalLM, LlamaRMSNorm, config)
    assert not torch.equal(norm.weight, torch.ones_like(norm.weight))


def test_a_hooks_context_gives_the_class_and_config_and_experts_and_attention_shrink_too() -> None:
    context = LoadContext(model_type="mixtral", model_class_name="MixtralForCausalLM", config=MixtralConfig())
    experts = shrunk_instance(context, MixtralExperts)
    assert experts.gate_up_proj.shape[0] == SHRUNK_SIZES["num_local_experts"]
    attention = shrunk_instance(
        LoadContext(model_type="llama", model_class_name="LlamaForCausalLM", config=LlamaConfig()), LlamaAttention
    )
    assert attention.q_proj.weight.shape == (4 * 16, 64) and attention.k_proj.weight.shape == (2 * 16, 64)


def test_what_cannot_be_built_is_said() -> None:
    with pytest.raises(LookupError, match="LlamaForCausalLM built with its sizes shrunk has no Qwen2MLP module"):
        shrunk_instance(LlamaForCausalLM, Qwen2MLP, LlamaConfig())
    with pytest.raises(ValueError, match=r"shrunk_instance\(LlamaForCausalLM load\): no config"):
        shrunk_instance(LoadContext(model_type="llama", model_class_name="LlamaForCausalLM"), LlamaMLP)
    with pytest.raises(ValueError, match="pass the config to shrink"):
        shrunk_instance(LlamaForCausalLM, LlamaMLP)
