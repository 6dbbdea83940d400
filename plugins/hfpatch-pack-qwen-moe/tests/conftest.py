"""Tiny random qwen2_moe / qwen3_moe checkpoints, and isolation between tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen2_moe import modeling_qwen2_moe  # noqa: F401  (recorders captured at start)
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401

from hfpatch_core.pytest_plugin import HfPatchIsolation, TinyCheckpoints
from hfpatch_core.testing import TINY_DECODER

PACK = "qwen-moe"
VOCAB: int = TINY_DECODER["vocab_size"]
PAD: int = TINY_DECODER["pad_token_id"]

_COMMON: dict[str, Any] = {
    **TINY_DECODER,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


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
def checkpoints(tiny_checkpoints: TinyCheckpoints) -> dict[str, Path]:
    """Every case saved by vanilla transformers (which writes the per-expert layout)."""
    return tiny_checkpoints({name: case.build for name, case in CASES.items()})


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(autouse=True)
def _isolation(hfpatch_isolation: HfPatchIsolation) -> None:
    """Every test starts with hfpatch off and the environment's pack choice ignored, and errors if it
    leaves transformers' registries or class-level output recorders changed (``hfpatch_isolation``)."""
