"""moe-replay inside training steps, as an RL trainer runs it.

A route recorded in one training forward and replayed in another gives that forward's loss
and gradients, every parameter's; under a replay the loss is a smooth function of the
router weights (the selection is fixed), and autograd's router gradient is its derivative;
with activation checkpointing the backward's recomputation replays the same routes and is
not recorded again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from hfpatch_pack_moe_replay import Routing, RoutingError, record_routing, replay_routing, routers_of

from conftest import PACK, PAD, VOCAB
from hfpatch_core.testing import load_model, training_batches


def training_step(model: Any, batch: tuple[torch.Tensor, ...]) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss of one forward and backward on ``batch``, and every parameter's gradient."""
    ids, mask, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def perturb_routers(model: nn.Module, scale: float = 0.3) -> None:
    """Another policy version's routers: the live top-k no longer picks the recorded experts."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, router in routers_of(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator, dtype=router.weight.dtype) * scale)


def recorded_elsewhere(checkpoints: dict[str, Path], seed: int) -> tuple[Any, tuple[torch.Tensor, ...], Routing]:
    """A qwen3_moe policy in training mode whose routers moved, a batch, and the batch's routing
    as the unmoved rollout model recorded it (which the policy's live routing no longer gives)."""
    rollout = load_model(checkpoints["qwen3_moe"], PACK)
    model = load_model(checkpoints["qwen3_moe"], PACK).train()
    perturb_routers(model)
    batch = training_batches(VOCAB, 1, pad_token_id=PAD, seed=seed)[0]
    with torch.no_grad(), record_routing(rollout) as recording:
        rollout(input_ids=batch[0], attention_mask=batch[1])
    return model, batch, recording.routing


def enable_checkpointing(model: Any, reentrant: bool) -> None:
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers > 5.3; the old name is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert model.model.layers[0].gradient_checkpointing


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_a_route_recorded_in_a_training_step_replays_with_its_loss_and_gradients(
    checkpoints: dict[str, Path], name: str
) -> None:
    model = load_model(checkpoints[name], PACK).train()
    batch = training_batches(VOCAB, 1, pad_token_id=PAD, seed=1)[0]
    with record_routing(model) as recording:
        loss, gradients = training_step(model, batch)
    routing = recording.routing
    assert len(recording.steps) == 1 and routing.batch_size == 4 and routing.seq_len == 12

    with replay_routing(model, routing):
        replayed_loss, replayed = training_step(model, batch)
    assert replayed_loss == loss
    assert replayed.keys() == gradients.keys() and any(".gate." in key for key in replayed)
    for key, gradient in gradients.items():
        assert torch.equal(replayed[key], gradient), key
    # the replay is what makes it the same: the routers moved, the live routing differs
    perturb_routers(model)
    with record_routing(model) as moved:
        training_step(model, batch)
    assert moved.routing != routing
    with record_routing(model) as again, replay_routing(model, routing):
        training_step(model, batch)
    assert again.routing == routing


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_under_replay_the_router_gradient_is_the_derivative_of_the_loss(
    checkpoints: dict[str, Path], name: str
) -> None:
    """Replay fixes the selection, so the loss is smooth in the router weights: a central
    difference along a random direction must match autograd's directional derivative
    (routers moved away from the recorded routing first; float32, as grouped_mm has no float64)."""
    rollout = load_model(checkpoints[name], PACK)
    model = load_model(checkpoints[name], PACK).train()
    batch = training_batches(VOCAB, 1, pad_token_id=PAD, seed=2)[0]
    ids, mask, labels = batch
    with torch.no_grad(), record_routing(rollout) as recording:
        rollout(input_ids=ids, attention_mask=mask)
    routing = recording.routing
    perturb_routers(model)

    with replay_routing(model, routing):
        _, gradients = training_step(model, batch)
    routers = routers_of(model)
    generator = torch.Generator().manual_seed(3)
    directions = [torch.randn(r.weight.shape, generator=generator, dtype=torch.float32) for _, r in routers]
    expected = sum(float((gradients[f"{n}.weight"] * d).sum()) for (n, _), d in zip(routers, directions, strict=True))
    assert abs(expected) > 1e-3, "the router gradient must be far from zero to prove anything"

    def loss_at(step: float) -> float:
        with torch.no_grad():
            for (_, router), direction in zip(routers, directions, strict=True):
                router.weight.add_(direction * step)
            try:
                with replay_routing(model, routing):
                    return float(model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss)
            finally:
                for (_, router), direction in zip(routers, directions, strict=True):
                    router.weight.sub_(direction * step)

    epsilon = 1e-2
    numeric = (loss_at(epsilon) - loss_at(-epsilon)) / (2 * epsilon)
    assert numeric == pytest.approx(expected, rel=1e-2)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_recomputes_the_replayed_routes_and_records_them_once(
    checkpoints: dict[str, Path], reentrant: bool
) -> None:
    model, batch, routing = recorded_elsewhere(checkpoints, seed=4)
    with replay_routing(model, routing):
        expected_loss, expected = training_step(model, batch)

    enable_checkpointing(model, reentrant)
    seen: list[tuple[bool, torch.Tensor]] = []  # (in the backward pass, the indices each router call selected)

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        seen.append((torch._C._current_graph_task_id() != -1, output[2].clone()))

    handles = [router.register_forward_hook(hook) for _, router in routers_of(model)]
    try:
        with record_routing(model) as recorded, replay_routing(model, routing):
            loss, gradients = training_step(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    # every router ran twice, once in the forward and once recomputed in the backward ...
    assert [in_backward for in_backward, _ in seen] == [False, False, True, True]
    # ... both times through the replayed experts
    layers = [routing.layers[0], routing.layers[1], routing.layers[1], routing.layers[0]]
    assert all(torch.equal(indices, want) for (_, indices), want in zip(seen, layers, strict=True))
    # the recomputation was not recorded a second time
    assert len(recorded.steps) == 1 and recorded.routing == routing
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert gradients.keys() == expected.keys()
    for key, gradient in expected.items():
        torch.testing.assert_close(gradients[key], gradient, rtol=1e-5, atol=1e-7, msg=key)


def test_a_checkpointed_backward_outside_the_replay_is_refused_not_routed_live(checkpoints: dict[str, Path]) -> None:
    """The recomputation would route live and give the gradients of other experts: an error
    names the fix instead. A live forward afterwards trains as usual."""
    model = load_model(checkpoints["qwen3_moe"], PACK).train()
    batch = training_batches(VOCAB, 1, pad_token_id=PAD, seed=6)[0]
    ids, mask, labels = batch
    with torch.no_grad(), record_routing(model) as recording:
        model(input_ids=ids, attention_mask=mask)
    perturb_routers(model)
    enable_checkpointing(model, reentrant=False)
    with replay_routing(model, recording.routing):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    with pytest.raises(RoutingError, match=r"outside replay_routing.*Call loss\.backward\(\) inside the"):
        loss.backward()
    _, gradients = training_step(model, batch)  # no replay in forward or backward: fine
    assert gradients and all(torch.isfinite(g).all() for g in gradients.values())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_recomputation_routes_as_its_forward_did_whatever_ran_in_between(
    checkpoints: dict[str, Path], reentrant: bool
) -> None:
    """Each checkpointed forward is remembered by its checkpoint call: a live forward's backward
    outside any replay recomputes live, also after a replayed forward (an RL rollout's reference
    pass); a replayed forward's backward outside its block raises, also after a live forward."""
    model, batch, routing = recorded_elsewhere(checkpoints, seed=8)
    ids, mask, labels = batch
    with replay_routing(model, routing):
        _, replayed = training_step(model, batch)
    live_loss, live = training_step(model, batch)
    assert any(not torch.equal(live[key], replayed[key]) for key in live)

    enable_checkpointing(model, reentrant)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    with torch.no_grad(), replay_routing(model, routing):  # a replayed forward in between
        model(input_ids=ids, attention_mask=mask)
    loss.backward()  # outside any replay, of a live forward: recomputed live
    assert loss.item() == pytest.approx(live_loss, abs=1e-6)
    for key, gradient in live.items():
        torch.testing.assert_close(model.get_parameter(key).grad, gradient, rtol=1e-5, atol=1e-7, msg=key)

    model.zero_grad(set_to_none=True)
    with replay_routing(model, routing):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # a live forward in between
    with pytest.raises(RoutingError, match=r"outside replay_routing.*Call loss\.backward\(\) inside the"):
        loss.backward()


def test_a_routing_is_one_per_training_batch(checkpoints: dict[str, Path]) -> None:
    """Each step of a loop replays its own batch's routing (one replay block per forward and backward)."""
    model = load_model(checkpoints["olmoe"], PACK).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = training_batches(VOCAB, 2, pad_token_id=PAD, seed=5)
    routings: list[Routing] = []
    for batch in batches:
        with torch.no_grad(), record_routing(model) as recording:
            model(input_ids=batch[0], attention_mask=batch[1])
        routings.append(recording.routing)
    assert routings[0] != routings[1]
    for batch, routing in zip(batches, routings, strict=True):
        with record_routing(model) as seen, replay_routing(model, routing):
            training_step(model, batch)
        optimizer.step()
        assert seen.routing == routing
