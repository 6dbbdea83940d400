"""``vllm_rollout_routing``: vLLM's answers to TRL's ``VLLMGeneration.generate`` laid out as TRL's rows.

The engine suite (``engine/test_trl_vllm.py``) runs ``ReplayGRPOTrainer`` with the real engine in
both modes; here the layout and the refusals, on stand-ins with the attributes and keys the
real answers have (``RequestOutput``s in colocate mode, ``/v1/completions`` JSON in server mode).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
from hfpatch_pack_moe_replay import LIVE, Routing, RoutingError
from hfpatch_pack_moe_replay.trl import vllm_rollout_routing
from transformers import Qwen3MoeConfig

from conftest import COMMON, PACK
from hfpatch_core.pytest_plugin import TinyCheckpoints
from hfpatch_core.testing import load_model

DENSE_FIRST = "qwen3_moe_dense_first"
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [5, 6, 7], [8, 9, 10, 11, 12]]
COMPLETIONS = [[20, 21], [22, 23, 24], [25], [26, 27]]


@pytest.fixture(scope="module")
def model(tiny_checkpoints: TinyCheckpoints) -> Any:
    config = Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, num_experts=4, moe_intermediate_size=16, head_dim=16, mlp_only_layers=[0]
    )
    path: Path = tiny_checkpoints({DENSE_FIRST: config})[DENSE_FIRST]
    return load_model(path, PACK)


def routes(tokens: int, seed: int) -> numpy.ndarray:
    generator = numpy.random.default_rng(seed)
    array = numpy.zeros((tokens, 3, 2), dtype=numpy.uint8)
    for layer in (1, 2):
        array[:, layer] = numpy.stack([generator.permutation(4)[:2] for _ in range(tokens)])
    return array


def arrays() -> list[numpy.ndarray]:
    return [routes(len(p) + len(c) - 1, seed) for seed, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True))]


def colocate_answers() -> list[SimpleNamespace]:
    """``LLM.generate``'s list: one ``RequestOutput`` per prompt, one completion each (TRL's n=1)."""
    return [
        SimpleNamespace(prompt_token_ids=p, outputs=[SimpleNamespace(token_ids=c, routed_experts=a)])
        for p, c, a in zip(PROMPTS, COMPLETIONS, arrays(), strict=True)
    ]


def npy(array: numpy.ndarray) -> str:
    buffer = io.BytesIO()
    numpy.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def server_answers() -> list[dict[str, Any]]:
    choices = [
        {"index": i, "prompt_token_ids": p, "token_ids": c, "routed_experts": npy(a)}
        for i, (p, c, a) in enumerate(zip(PROMPTS, COMPLETIONS, arrays(), strict=True))
    ]
    return [{"choices": choices}]


def test_rows_are_trls_prompts_left_padded_then_completions(model: Any) -> None:
    routing = vllm_rollout_routing(colocate_answers(), "colocate", model, PROMPTS, COMPLETIONS, prompt_length=6)
    # 6 padded prompt positions + the longest completion (3)
    assert (routing.batch_size, routing.seq_len) == (4, 9)
    for row, (prompt, completion, array) in enumerate(zip(PROMPTS, COMPLETIONS, arrays(), strict=True)):
        layer = routing.select(row).layers[1]  # decoder layer 2
        pad = 6 - len(prompt)
        fed = len(prompt) + len(completion) - 1
        assert layer[:pad].eq(LIVE).all(), "left padding routes live"
        assert layer[pad : pad + fed].tolist() == array[:, 2].tolist()
        assert layer[pad + fed :].eq(LIVE).all(), "the last token and the right padding route live"
    # the server's JSON gives the same rows
    assert vllm_rollout_routing(server_answers(), "server", model, PROMPTS, COMPLETIONS, 6) == routing
    # a process's slice of every process's rows (server mode gathers them; TRL slices by process index)
    second = vllm_rollout_routing(server_answers(), "server", model, PROMPTS[2:], COMPLETIONS[2:], 6, slice(2, 4))
    assert second == Routing.stack(routing.select([2, 3]).rows()).truncated(second.seq_len)


def test_answers_that_are_not_trls_rows_are_refused(model: Any) -> None:
    with pytest.raises(RoutingError, match=r"vLLM answered 4 completions \(2 for this process\) for 3 prompts"):
        vllm_rollout_routing(colocate_answers(), "colocate", model, PROMPTS[:3], COMPLETIONS[:3], 6, slice(2, 5))
    swapped = COMPLETIONS[::-1]
    with pytest.raises(RoutingError, match="completion for row 0 is not TRL's row 0"):
        vllm_rollout_routing(colocate_answers(), "colocate", model, PROMPTS, swapped, 6)
    with pytest.raises(RoutingError, match="row 1's prompt has 5 tokens, more than the padded prompt length 4"):
        vllm_rollout_routing(colocate_answers(), "colocate", model, PROMPTS, COMPLETIONS, 4)
    answers = colocate_answers()
    answers[0].outputs[0].routed_experts = None
    with pytest.raises(RoutingError, match="without enable_return_routed_experts=True"):
        vllm_rollout_routing(answers, "colocate", model, PROMPTS, COMPLETIONS, 6)
    served = server_answers()
    del served[0]["choices"][1]["routed_experts"]
    with pytest.raises(RoutingError, match="without routed_experts: start it with --enable-return-routed-experts"):
        vllm_rollout_routing(served, "server", model, PROMPTS, COMPLETIONS, 6)
    served = server_answers()
    served[0]["choices"][2]["routed_experts"] = npy(routes(9, 0))
    with pytest.raises(RoutingError, match=r"for row 2 have 9 rows; its 3-token prompt and 1-token completion route 3"):
        vllm_rollout_routing(served, "server", model, PROMPTS, COMPLETIONS, 6)
