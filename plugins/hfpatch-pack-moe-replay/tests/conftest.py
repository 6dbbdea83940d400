"""Tiny random checkpoints of every covered MoE family, and isolation between tests."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hfpatch_pack_moe_replay import scope, selection
from transformers import (
    FlexOlmoConfig,
    MiniMaxConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from hfpatch_core.pytest_plugin import HfPatchIsolation, TinyCheckpoints
from hfpatch_core.testing import TINY_DECODER

PACK = "moe-replay"
VOCAB: int = TINY_DECODER["vocab_size"]
PAD: int = TINY_DECODER["pad_token_id"]

COMMON: dict[str, Any] = {**TINY_DECODER, "num_experts_per_tok": 2}


#: A qwen3_moe whose first layer is dense (``mlp_only_layers=[0]``): the engines' arrays give every
#: decoder layer a slot, the dense one's zeros.
DENSE_FIRST = "qwen3_moe_dense_first"


def dense_first_config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, num_experts=4, moe_intermediate_size=16, head_dim=16, mlp_only_layers=[0]
    )


def deepseek_v3_config() -> Any:
    """A tiny deepseek_v3: sigmoid top-k renormalised and scaled by 2.5, a correction bias used only to
    select, group-limited (4 groups, 2 kept), MLA attention, a shared expert, every layer MoE."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


# qwen3_next and minimax are hybrids: one linear-attention layer, one full-attention layer.
_HYBRID = ["linear_attention", "full_attention"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One family the tests run on, and how it renormalises the top-k probabilities."""

    model_type: str
    build: Callable[[], PretrainedConfig]
    always_renormalises: bool = False

    @property
    def config(self) -> PretrainedConfig:
        return self.build()

    def renormalises(self, config: Any) -> bool:
        return self.always_renormalises or bool(config.norm_topk_prob)


CASES = {
    case.model_type: case
    for case in (
        Case(
            "qwen2_moe",
            lambda: Qwen2MoeConfig(
                **COMMON, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32
            ),
        ),
        # norm_topk_prob on here (off by default), so both settings of the flag are covered
        Case(
            "qwen3_moe",
            lambda: Qwen3MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=16, head_dim=16, norm_topk_prob=True),
        ),
        Case("mixtral", lambda: MixtralConfig(**COMMON, num_local_experts=4), always_renormalises=True),
        Case("olmoe", lambda: OlmoeConfig(**COMMON, num_experts=4)),
        Case("flex_olmo", lambda: FlexOlmoConfig(**COMMON, num_experts=4)),
        Case(
            "qwen3_next",
            lambda: Qwen3NextConfig(
                **COMMON,
                num_experts=4,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                head_dim=8,
                linear_num_value_heads=2,
                linear_num_key_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                layer_types=_HYBRID,
            ),
        ),
        Case(
            "minimax",
            lambda: MiniMaxConfig(**COMMON, num_local_experts=4, head_dim=8, layer_types=_HYBRID),
            always_renormalises=True,
        ),
    )
}


@pytest.fixture(scope="session")
def checkpoints(tiny_checkpoints: TinyCheckpoints) -> dict[str, Path]:
    """Every family saved by vanilla transformers."""
    return tiny_checkpoints({name: case.build for name, case in CASES.items()})


@pytest.fixture(params=list(CASES))
def family(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


# Imported before the first test, so that hfpatch_isolation records the output recorders
# of every family (a patched load may rewrite them) from the start.
for _model_type in CASES:
    importlib.import_module(f"transformers.models.{_model_type}.modeling_{_model_type}")


@pytest.fixture(autouse=True)
def _isolation(hfpatch_isolation: HfPatchIsolation) -> Iterator[None]:
    """Every test starts with hfpatch off and the environment's pack choice ignored, and errors if it
    leaves transformers' registries or class-level output recorders changed (``hfpatch_isolation``),
    or a replay or a recording of this pack open."""
    yield
    assert scope.REPLAY.get() is None and not scope.OPEN, "a test left a replay open"
    assert selection.recordings() == (), "a test left a recording open (in this context or every thread)"
