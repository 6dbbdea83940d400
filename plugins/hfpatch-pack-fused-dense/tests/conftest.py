"""Tiny random checkpoints of every covered family, and isolation between tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import (
    GemmaConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.gemma import modeling_gemma
from transformers.models.granite import modeling_granite
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.olmo2 import modeling_olmo2
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

from hfpatch_core.pytest_plugin import HfPatchIsolation, TinyCheckpoints
from hfpatch_core.testing import TINY_DECODER

PACK = "fused-dense"
VOCAB: int = TINY_DECODER["vocab_size"]
PAD: int = TINY_DECODER["pad_token_id"]

#: grouped-query attention (4 heads, 2 key/value heads): q is twice as wide as k and v
_COMMON = TINY_DECODER

_MOE: dict[str, Any] = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)


@dataclasses.dataclass(frozen=True)
class Case:
    """One checkpoint the tests run on, and the classes the pack must replace in it.

    Attributes:
        name: the case's id.
        build: makes the config.
        replaced: original class -> fused class name the pack must put in its place.
    """

    name: str
    build: Callable[[], PretrainedConfig]
    replaced: dict[str, str]

    @property
    def config(self) -> PretrainedConfig:
        return self.build()


def _replaced(*names: str) -> dict[str, str]:
    return {name: ("FusedQKV" if name.endswith("Attention") else "FusedGateUp") + name for name in names}


CASES = {
    case.name: case
    for case in (
        Case("llama", lambda: LlamaConfig(**_COMMON), _replaced("LlamaAttention", "LlamaMLP")),
        # bias on q/k/v/o and on the MLP projections, multi-head (no GQA), tied embeddings
        Case(
            "llama-bias",
            lambda: LlamaConfig(
                **{**_COMMON, "num_key_value_heads": 4, "tie_word_embeddings": True},
                attention_bias=True,
                mlp_bias=True,
            ),
            _replaced("LlamaAttention", "LlamaMLP"),
        ),
        # a 4-token sliding window on every layer (the test inputs are longer)
        Case(
            "mistral-sliding",
            lambda: MistralConfig(**_COMMON, sliding_window=4),
            _replaced("MistralAttention", "MistralMLP"),
        ),
        # q/k/v biases (always on in qwen2); layer 1 with a 4-token sliding window (layer_types)
        Case(
            "qwen2-sliding",
            lambda: Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1),
            _replaced("Qwen2Attention", "Qwen2MLP"),
        ),
        # head_dim 16 != hidden / heads (8), per-head q/k norms
        Case("qwen3", lambda: Qwen3Config(**_COMMON, head_dim=16), _replaced("Qwen3Attention", "Qwen3MLP")),
        # the shared expert of every sparse layer and the dense MLP of layer 1 (mlp_only_layers)
        Case(
            "qwen2_moe",
            lambda: Qwen2MoeConfig(**_COMMON, **_MOE, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
            _replaced("Qwen2MoeAttention", "Qwen2MoeMLP"),
        ),
        Case(
            "qwen3_moe",
            lambda: Qwen3MoeConfig(**{**_COMMON, **_MOE, "head_dim": 16}, mlp_only_layers=[1]),
            _replaced("Qwen3MoeAttention", "Qwen3MoeMLP"),
        ),
        # structural variants no family table listed: gemma's (1 + w) norm and scaled embeddings,
        # granite's multipliers, olmo2's q/k norms over all heads after the projections
        Case("gemma", lambda: GemmaConfig(**_COMMON, head_dim=8), _replaced("GemmaAttention", "GemmaMLP")),
        Case(
            "granite",
            lambda: GraniteConfig(
                **_COMMON,
                embedding_multiplier=3.0,
                attention_multiplier=0.2,
                residual_multiplier=0.5,
                logits_scaling=2.0,
            ),
            _replaced("GraniteAttention", "GraniteMLP"),
        ),
        Case("olmo2", lambda: Olmo2Config(**_COMMON), _replaced("Olmo2Attention", "Olmo2MLP")),
    )
}

MODELING = {
    "llama": modeling_llama,
    "mistral": modeling_mistral,
    "qwen2": modeling_qwen2,
    "qwen3": modeling_qwen3,
    "qwen2_moe": modeling_qwen2_moe,
    "qwen3_moe": modeling_qwen3_moe,
    "gemma": modeling_gemma,
    "granite": modeling_granite,
    "olmo2": modeling_olmo2,
}


def head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def expected_sites(config: Any) -> list[tuple[str, str, tuple[int, ...], bool]]:
    """``(class, path, sizes, bias)`` the detection must find, computed from the config alone."""
    attention, mlp = sorted(
        {name for case in CASES.values() if case.config.model_type == config.model_type for name in case.replaced}
    )
    q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
    bias = bool(getattr(config, "attention_bias", False) or config.model_type in ("qwen2", "qwen2_moe"))
    found: list[tuple[str, str, tuple[int, ...], bool]] = [(attention, "self_attn", (q, kv, kv), bias)]
    width = config.intermediate_size
    if config.model_type == "qwen2_moe":
        shared = config.shared_expert_intermediate_size
        found.append((mlp, "mlp.shared_expert", (shared, shared), False))
    found.append((mlp, "mlp", (width, width), bool(getattr(config, "mlp_bias", False))))
    return sorted(found)


@pytest.fixture(scope="session")
def checkpoints(tiny_checkpoints: TinyCheckpoints) -> dict[str, Path]:
    """Every case saved by vanilla transformers (the layout published checkpoints have)."""
    return tiny_checkpoints({name: case.build for name, case in CASES.items()})


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(autouse=True)
def _isolation(hfpatch_isolation: HfPatchIsolation) -> None:
    """Every test starts with hfpatch off and the environment's pack choice ignored, and errors if it
    leaves transformers' registries or class-level output recorders changed (``hfpatch_isolation``)."""
