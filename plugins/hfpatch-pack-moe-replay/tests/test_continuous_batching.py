"""Recording the routing of transformers' continuous batching (``generate_batch``), per request.

Continuous batching runs the model on a background thread and packs the new tokens of
several requests into each forward pass; ``record_routing(model, threads="any")`` records
it, and ``recording.requests`` gives each request the routes ``generate`` of its prompt
alone records. Replayed in a training forward over the padded batch of sequences, they
are the routes taken, token for token, also where the live routers have moved.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hfpatch_pack_moe_replay import Routing, RoutingError, record_routing, replay_routing, routers_of
from test_training import enable_checkpointing, perturb_routers
from transformers import GenerationConfig

from conftest import PACK, PAD
from hfpatch_core.testing import load_model

try:
    from transformers.generation import ContinuousBatchingConfig
except ImportError:  # transformers 5.3: the batching settings are read from the generation config
    ContinuousBatchingConfig = None

# transformers 5.3's continuous batching allocates pinned host memory, so it runs only with an accelerator
needs_continuous_batching = pytest.mark.skipif(
    ContinuousBatchingConfig is None and not torch.cuda.is_available(),
    reason="transformers 5.3's continuous batching pins host memory, which needs an accelerator",
)

# Two prompts share their first 8 tokens (two pages of 4), one repeats another: the cache
# shares those blocks (prefix caching), so their routes come from the request that computed
# them. 12 tokens a batch (BATCHING): prompts are prefilled in chunks and requests join mid-way.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [10, 11, 12],
    [5, 6, 7, 8, 9, 10, 11, 12, 20, 21],
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [30, 31, 32, 33, 34],
]
NEW_TOKENS = 6


# a small cache (on CPU the default sizes it from the free memory), 12 tokens a batch
BATCHING: dict[str, Any] = dict(num_blocks=32, max_batch_tokens=12)


def generation_config() -> GenerationConfig:
    # eos -1: every request generates NEW_TOKENS tokens, in generate as in generate_batch
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=PAD)


def generate_batch(model: Any) -> dict[str, Any]:
    if ContinuousBatchingConfig is None:
        config = generation_config()
        for key, value in {**BATCHING, "block_size": 4}.items():
            setattr(config, key, value)
        outputs: dict[str, Any] = model.generate_batch(PROMPTS, generation_config=config, progress_bar=False)
    else:
        batching = ContinuousBatchingConfig(**BATCHING, page_size=4, max_memory_percent=0.01)
        outputs = model.generate_batch(
            PROMPTS, generation_config=generation_config(), continuous_batching_config=batching, progress_bar=False
        )
    return outputs


@needs_continuous_batching
@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_each_request_gets_the_routes_of_generate_and_replays_them(checkpoints: dict[str, Path], name: str) -> None:
    model = load_model(checkpoints[name], PACK).eval()
    with record_routing(model, threads="any") as recording:
        outputs = generate_batch(model)
    routes = recording.requests
    assert len(outputs) == len(PROMPTS) and routes.keys() == outputs.keys()
    # more forward passes than tokens per request: requests were packed and chunked
    assert len(recording.steps) > NEW_TOKENS
    # fewer tokens computed than the requests cover: some prompt blocks were shared, not recomputed
    assert sum(step.num_tokens for step in recording.steps) < sum(route.num_tokens for route in routes.values())

    sequences = []
    for request_id, output in outputs.items():
        prompt = list(output.prompt_ids)
        with torch.no_grad(), record_routing(model) as alone:
            generated = model.generate(torch.tensor([prompt]), generation_config=generation_config())
        assert generated[0, len(prompt) :].tolist() == list(output.generated_tokens), request_id
        assert routes[request_id].seq_len == len(prompt) + NEW_TOKENS - 1
        assert routes[request_id] == alone.routing, request_id
        sequences.append(generated[0])

    # a training forward over the right-padded batch of sequences, whose routers moved
    length = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), length), PAD)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    real = mask.reshape(-1).bool()
    padded = [routes[request_id].padded(len(sequence)) for request_id, sequence in zip(outputs, sequences, strict=True)]
    routing = Routing.stack(padded)
    model.train()
    perturb_routers(model)
    # the last token of each sequence was never fed back: no recorded route, routed live
    fed = real.clone()
    for row, sequence in enumerate(sequences):
        fed[row * length + len(sequence) - 1] = False

    def differing(taken: Routing) -> int:
        return sum(
            int((layer[fed] != recorded[fed]).any(dim=-1).sum())
            for layer, recorded in zip(taken.layers, routing.layers, strict=True)
        )

    with record_routing(model) as live:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert differing(live.routing) > 0, "the perturbed routers still route as recorded: the test proves nothing"
    with replay_routing(model, routing), record_routing(model) as replayed:
        loss = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()].logsumexp(-1).mean()
        loss.backward()
    assert differing(replayed.routing) == 0
    assert all(router.weight.grad is not None for router in _router_weights(model))


@needs_continuous_batching
def test_a_model_loaded_without_the_pack_records_each_request_too(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["qwen3_moe"]).eval()  # vanilla routers: the hooks enter the selection mode
    with record_routing(model, threads="any") as recording:
        outputs = generate_batch(model)
    routes = recording.requests
    for request_id, output in outputs.items():
        with torch.no_grad(), record_routing(model) as alone:
            model.generate(torch.tensor([list(output.prompt_ids)]), generation_config=generation_config())
        assert routes[request_id] == alone.routing, request_id


def _router_weights(model: Any) -> list[Any]:
    return [router for _, router in routers_of(model)]


@needs_continuous_batching
def test_a_recording_of_this_thread_alone_sees_no_continuous_batch(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["qwen2_moe"], PACK).eval()
    with record_routing(model) as recording:
        generate_batch(model)
    with pytest.raises(RoutingError, match='threads="any"'):
        _ = recording.requests
    with pytest.raises(RoutingError, match="no forward pass"):
        _ = recording.routing


def test_a_recording_of_every_thread_keeps_each_forward_whole_and_skips_the_recomputation(
    checkpoints: dict[str, Path],
) -> None:
    model = load_model(checkpoints["qwen2_moe"], PACK).train()
    enable_checkpointing(model, reentrant=False)
    ids = [torch.arange(3, 3 + 8 * (row + 1)).reshape(row + 1, 8) for row in range(4)]
    with record_routing(model) as alone:
        for batch in ids:
            model(input_ids=batch, use_cache=False)
    barrier = threading.Barrier(len(ids))
    errors: list[BaseException] = []

    def run(batch: torch.Tensor) -> None:
        try:
            barrier.wait()
            model(input_ids=batch, use_cache=False).logits.sum().backward()
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    with record_routing(model, threads="any") as recording:
        threads = [threading.Thread(target=run, args=(batch,)) for batch in ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    # one step per forward (none for the backward's recomputation), each from one thread
    by_size = {step.batch_size: step for step in recording.steps}
    assert len(recording.steps) == len(ids) and sorted(by_size) == [1, 2, 3, 4]
    for expected in alone.steps:
        assert by_size[expected.batch_size] == expected
    with pytest.raises(RoutingError, match="generate_batch"):
        _ = recording.requests


def test_threads_must_be_context_or_any(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["qwen2_moe"], PACK)
    with pytest.raises(ValueError, match="threads"), record_routing(model, threads="all"):  # type: ignore[arg-type]
        pass
