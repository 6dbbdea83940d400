"""Tiny random MoE checkpoints of several families, built from explicit configs, and isolation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hfpatch_pack_linear_experts.experts import is_declared_experts
from transformers import (
    DeepseekV3Config,
    GptOssConfig,
    GraniteMoeConfig,
    MixtralConfig,
    NemotronHConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
)
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: F401  (recorders captured at start)
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: F401
from transformers.models.granitemoe import modeling_granitemoe
from transformers.models.mixtral import modeling_mixtral  # noqa: F401
from transformers.models.nemotron_h import modeling_nemotron_h  # noqa: F401
from transformers.models.olmoe import modeling_olmoe  # noqa: F401
from transformers.models.qwen2_moe import modeling_qwen2_moe  # noqa: F401

from hfpatch_core.pytest_plugin import HfPatchIsolation, TinyCheckpoints
from hfpatch_core.testing import TINY_DECODER

PACK = "linear-experts"
VOCAB: int = TINY_DECODER["vocab_size"]
PAD: int = TINY_DECODER["pad_token_id"]

_COMMON: dict[str, Any] = {**TINY_DECODER, "num_experts_per_tok": 2}


def mixtral() -> PretrainedConfig:
    # per-expert checkpoint names w1 / w3 / w2 under block_sparse_moe (renamed to mlp at load)
    return MixtralConfig(**_COMMON, num_local_experts=4)


def qwen2_moe() -> PretrainedConfig:
    # a shared expert beside the routed ones (qwen-moe's family: composition)
    return Qwen2MoeConfig(**_COMMON, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32)


def olmoe() -> PretrainedConfig:
    return OlmoeConfig(**_COMMON, num_experts=4)


def deepseek_v3() -> PretrainedConfig:
    # sigmoid routing with groups and a correction bias, shared experts, one dense layer first, MLA
    return DeepseekV3Config(
        **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},  # MLA: one kv head per head
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        head_dim=8,
    )


def nemotron_h() -> PretrainedConfig:
    # experts without a gate (act(up(x))), in a hybrid stack: attention, then MoE
    return NemotronHConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layers_block_type=["attention", "moe"],
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        n_group=1,
        topk_group=1,
        vocab_size=VOCAB,
        initializer_range=0.2,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def gpt_oss() -> PretrainedConfig:
    # checkpoints store the experts 3-D: transposed [E, in, out], gate/up interleaved, with biases,
    # a custom clamped gate; split at load, stacked back on save
    return GptOssConfig(
        **{**_COMMON, "intermediate_size": 16},
        head_dim=8,
        num_local_experts=4,
    )


def granitemoe() -> PretrainedConfig:
    # 3-D checkpoints under another name (input_linear / output_linear, renamed by transformers)
    return GraniteMoeConfig(**{**_COMMON, "intermediate_size": 16}, num_local_experts=4)


#: The families whose checkpoints store the experts 3-D.
STORED_3D = ("gpt_oss", "granitemoe")

CASES: dict[str, Callable[[], PretrainedConfig]] = {
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "olmoe": olmoe,
    "deepseek_v3": deepseek_v3,
    "nemotron_h": nemotron_h,
    "gpt_oss": gpt_oss,
}
# transformers 5.3 declares granitemoe's experts without use_experts_implementation: not this pack's there
if any(isinstance(value, type) and is_declared_experts(value) for value in vars(modeling_granitemoe).values()):
    CASES["granitemoe"] = granitemoe


@pytest.fixture(scope="session")
def checkpoints(tiny_checkpoints: TinyCheckpoints) -> dict[str, Path]:
    """Every case saved by vanilla transformers (which writes the per-expert layout)."""
    return tiny_checkpoints(CASES)


@pytest.fixture(autouse=True)
def _isolation(hfpatch_isolation: HfPatchIsolation) -> None:
    """Every test starts with hfpatch off and must leave transformers' registries as it found them."""
