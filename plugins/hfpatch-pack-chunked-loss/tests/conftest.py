"""Tiny random causal LMs of the head and loss structures the pack claims, saved by vanilla transformers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
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

from hfpatch_core.pytest_plugin import HfPatchIsolation, TinyCheckpoints
from hfpatch_core.testing import TINY_DECODER

VOCAB = 300

_COMMON: dict[str, Any] = {**TINY_DECODER, "vocab_size": VOCAB}


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
def checkpoints(tiny_checkpoints: TinyCheckpoints) -> dict[str, Path]:
    """Every case saved by vanilla transformers."""
    return tiny_checkpoints({name: case.build for name, case in CASES.items()})


def load(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A checkpoint loaded by vanilla transformers, eager attention (the same kernels on both sides)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    model.train()
    return model


def refused(model: PreTrainedModel) -> str:
    """Why ``install`` refuses ``model``, which it must leave as it was."""
    forward = model.forward
    with pytest.raises(chunked.ChunkedLossRefused) as refusal:
        chunked.install(model)
    assert chunked.installed(model) is None and model.forward == forward
    return str(refusal.value)


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(autouse=True)
def _isolation(hfpatch_isolation: HfPatchIsolation) -> None:
    """Every test starts with hfpatch off and leaves transformers' registries as it found them."""
