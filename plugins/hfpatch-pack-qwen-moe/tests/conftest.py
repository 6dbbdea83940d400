"""Tiny random qwen2_moe / qwen3_moe checkpoints, and isolation between tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

import hfpatch_core
from hfpatch_core.pytest_plugin import HfPatchIsolation

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

PACK = "qwen-moe"
VOCAB = 160
PAD = 0

_COMMON: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    # Larger than the default 0.02 so that logits and routing are far from uniform:
    # a pack that permuted experts or heads would change them by much more than 1e-5.
    initializer_range=0.2,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One checkpoint the tests run on."""

    name: str
    build: Callable[[], PretrainedConfig]

    @property
    def config(self) -> PretrainedConfig:
        return self.build()


def qwen2_moe_config() -> PretrainedConfig:
    # qkv_bias as the config gives it (True by default: q/k/v carry biases).
    return Qwen2MoeConfig(**_COMMON, shared_expert_intermediate_size=32)


def qwen2_moe_sliding_config() -> PretrainedConfig:
    # Layer 0 uses a 4-token sliding window (layer_types), layer 1 full attention.
    return Qwen2MoeConfig(
        **_COMMON, shared_expert_intermediate_size=32, use_sliding_window=True, sliding_window=4, max_window_layers=1
    )


def qwen3_moe_config() -> PretrainedConfig:
    # Grouped-query attention (4 heads, 2 kv heads), head_dim 16 != hidden / heads, q/k norms.
    return Qwen3MoeConfig(**{**_COMMON, "head_dim": 16})


def qwen3_moe_sliding_config() -> PretrainedConfig:
    return Qwen3MoeConfig(**{**_COMMON, "head_dim": 16}, use_sliding_window=True, sliding_window=4)


CASES = {
    case.name: case
    for case in (
        Case("qwen2_moe", qwen2_moe_config),
        Case("qwen2_moe-sliding", qwen2_moe_sliding_config),
        Case("qwen3_moe", qwen3_moe_config),
        Case("qwen3_moe-sliding", qwen3_moe_sliding_config),
    )
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case saved by vanilla transformers (which writes the per-expert layout)."""
    hfpatch_core.disable()
    paths = {}
    for seed, (name, case) in enumerate(CASES.items()):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(name)
        model = AutoModelForCausalLM.from_config(case.config)
        assert type(model).__module__ in (modeling_qwen2_moe.__name__, modeling_qwen3_moe.__name__)
        model.save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(autouse=True)
def _isolation(hfpatch_isolation: HfPatchIsolation) -> None:
    """Every test starts with hfpatch off and the environment's pack choice ignored, and errors if it
    leaves transformers' registries or class-level output recorders changed (``hfpatch_isolation``)."""
