"""``Routing.from_vllm``: what vLLM returns with ``enable_return_routed_experts``, for a model's routers.

vLLM's ``routed_experts`` is a numpy array ``(tokens, num_hidden_layers, top_k)``, ``uint8``
(``uint16`` above 256 experts): a slot for every decoder layer, a dense layer's slot zeros, a row
for every token of prompt + completion but the last, from ``routed_experts_prompt_start`` on; the
OpenAI server sends it as the base64 of an ``.npy`` file. The arrays here have that shape and
dtype (the engine suite, ``engine/``, proves the format against vLLM itself); a ``RequestOutput``
and a ``CompletionOutput`` are read by their attributes, which stand-ins with the same names give.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
import torch
from hfpatch_pack_moe_replay import LIVE, Routing, RoutingError, record_routing, replay_routing

from conftest import DENSE_FIRST, PACK, VOCAB, dense_first_config
from hfpatch_core.pytest_plugin import TinyCheckpoints
from hfpatch_core.testing import load_model


@pytest.fixture(scope="module")
def dense_first(tiny_checkpoints: TinyCheckpoints) -> Path:
    # every layer but the first routes: vLLM's array has a zero slot 0
    return tiny_checkpoints({DENSE_FIRST: dense_first_config()})[DENSE_FIRST]


@pytest.fixture(scope="module")
def model(dense_first: Path) -> Any:
    return load_model(dense_first, PACK)


def vllm_array(tokens: int, seed: int = 0, dtype: Any = numpy.uint8) -> numpy.ndarray:
    """What vLLM returns for the dense-first model: (tokens, 3, 2), slot 0 zeros, distinct experts of 4."""
    generator = numpy.random.default_rng(seed)
    array = numpy.zeros((tokens, 3, 2), dtype=dtype)
    for layer in (1, 2):
        array[:, layer] = numpy.stack([generator.permutation(4)[:2] for _ in range(tokens)])
    return array


def npy_base64(array: numpy.ndarray) -> str:
    """The OpenAI server's ``choices[i]["routed_experts"]``."""
    buffer = io.BytesIO()
    numpy.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def request_output(prompt: list[int], *completions: tuple[list[int], numpy.ndarray | None]) -> SimpleNamespace:
    """What ``LLM.generate`` returns for one prompt: the attributes from_vllm reads."""
    outputs = [SimpleNamespace(token_ids=tokens, routed_experts=array) for tokens, array in completions]
    return SimpleNamespace(prompt_token_ids=prompt, outputs=outputs)


def slots(routing: Routing, row: int = 0) -> list[torch.Tensor]:
    return [layer.reshape(routing.batch_size, routing.seq_len, routing.top_k)[row] for layer in routing.layers]


def test_a_dense_layers_slot_is_dropped_and_the_moe_slots_are_the_layers(model: Any) -> None:
    """The issue's failure: a qwen3_moe with mlp_only_layers=[0] (slot 0 zeros, [0, 0] per token)."""
    array = vllm_array(5)
    array.setflags(write=False)
    routing = Routing.from_vllm(array, model=model)
    assert (routing.num_layers, routing.batch_size, routing.seq_len, routing.top_k) == (2, 1, 5, 2)
    assert [layer.dtype for layer in routing.layers] == [torch.long, torch.long]
    assert routing.layers[0].tolist() == array[:, 1].tolist()
    assert routing.layers[1].tolist() == array[:, 2].tolist()
    # any integer dtype, numpy or torch or lists, the same routing
    for same in (
        array.astype(numpy.uint16),
        array.astype(numpy.int32),
        torch.from_numpy(array.astype(numpy.int64)),
        array.tolist(),
    ):
        assert Routing.from_vllm(same, model=model) == routing
    # and back: a slot per decoder layer, the dense one zeros
    back = routing.to_vllm(model=model)
    assert back.dtype == torch.long and numpy.array_equal(back.numpy(), array)
    assert routing.to_vllm().shape == (5, 2, 2), "without the model: one slot per routing layer"
    # a batch of one length (to_vllm's 4-D layout)
    batched = Routing.from_vllm(numpy.stack([array, vllm_array(5, seed=1)]), model=model)
    assert batched == Routing.stack([routing, Routing.from_vllm(vllm_array(5, seed=1), model=model)])
    assert numpy.array_equal(batched.to_vllm(model=model).numpy()[0], array)


def test_the_server_base64_npy_is_the_same_routing(model: Any) -> None:
    array = vllm_array(7, seed=2)
    assert Routing.from_vllm(npy_base64(array), model=model) == Routing.from_vllm(array, model=model)
    assert Routing.from_vllm(npy_base64(array).encode(), model=model) == Routing.from_vllm(array, model=model)
    for bad in ("not base64!", base64.b64encode(b"no npy header").decode()):
        with pytest.raises(RoutingError, match=r"base64 of an \.npy file \(choices\[i\]\.routed_experts\)"):
            Routing.from_vllm(bad, model=model)
    with pytest.raises(RoutingError, match="has dtype float32; expert ids are integers"):
        Routing.from_vllm(npy_base64(array.astype(numpy.float32)), model=model)


