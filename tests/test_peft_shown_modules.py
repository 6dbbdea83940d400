"""PEFT on modules declaring ``hfpatch_hidden_from_adapters = False``: per-expert ``nn.Linear``
where the original model holds 3-D experts, reached by ``target_modules`` despite PEFT's rewrite.

No pack: a tiny mixtral (a model type PEFT rewrites expert names for) gets its experts swapped
by hand for a module holding one ``nn.Linear`` per expert and projection, and the hook is
installed as a patched load installs it (``watch_peft``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import MixtralConfig, MixtralForCausalLM

from hfpatch_core import AdapterError
from hfpatch_core.authoring import HIDDEN_FROM_ADAPTERS
from hfpatch_core.authoring.peft import watch_peft

EXPERTS = 4


class ShownExperts(nn.Module):
    """``experts.<e>.<name>`` as ``nn.Linear``, run as mixtral's experts are (gate, up, down)."""

    hfpatch_hidden_from_adapters = False

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        for index in range(EXPERTS):
            expert = nn.Module()
            expert.add_module(gate, nn.Linear(hidden, intermediate, bias=False))
            expert.add_module(up, nn.Linear(hidden, intermediate, bias=False))
            expert.add_module(down, nn.Linear(intermediate, hidden, bias=False))
            self.add_module(str(index), expert)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        gate, up, down = self.names
        output = torch.zeros_like(hidden_states)
        for index in range(EXPERTS):
            rows, slot = torch.where(top_k_index == index)
            if rows.numel():
                expert = getattr(self, str(index))
                states = hidden_states[rows]
                result = getattr(expert, down)(
                    nn.functional.silu(getattr(expert, gate)(states)) * getattr(expert, up)(states)
                )
                output.index_add_(0, rows, result * top_k_weights[rows, slot, None])
        return output


def shown_mixtral(names: tuple[str, str, str] = ("w1", "w3", "w2")) -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(config).eval()
    for layer in model.model.layers:
        layer.mlp.experts = ShownExperts(32, 16, names)
    watch_peft()
    return model


def lora(targets: object) -> LoraConfig:
    torch.manual_seed(1)
    return LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False)


def adapted(model: nn.Module) -> set[str]:
    return {
        name.removeprefix("base_model.model.") for name, module in model.named_modules() if hasattr(module, "lora_A")
    }


def test_the_marker_is_the_public_one() -> None:
    assert HIDDEN_FROM_ADAPTERS == "hfpatch_hidden_from_adapters"
    assert getattr(ShownExperts, HIDDEN_FROM_ADAPTERS) is False


def test_expert_names_reach_every_expert_linear_and_the_adapter_reloads(tmp_path: Path) -> None:
    model = get_peft_model(shown_mixtral(), lora(["w1", "w3", "w2", "q_proj"]))
    linears = {
        f"model.layers.{layer}.mlp.experts.{e}.{name}"
        for layer in range(2)
        for e in range(EXPERTS)
        for name in ("w1", "w3", "w2")
    }
    attention = {f"model.layers.{layer}.self_attn.q_proj" for layer in range(2)}
    assert adapted(model) == linears | attention
    assert not model.peft_config["default"].target_parameters  # nothing put on 3-D parameters the model lacks
    ids = torch.tensor([[3, 9, 17, 33, 5, 60]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    fresh = shown_mixtral()
    # the adapter's per-expert weights are loaded, not stacked by mixtral's converters into 3-D ones
    reloaded = PeftModel.from_pretrained(fresh, tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


def test_a_router_target_is_still_rewritten_beside_the_experts() -> None:
    """``gate`` (mixtral's router, a parameter on transformers 5) keeps PEFT's rewrite."""
    model = get_peft_model(shown_mixtral(), lora(["w2", "gate"]))
    config = model.peft_config["default"]
    assert set(config.target_parameters) == {"gate.weight"}
    assert {name for name in adapted(model) if ".experts." in name} == {
        f"model.layers.{layer}.mlp.experts.{e}.w2" for layer in range(2) for e in range(EXPERTS)
    }


def test_expert_names_that_reach_no_linear_are_refused_with_the_names_that_would() -> None:
    model = shown_mixtral(("gate_in", "up_in", "down_out"))
    with pytest.raises(
        AdapterError, match=r"3-D parameters .*gate_up_proj.*target_modules=\['down_out', 'gate_in', 'up_in'\]"
    ):
        get_peft_model(model, lora(["w1", "w3", "w2"]))
    assert not adapted(model)
