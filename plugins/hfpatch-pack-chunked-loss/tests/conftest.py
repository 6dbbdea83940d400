"""Tiny random causal LMs of the head and loss structures the pack claims, saved by vanilla transformers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    GraniteConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

import hfpatch_core
from hfpatch_core.pytest_plugin import HfPatchIsolation

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

VOCAB = 300

_COMMON: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    # far from uniform logits: a missing soft-cap or scale changes the loss by much more than 1e-6
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One checkpoint and what the probe must find between its head and its loss."""

    name: str
    build: Callable[[], PretrainedConfig]
    scale: float | None = None
    softcap: float | None = None


CASES = {
    case.name: case
    for case in (
        Case("llama", lambda: LlamaConfig(**_COMMON)),
        Case("llama-tied", lambda: LlamaConfig(**{**_COMMON, "tie_word_embeddings": True})),
        Case("qwen2", lambda: Qwen2Config(**_COMMON)),
        # soft-cap 3 with logits of a few units: tanh is far from linear there
        Case("gemma2", lambda: Gemma2Config(**_COMMON, head_dim=8, final_logit_softcapping=3.0), softcap=3.0),
        # cohere ties its embeddings by default
        Case("cohere", lambda: CohereConfig(**{**_COMMON, "tie_word_embeddings": True}, logit_scale=0.5), scale=0.5),
        Case("granite", lambda: GraniteConfig(**_COMMON, logits_scaling=4.0), scale=0.25),
    )
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case saved by vanilla transformers."""
    hfpatch_core.disable()
    paths = {}
    for seed, (name, case) in enumerate(CASES.items()):
        torch.manual_seed(seed)
        path = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(case.build()).save_pretrained(path)
        paths[name] = path
    return paths


def load(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A checkpoint loaded by vanilla transformers, eager attention (the same kernels on both sides)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    model.train()
    return model


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(autouse=True)
def _isolation(hfpatch_isolation: HfPatchIsolation) -> None:
    """Every test starts with hfpatch off and leaves transformers' registries as it found them."""
