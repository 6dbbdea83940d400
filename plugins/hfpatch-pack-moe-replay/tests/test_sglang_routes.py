"""``Routing.from_sglang``: what SGLang returns with ``return_routed_experts``, for a model's routers.

SGLang's package does not install here (0.5.23 requires torch 2.14.1 and CUDA packages:
flashinfer-python[cu13], cuda-python, ...), and the module of its encoder does not import without
its server stack, so the format is the one its code writes, re-done here with numpy and base64:
``sglang/srt/managers/detokenizer_manager.py`` (``DetokenizerManager._b64_encode_per_request``:
``pybase64.b64encode(item.numpy().tobytes())`` of an int32 tensor ``(tokens, num_hidden_layers,
top_k)``, a slot per decoder layer), read back by its ``extract_routed_experts_from_meta_info``
(``sglang/srt/state_capturer/routed_experts.py``: ``np.frombuffer(..., dtype=np.int32)``, flat);
the rows are ``[routed_experts_start_len, prompt + completion - 1)``
(``sglang/srt/managers/scheduler_components/batch_result_processor.py``). The model is the
dense-first qwen3_moe of ``test_vllm_routes.py`` (slot 0 zeros).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from hfpatch_pack_moe_replay import LIVE, Routing, RoutingError

from conftest import DENSE_FIRST, PACK, dense_first_config
from hfpatch_core.pytest_plugin import TinyCheckpoints
from hfpatch_core.testing import load_model


@pytest.fixture(scope="module")
def model(tiny_checkpoints: TinyCheckpoints) -> Any:
    path: Path = tiny_checkpoints({DENSE_FIRST: dense_first_config()})[DENSE_FIRST]
    return load_model(path, PACK)


def sglang_array(tokens: int, seed: int = 0) -> numpy.ndarray:
    """SGLang's routes for the dense-first model: int32 (tokens, 3, 2), slot 0 zeros, distinct experts of 4."""
    generator = numpy.random.default_rng(seed)
    array = numpy.zeros((tokens, 3, 2), dtype=numpy.int32)
    for layer in (1, 2):
        array[:, layer] = numpy.stack([generator.permutation(4)[:2] for _ in range(tokens)])
    return array


def encoded(array: numpy.ndarray) -> str:
    """SGLang's ``meta_info["routed_experts"]``: the base64 of the int32 tensor's raw bytes."""
    return base64.b64encode(torch.from_numpy(array).to(torch.int32).numpy().tobytes()).decode("utf-8")


def test_the_flat_int32_base64_is_read_with_the_models_shape(model: Any) -> None:
    array = sglang_array(6)
    routing = Routing.from_sglang(encoded(array), model=model)
    assert (routing.num_layers, routing.batch_size, routing.seq_len, routing.top_k) == (2, 1, 6, 2)
    assert routing.layers[0].tolist() == array[:, 1].tolist() and routing.layers[1].tolist() == array[:, 2].tolist()
    # the same rows from bytes, the decoded flat array (as extract_routed_experts_from_meta_info leaves it), 3-D
    flat = numpy.frombuffer(base64.b64decode(encoded(array)), dtype=numpy.int32)
    for same in (encoded(array).encode(), flat, array, torch.from_numpy(array)):
        assert Routing.from_sglang(same, model=model) == routing
    # vLLM's layout of the same routes is the same routing
    assert Routing.from_vllm(array.astype(numpy.uint8), model=model) == routing


def test_a_response_covers_the_whole_sequence_with_unreported_tokens_live(model: Any) -> None:
    prompt, completion = 5, 4
    full = sglang_array(prompt + completion - 1, seed=1)
    response = {"text": "", "meta_info": {"prompt_tokens": prompt, "completion_tokens": completion}}
    response["meta_info"]["routed_experts"] = encoded(full)
    routing = Routing.from_sglang(response, model=model)
    assert (routing.batch_size, routing.seq_len) == (1, 9)
    assert routing.truncated(8) == Routing.from_sglang(encoded(full), model=model)
    assert routing.layers[0][8].tolist() == [LIVE, LIVE], "the last token is never fed back"
    assert Routing.from_sglang(response["meta_info"], model=model) == routing
    # routed_experts_start_len=2: rows [2, 8) are sent, the first two LIVE
    response["meta_info"]["routed_experts"] = encoded(full[2:])
    offset = Routing.from_sglang(response, model=model, start_len=2)
    assert offset.layers[1][:2].eq(LIVE).all() and torch.equal(offset.layers[1][2:8], routing.layers[1][2:8])
    assert Routing.from_sglang(response, model=model) == offset, "without start_len, what the counts leave"
    with pytest.raises(RoutingError, match=r"has 6 rows; .* 8 routed tokens .* from routed_experts_start_len=1"):
        Routing.from_sglang(response, model=model, start_len=1)
    response["meta_info"]["routed_experts"] = encoded(sglang_array(prompt + completion + 1))
    with pytest.raises(RoutingError, match=r"has 10 rows; a sequence of 5 prompt and 4 generated tokens"):
        Routing.from_sglang(response, model=model)


def test_what_does_not_fit_the_model_is_refused_saying_what_was_sent(model: Any) -> None:
    expected = r"Qwen3MoeForCausalLM has 3 decoder layers, MoE at \[1, 2\] \(dense at \[0\]\), top_k 2, 4 experts"
    with pytest.raises(RoutingError, match=r"holds 10 expert ids, not a whole number of tokens of 3 decoder layers x "):
        Routing.from_sglang(encoded(numpy.zeros(10, dtype=numpy.int32)), model=model)
    with pytest.raises(RoutingError, match=r"decodes to 6 bytes, not a whole number of int32 values"):
        Routing.from_sglang(base64.b64encode(b"\0" * 6).decode(), model=model)
    with pytest.raises(RoutingError, match="not base64"):
        Routing.from_sglang("not base64!", model=model)
    wrong = sglang_array(4)
    wrong[2, 2] = [1, 4]
    with pytest.raises(RoutingError, match=r"^Routing\.from_sglang: routed_experts names expert \[1, 4\] at token 2"):
        Routing.from_sglang(encoded(wrong), model=model)
    dense = sglang_array(4)
    dense[3, 0] = [2, 1]
    with pytest.raises(RoutingError, match=r"routes dense decoder layer 0 \(token 3: \[2, 1\]\); " + expected):
        Routing.from_sglang(encoded(dense), model=model)
    twice = sglang_array(4)
    twice[1, 1] = [3, 3]
    with pytest.raises(RoutingError, match=r"names an expert twice at token 1 of decoder layer 1"):
        Routing.from_sglang(encoded(twice), model=model)
    # another model's routes whose length happens to divide: caught by their content
    with pytest.raises(RoutingError, match=r"Routing\.from_sglang: .*has shape \(4, 2, 2\)"):
        Routing.from_sglang(numpy.zeros((4, 2, 2), dtype=numpy.int32), model=model)
    with pytest.raises(RoutingError, match=r"no meta_info\['routed_experts'\].*return_routed_experts"):
        Routing.from_sglang({"meta_info": {"prompt_tokens": 3, "completion_tokens": 2}}, model=model)
    with pytest.raises(RoutingError, match="no prompt_tokens and completion_tokens"):
        Routing.from_sglang({"meta_info": {"routed_experts": encoded(sglang_array(3))}}, model=model)
    with pytest.raises(RoutingError, match="has dtype float32"):
        Routing.from_sglang(sglang_array(3).astype(numpy.float32), model=model)