def test_a_request_output_covers_the_whole_sequence_with_unreported_tokens_live(model: Any) -> None:
    prompt, generated = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14]
    full = vllm_array(len(prompt) + len(generated) - 1, seed=3)  # the last token has no row
    routing = Routing.from_vllm(request_output(prompt, (generated, full)), model=model)
    assert (routing.batch_size, routing.seq_len) == (1, 10)
    for layer, slot in zip(slots(routing), (1, 2), strict=True):
        assert layer[:9].tolist() == full[:, slot].tolist()
        assert layer[9].tolist() == [LIVE, LIVE], "the last sampled token is never fed back: LIVE"
    completion = request_output(prompt, (generated, full)).outputs[0]
    assert Routing.from_vllm(completion, model=model) == Routing.from_vllm(full, model=model)

    # SamplingParams(routed_experts_prompt_start=3): the first 3 prompt rows are not sent
    offset = Routing.from_vllm(request_output(prompt, (generated, full[3:])), model=model)
    assert offset.seq_len == 10
    for got, want in zip(slots(offset), slots(routing), strict=True):
        assert got[:3].eq(LIVE).all() and torch.equal(got[3:], want[3:])

    # n=2: each completion a row, right-padded to the longest sequence
    short = vllm_array(len(prompt) + 2 - 1, seed=4)
    two = Routing.from_vllm(request_output(prompt, (generated, full), ([11, 12], short)), model=model)
    assert (two.batch_size, two.seq_len) == (2, 10)
    assert torch.equal(slots(two, 0)[0], slots(routing)[0])
    assert slots(two, 1)[1][:7].tolist() == short[:, 2].tolist() and slots(two, 1)[1][7:].eq(LIVE).all()

    # a batch of requests, left-padded as a trainer pads its prompts
    batch = Routing.stack([routing, Routing.from_vllm(request_output([5, 6], ([7], short[:2])), model=model)])
    assert (batch.batch_size, batch.seq_len) == (2, 10)


def test_what_does_not_fit_says_what_vllm_sent_and_what_the_model_has(model: Any) -> None:
    expected = r"Qwen3MoeForCausalLM has 3 decoder layers, MoE at \[1, 2\] \(dense at \[0\]\), top_k 2, 4 experts"
    two_slots = vllm_array(5)[:, 1:]
    with pytest.raises(RoutingError, match=r"has shape \(5, 2, 2\) \(2 decoder layers, top_k 2\); " + expected):
        Routing.from_vllm(two_slots, model=model)
    top3 = numpy.zeros((5, 3, 3), dtype=numpy.uint8)
    with pytest.raises(RoutingError, match=r"\(3 decoder layers, top_k 3\); " + expected):
        Routing.from_vllm(top3, model=model)
    too_high = vllm_array(5)
    too_high[2, 2] = [1, 4]
    with pytest.raises(
        RoutingError, match=r"names expert \[1, 4\] at token 2 of decoder layer 2; its router model\.la"
    ):
        Routing.from_vllm(too_high, model=model)
    routed_dense = vllm_array(5)
    routed_dense[3, 0] = [2, 1]
    with pytest.raises(RoutingError, match=r"routes dense decoder layer 0 \(token 3: \[2, 1\]\); " + expected):
        Routing.from_vllm(routed_dense, model=model)
    twice = vllm_array(5)
    twice[1, 1] = [3, 3]
    with pytest.raises(RoutingError, match=r"names an expert twice at token 1 of decoder layer 1 \(\[3, 3\]\)"):
        Routing.from_vllm(twice, model=model)
    with pytest.raises(RoutingError, match=r"zeros at MoE decoder layer 1 .*every token.*enforce_eager=True"):
        Routing.from_vllm(numpy.zeros((5, 3, 2), dtype=numpy.uint8), model=model)
    with pytest.raises(RoutingError, match=r"\(tokens, num_hidden_layers, top_k\).*has shape \(4, 2\)"):
        Routing.from_vllm(numpy.zeros((4, 2), dtype=numpy.uint8), model=model)
    with pytest.raises(RoutingError, match="has dtype float64"):
        Routing.from_vllm(numpy.zeros((4, 3, 2)), model=model)

    prompt = [5, 6, 7]
    with pytest.raises(RoutingError, match="enable_return_routed_experts=True"):
        Routing.from_vllm(request_output(prompt, ([8, 9], None)), model=model)
    with pytest.raises(RoutingError, match=r"has 6 rows; a sequence of 3 prompt and 2 generated tokens has 4 routed"):
        Routing.from_vllm(request_output(prompt, ([8, 9], vllm_array(6))), model=model)
    with pytest.raises(RoutingError, match="no prompt_token_ids"):
        Routing.from_vllm(SimpleNamespace(prompt_token_ids=None, outputs=[]), model=model)
    with pytest.raises(TypeError):
        Routing.from_vllm(vllm_array(5))  # type: ignore[call-arg]  # the model says which layers route


def test_vllm_routes_replay_on_a_model_whose_routers_moved(dense_first: Path, model: Any) -> None:
    """A model's own routes, in vLLM's layout, replayed on a copy with other routers: the routes are taken."""
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), record_routing(model) as recording:
        model(input_ids=ids)
    recorded = recording.routing
    array = numpy.zeros((9, 3, 2), dtype=numpy.uint8)
    array[:, 1], array[:, 2] = recorded.layers[0].numpy(), recorded.layers[1].numpy()

    trained = load_model(dense_first, PACK)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 2.0)
    with torch.no_grad(), record_routing(trained) as live:
        trained(input_ids=ids)
    assert live.routing != recorded, "the moved routers select other experts on their own"
    with (
        torch.no_grad(),
        record_routing(trained) as replayed,
        replay_routing(trained, Routing.from_vllm(array, model=trained)),
    ):
        trained(input_ids=ids)
    assert replayed.routing == recorded


def test_a_model_loaded_without_the_pack_tells_its_layers_too(dense_first: Path) -> None:
    vanilla = load_model(dense_first)
    assert Routing.from_vllm(vllm_array(4), model=vanilla).num_layers == 2
