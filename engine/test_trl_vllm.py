"""moe-replay's ``ReplayGRPOTrainer`` with TRL 1.16's ``use_vllm=True``, against the real engine.

Each mode runs ``trl_grpo.py`` in a process of its own (TRL's colocated engine sets the process's
distributed environment): four GRPO steps over one generation of 2 prompts x 4 completions
(shuffled, split into micro-batches of 4, reused over ``num_iterations=2``), on the dense-first
qwen3_moe whose routers were moved after the engine started. Only TRL's weight sync is left out
(it needs CUDA or vLLM's GPU layers; trl_grpo.py says why, the README names the lines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ENGINE_ENV, SERVED

HERE = Path(__file__).resolve().parent
#: the decoder layers of the SERVED qwen3_moe that route (layer 0 is dense: vLLM's slot 0 is zeros)
MOE_SLOTS = [1, 2]


def grpo(mode: str, checkpoint: Path, tmp_path: Path, url: str | None = None) -> dict[str, Any]:
    out = tmp_path / "result.json"
    spec = {
        "mode": mode,
        "checkpoint": str(checkpoint),
        "moe_slots": MOE_SLOTS,
        "output_dir": str(tmp_path / "trainer"),
        "out": str(out),
        "url": url,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = subprocess.run(
        [sys.executable, str(HERE / "trl_grpo.py"), str(tmp_path / "spec.json")],
        cwd=tmp_path,
        env={**os.environ, **ENGINE_ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode:
        pytest.fail(f"TRL's GRPO step ({mode}) failed ({result.returncode}):\n{result.stderr[-8000:]}")
    answer: dict[str, Any] = json.loads(out.read_text())
    return answer


def check(result: dict[str, Any]) -> None:
    # one generation of 8 rows, scored by the old log-probability pass, then 4 loss forwards of 4 rows
    assert result["steps"] == 4 and len(result["losses"]) == 4
    assert result["kinds"] == ["old", "loss", "loss", "loss", "loss"]
    assert result["rows"] == 8, "every completion vLLM generated is a distinct row"
    # each forward ran vLLM's experts at every token vLLM reported (prompt and completion but the last)
    assert result["compared"] >= 8 * 8 + 4 * 4 * 8
    assert result["differing"] == 0
    # ... where the moved policy's own top-k differs: without the replay the step would run other experts
    assert result["live_differing"] > 0


def test_colocate_replays_the_engines_routes_through_a_grpo_step(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """TRL builds ``vllm.LLM`` in the process: the mixin asked it for routed experts (eager on CPU)."""
    result = grpo("colocate", checkpoints[SERVED], tmp_path)
    assert result["engine"] == {"routes": True, "eager": True}
    check(result)


def test_server_mode_replays_the_servers_routes_through_a_grpo_step(
    checkpoints: dict[str, Path], server: str, tmp_path: Path
) -> None:
    """TRL's ``VLLMClient`` against the server ``trl vllm-serve`` starts (``--enable-return-routed-experts``)."""
    check(grpo("server", checkpoints[SERVED], tmp_path, url=server))
