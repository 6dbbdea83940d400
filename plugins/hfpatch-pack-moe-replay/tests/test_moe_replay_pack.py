"""The moe-replay pack on tiny random checkpoints of every covered family, used as a trainer would.

Without a replay the patched model must be vanilla transformers, bit for bit; with one,
its routers must select the replayed experts and score them from their live weights.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import hfpatch_pack_moe_replay
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from hfpatch_pack_moe_replay import (
    LIVE,
    ReplayableRouter,
    Routing,
    RoutingError,
    discover,
    record_routing,
    replay_routing,
    replayable_class,
    routers_of,
)
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

import hfpatch_core
from conftest import CASES, COMMON, PACK, PAD, VOCAB
from hfpatch_core import LoadContext, PackWarning, Patch
from hfpatch_core.testing import (
    assert_pack_equivalent,
    discover_from_wheel,
    load_model,
    padded_batch,
    reloaded_in_a_fresh_process,
)

PACK_DIR = Path(__file__).resolve().parents[1]


# --- helpers ----------------------------------------------------------------------------


def router_class(family: str) -> type[nn.Module]:
    """The router class the pack discovers for ``family`` (each test family has one)."""
    (found,) = discover(family, CASES[family].config).routers
    return found.router_class


def routers(model: nn.Module) -> list[nn.Module]:
    """Every router of ``model``: never none, so that an assertion over them all cannot pass vacuously."""
    found = [router for _, router in routers_of(model)]
    assert len(found) == model.config.num_hidden_layers, f"{len(found)} routers in {type(model).__name__}"
    return found


def record(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, routing: Routing | None = None) -> Routing:
    """The routing of one forward pass (under ``routing``'s replay when given)."""
    with torch.no_grad(), record_routing(model) as recording:
        if routing is None:
            model(input_ids=ids, attention_mask=mask)
        else:
            with replay_routing(model, routing):
                model(input_ids=ids, attention_mask=mask)
    return recording.routing


def perturb(model: nn.Module, scale: float = 0.3, seed: int = 7) -> None:
    """Move every router weight by random noise (another policy version's routers)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * scale)


def router_weight_grads(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    labels = ids.masked_fill(mask == 0, -100)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    grads = [router.weight.grad for router in routers(model)]
    assert all(grad is not None for grad in grads)
    return [grad.clone() for grad in grads if grad is not None]


@dataclasses.dataclass
class RouterCalls:
    """What each router received and returned, captured with the test's own hooks."""

    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    outputs: list[tuple[torch.Tensor, ...]] = dataclasses.field(default_factory=list)


def capture(model: nn.Module) -> tuple[RouterCalls, list[Any]]:
    calls = RouterCalls()

    def hook(_module: nn.Module, args: Any, output: Any) -> None:
        calls.inputs.append(args[0].detach())
        calls.outputs.append(tuple(output))

    return calls, [router.register_forward_hook(hook) for router in routers(model)]


# --- the pack's hook --------------------------------------------------------------------


def test_the_hook_patches_exactly_the_router_of_each_covered_family() -> None:
    for model_type, case in CASES.items():
        original = router_class(model_type)
        replayable = replayable_class(original)
        context = LoadContext(model_type, "AnyForCausalLM", config=case.config)
        (patch,) = hfpatch_pack_moe_replay.provide_patches(context)
        assert patch == Patch(original.__name__, replayable)
        assert not patch.is_pattern
        module = sys.modules[original.__module__]
        assert getattr(module, original.__name__) is original, "the target is the installed router class"
        assert issubclass(replayable, original) and replayable.original is original
        assert issubclass(replayable, ReplayableRouter)
        assert replayable.__init__ is original.__init__, "the parent's constructor is kept"
    llama = LoadContext("llama", "LlamaForCausalLM", config=transformers.LlamaConfig())
    for context in (llama, LoadContext("qwen2_moe", "AnyModel"), LoadContext(None, "AnyModel")):
        assert hfpatch_pack_moe_replay.provide_patches(context) == []
    assert not hasattr(hfpatch_pack_moe_replay, "provide_converters"), "no weight-layout change, no converters"


# --- without a replay: vanilla transformers ---------------------------------------------


def test_without_replay_the_patched_model_is_vanilla_bit_for_bit(checkpoints: dict[str, Path], family: str) -> None:
    router = router_class(family).__name__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PackWarning)
        report = assert_pack_equivalent(
            PACK, checkpoints[family], expected_replacements=[router], train_steps=5, train_checkpointing=[True]
        )
    assert report.max_abs_diff == 0.0 and report.generation_match and report.round_trip
    # trained with activation checkpointing (the backward recomputes every router), bit for bit
    (training,) = report.training
    assert training.ok and training.max_loss_diff == training.max_gradient_diff == training.max_parameter_diff == 0
    # nothing to warn about: also not MiniMax's persistent buffer under transformers 5.3,
    # which the save-layout check once passed to remove_tied_weights_from_state_dict
    assert not [str(warning.message) for warning in caught if issubclass(warning.category, PackWarning)]

    vanilla, patched = load_model(checkpoints[family]), load_model(checkpoints[family], PACK)
    assert {type(router) for router in routers(patched)} == {replayable_class(router_class(family))}
    assert type(routers(vanilla)[0]) is router_class(family)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    with torch.no_grad():
        expected = vanilla(input_ids=ids, attention_mask=mask, output_router_logits=True)
        actual = patched(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert torch.equal(actual.logits, expected.logits)
    assert len(actual.router_logits) == len(expected.router_logits) == 2
    for got, want in zip(actual.router_logits, expected.router_logits, strict=True):
        assert torch.equal(got, want)
    # the recorder works on the vanilla model too, and sees the same routing
    assert record(vanilla, ids, mask) == record(patched, ids, mask)


def test_a_whole_patched_model_reloads_in_a_fresh_process(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The replayable routers are built at runtime: ``torch.save`` of the whole model loads back with
    ``torch.load`` in a process that has built none of them (they pickle as their builder)."""
    model = load_model(checkpoints["qwen2_moe"], PACK)
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    assert classes["model.layers.0.mlp.gate"] == "ReplayableQwen2MoeTopKRouter"
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    reloaded, logits = reloaded_in_a_fresh_process(model, ids, mask, tmp_path / "reloaded")
    assert reloaded == classes
    assert torch.equal(logits, model(input_ids=ids, attention_mask=mask).logits.detach())


# --- replay -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_replaying_a_models_own_routing_changes_nothing(
    checkpoints: dict[str, Path], family: str, dtype: torch.dtype
) -> None:
    """Same logits, router outputs (dtypes included) and router gradients, bit for bit: the
    replayed scores are exactly what the family computes when its own top-k picks those experts."""
    model = load_model(checkpoints[family], PACK, dtype=dtype)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=1)
    routing = record(model, ids, mask)
    assert (routing.num_layers, routing.batch_size, routing.seq_len, routing.top_k) == (2, 3, 12, 2)

    calls, handles = capture(model)
    try:
        with torch.no_grad():
            live = model(input_ids=ids, attention_mask=mask).logits
            with replay_routing(model, routing):
                replayed = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(replayed, live)
    for before, after in zip(calls.outputs[:2], calls.outputs[2:], strict=True):
        for a, b in zip(before, after, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)

    expected = router_weight_grads(model, ids, mask)
    with replay_routing(model, routing):
        actual = router_weight_grads(model, ids, mask)
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == dtype and got.abs().sum() > 0
        assert torch.equal(got, want)


def test_replay_on_perturbed_router_weights_selects_the_recorded_experts(
    checkpoints: dict[str, Path], family: str
) -> None:
    """The rollout policy routed; the trained policy's routers moved; replay forces the
    rollout's experts and scores them with the trained policy's router weights."""
    case = CASES[family]
    rollout, trained = load_model(checkpoints[family], PACK), load_model(checkpoints[family], PACK)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=2)
    recorded = record(rollout, ids, mask)
    perturb(trained)

    live = record(trained, ids, mask)
    flipped = [(a != b).any(dim=1).float().mean().item() for a, b in zip(live.layers, recorded.layers, strict=True)]
    assert min(flipped) > 0.1, f"the perturbation must move the routing to prove anything: {flipped}"

    assert record(trained, ids, mask, recorded) == recorded
    calls, handles = capture(trained)
    try:
        with torch.no_grad(), replay_routing(trained, recorded):
            trained(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    for layer, (hidden, (_, scores, indices)) in enumerate(zip(calls.inputs, calls.outputs, strict=True)):
        weight = routers(trained)[layer].weight
        probabilities = F.softmax(F.linear(hidden, weight), dim=-1, dtype=torch.float)
        expected = probabilities.gather(1, recorded.layers[layer])
        if case.renormalises(trained.config):
            expected = expected / expected.sum(dim=-1, keepdim=True)
        assert torch.equal(indices, recorded.layers[layer])
        torch.testing.assert_close(scores.float(), expected, rtol=0, atol=1e-6)
        assert scores.dtype == calls.outputs[layer][1].dtype

    with replay_routing(trained, recorded):
        grads = router_weight_grads(trained, ids, mask)
    assert all(torch.isfinite(grad).all() and grad.abs().sum() > 0 for grad in grads), "gradients reach every router"
    assert any(not torch.equal(a, b) for a, b in zip(grads, router_weight_grads(trained, ids, mask), strict=True))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_routing_recorded_during_generate_replays_on_the_full_sequence(checkpoints: dict[str, Path], name: str) -> None:
    """``generate`` with a KV cache runs the prompt, then one token per step: the
    recording concatenates them per sequence, in order, for one training forward."""
    model = load_model(checkpoints[name], PACK)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=3)
    new = 6
    with torch.no_grad(), record_routing(model) as recording:
        sequences = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=PAD,
        )
    assert sequences.shape == (3, 12 + new)
    steps = recording.steps
    assert [(step.batch_size, step.seq_len) for step in steps] == [(3, 12)] + [(3, 1)] * (new - 1)
    generated = recording.routing
    assert (generated.batch_size, generated.seq_len) == (3, 12 + new - 1), "the last token is never fed back"
    with pytest.raises(RoutingError, match=r"padded\(seq_len\)"):
        record(model, sequences, torch.cat([mask, torch.ones(3, new, dtype=mask.dtype)], dim=1), generated)

    # the training forward over generate's output, positions as generate computed them
    full_mask = torch.cat([mask, torch.ones(3, new, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)

    def forward_routing(routing: Routing | None) -> Routing:
        with torch.no_grad(), record_routing(model) as inner:
            if routing is None:
                model(input_ids=sequences, attention_mask=full_mask, position_ids=positions)
            else:
                with replay_routing(model, routing):
                    model(input_ids=sequences, attention_mask=full_mask, position_ids=positions)
        return inner.routing

    live = forward_routing(None)
    replayed = forward_routing(generated.padded(sequences.shape[1]))
    for layer in range(2):
        want = generated.layers[layer].reshape(3, 12 + new - 1, 2)
        got = replayed.layers[layer].reshape(3, 12 + new, 2)
        assert torch.equal(got[:, :-1], want)
        assert torch.equal(got[:, -1], live.layers[layer].reshape(3, 12 + new, 2)[:, -1]), "the LIVE token"
        # the full forward's own routing agrees with the incremental one almost everywhere,
        # which only the right concatenation order gives
        agree = (live.layers[layer].reshape(3, 12 + new, 2)[:, :-1] == want).all(-1).float().mean().item()
        assert agree > 0.9, agree


def test_live_rows_keep_the_routers_own_selection_for_padding(checkpoints: dict[str, Path]) -> None:
    """Sequences routed one by one (as vLLM returns them), stacked into a left-padded batch."""
    model = load_model(checkpoints["qwen2_moe"], PACK)
    trained = load_model(checkpoints["qwen2_moe"], PACK)
    perturb(trained)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=4)
    lengths = mask.sum(dim=1).tolist()
    singles = [record(model, ids[i : i + 1, 12 - n :], mask[i : i + 1, 12 - n :]) for i, n in enumerate(lengths)]
    assert [single.seq_len for single in singles] == lengths
    stacked = Routing.stack(singles, padding_side="left")
    assert (stacked.batch_size, stacked.seq_len) == (3, 12)

    live, replayed = record(trained, ids, mask), record(trained, ids, mask, stacked)
    pad = (mask == 0).reshape(-1)
    for layer in range(2):
        assert torch.equal(stacked.layers[layer][pad], torch.full((int(pad.sum()), 2), LIVE))
        assert torch.equal(replayed.layers[layer][~pad], stacked.layers[layer][~pad])
        assert torch.equal(replayed.layers[layer][pad], live.layers[layer][pad])


def test_only_moe_layers_have_routing(tmp_path: Path) -> None:
    """A dense layer (``mlp_only_layers``) has no router, and no entry in the routing."""
    config = Qwen2MoeConfig(
        **{**COMMON, "num_hidden_layers": 3},
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[1],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_model(tmp_path, PACK)
    assert [name for name, _ in routers_of(model)] == ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=5)
    routing = record(model, ids, mask)
    assert routing.num_layers == 2
    three = Routing((*routing.layers, routing.layers[0]), batch_size=3)
    with pytest.raises(RoutingError, match=r"3 layers, Qwen2MoeForCausalLM has 2 MoE routers .*layers\.2\.mlp\.gate"):
        record(model, ids, mask, three)


# --- the value ----------------------------------------------------------------------------


def test_a_routing_is_a_frozen_value() -> None:
    source = torch.tensor([[0, 1], [2, 3], [1, 0], [LIVE, LIVE]], dtype=torch.int32)
    routing = Routing([source, source.flip(1)], batch_size=2)
    assert isinstance(routing.layers, tuple) and routing.layers[0].dtype == torch.long
    source[0, 0] = 3
    assert routing.layers[0][0].tolist() == [0, 1], "the routing copies its input"
    with pytest.raises(dataclasses.FrozenInstanceError):
        routing.batch_size = 1  # type: ignore[misc]
    assert routing == Routing([routing.layers[0], routing.layers[1]], batch_size=2)
    assert routing != Routing([routing.layers[0], routing.layers[1]], batch_size=1)
    assert routing != Routing([routing.layers[1], routing.layers[0]], batch_size=2)
    with pytest.raises(TypeError):
        hash(routing)
    assert repr(routing) == "Routing(num_layers=2, batch_size=2, seq_len=2, top_k=2)"
    right = routing.padded(3)
    assert right.layers[0].reshape(2, 3, 2)[:, 2].eq(LIVE).all() and right.seq_len == 3
    left = routing.padded(4, side="left")
    assert left.layers[0].reshape(2, 4, 2)[:, :2].eq(LIVE).all()
    assert torch.equal(left.layers[0].reshape(2, 4, 2)[:, 2:], routing.layers[0].reshape(2, 2, 2))


_ID = torch.tensor([[0, 1], [1, 2]])


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Routing(_ID), "sequence of per-layer"),  # type: ignore[arg-type]
        (lambda: Routing(()), "no layer"),
        (lambda: Routing((_ID.float(),)), "dtype torch.float32"),
        (lambda: Routing((_ID[0],)), r"shape \(2,\); each layer is \(tokens, top_k\)"),
        (lambda: Routing((_ID, _ID[:1])), r"layer 1 has shape \(1, 2\), layer 0 has \(2, 2\)"),
        (lambda: Routing((torch.tensor([[0, -2]]),)), "expert id -2"),
        (lambda: Routing((torch.tensor([[0, 1], [LIVE, 3]]),)), "token 1: .* mixes LIVE"),
        (lambda: Routing((torch.tensor([[0, 1], [3, 3]]),)), "token 1: .* names an expert twice"),
        (lambda: Routing((_ID,), batch_size=3), "2 tokens, which batch_size=3 does not divide"),
        (lambda: Routing((_ID,), batch_size=0), "positive int"),
        (lambda: Routing((_ID,)).padded(1), "shorter than the routing's seq_len 2"),
        (lambda: Routing.stack([Routing((_ID,)), Routing((_ID, _ID))]), "stack routings of one model"),
    ],
)
def test_malformed_routings_are_rejected_with_what_and_how(build: Any, message: str) -> None:
    with pytest.raises(RoutingError, match=message):
        build()


# --- errors against a model -------------------------------------------------------------


def rejected(model: nn.Module, routing: Any) -> str:
    """The message ``replay_routing`` raises when entering the block (before any forward)."""
    with pytest.raises(RoutingError) as raised, replay_routing(model, routing):
        pass
    return str(raised.value)


def test_a_routing_that_does_not_fit_the_model_is_rejected_before_or_at_the_forward(
    checkpoints: dict[str, Path],
) -> None:
    model = load_model(checkpoints["qwen3_moe"], PACK)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=7)
    routing = record(model, ids, mask)

    message = rejected(model, Routing(routing.layers[:1], batch_size=3))
    assert "the routing has 1 layers, Qwen3MoeForCausalLM has 2 MoE routers" in message
    assert "model.layers.0.mlp.gate, model.layers.1.mlp.gate" in message and "dense layers excluded" in message
    top3 = Routing(tuple(torch.tensor([[0, 1, 2]] * 36) for _ in range(2)), batch_size=3)
    assert re.search(
        r"layer 0 \(model\.layers\.0\.mlp\.gate\) selects top_k=2 .*\(36, 2\), got \(36, 3\)", rejected(model, top3)
    )
    too_high = Routing(tuple(torch.tensor([[0, 4]] * 36) for _ in range(2)), batch_size=3)
    assert "has 4 experts (ids 0..3), the routing names expert 4" in rejected(model, too_high)
    assert "routing must be a Routing, got Tensor" in rejected(model, routing.to_vllm())
    assert "holds no transformers config" in rejected(nn.Linear(2, 2), routing)
    vanilla = load_model(checkpoints["qwen3_moe"])
    assert "loaded without the moe-replay pack" in rejected(vanilla, routing)
    assert "hfpatch_core.enable('moe-replay')" in rejected(vanilla, routing)

    shorter = ids[:, 2:], mask[:, 2:]
    with pytest.raises(
        RoutingError,
        match=r"layer 0 \(model\.layers\.0\.mlp\.gate\) routes 30 tokens .*expected routing of shape \(30, 2\), "
        r"got \(36, 2\).*batch × seq_len",
    ):
        record(model, *shorter, routing)
    # and a forward that fits runs normally afterwards
    assert record(model, ids, mask, routing) == routing


# --- scope: the block, this model, this thread -------------------------------------------


def test_a_replay_is_scoped_to_its_block_model_and_thread(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["mixtral"]
    source, model, other = load_model(path, PACK), load_model(path, PACK), load_model(path, PACK)
    perturb(model)
    perturb(other)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=8)
    recorded = record(source, ids, mask)
    live = record(model, ids, mask)
    assert live != recorded

    seen: dict[str, Any] = {}
    with torch.no_grad(), replay_routing(model, recorded):

        def in_thread() -> None:
            seen["thread"] = record(model, ids, mask)

        worker = threading.Thread(target=in_thread)
        worker.start()
        worker.join()
        seen["other model"] = record(other, ids, mask)
        seen["this thread"] = record(model, ids, mask)
    assert seen["this thread"] == recorded
    assert seen["thread"] == live, "another thread's forward of the same model routes live"
    assert seen["other model"] == live, "another model of the same family routes live"
    assert record(model, ids, mask) == live, "after the block the model routes live"

    with pytest.raises(KeyError), replay_routing(model, recorded):
        raise KeyError("the training step failed")
    assert record(model, ids, mask) == live
    assert all(not router._forward_hooks and not router._forward_pre_hooks for router in routers(model))
    assert all(not block._forward_pre_hooks for block in (layer.mlp for layer in model.model.layers))


def test_a_recording_sees_only_its_thread_and_is_removed_afterwards(checkpoints: dict[str, Path]) -> None:
    model = load_model(checkpoints["flex_olmo"], PACK)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=9)
    with torch.no_grad(), record_routing(model) as recording:
        worker = threading.Thread(target=lambda: model(input_ids=ids, attention_mask=mask))
        worker.start()
        worker.join()
        assert recording.steps == ()
        model(input_ids=ids[:2], attention_mask=mask[:2])
    assert [(step.batch_size, step.seq_len) for step in recording.steps] == [(2, 12)]
    assert recording.layer_names == ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
    assert all(not router._forward_hooks for router in routers(model))
    with record_routing(model) as empty:
        pass
    with pytest.raises(RoutingError, match="no forward pass ran inside the block"):
        empty.routing  # noqa: B018 - the property raises
    with torch.no_grad(), record_routing(model) as mixed:
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids[:1], attention_mask=mask[:1])
    with pytest.raises(RoutingError, match=r"batch sizes \[3, 1\].*recording\.steps"):
        mixed.routing  # noqa: B018


@pytest.mark.parametrize("backward_thread", ["caller", "autograd worker"])
def test_gradient_checkpointing_recomputes_with_the_replayed_routing(
    checkpoints: dict[str, Path], backward_thread: str
) -> None:
    """The recomputation in ``backward()`` replays too, also on a thread that is not the
    one that opened the block (autograd runs GPU backward on its own threads)."""
    source, model = load_model(checkpoints["qwen3_moe"], PACK), load_model(checkpoints["qwen3_moe"], PACK)
    perturb(model)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=10)
    recorded = record(source, ids, mask)
    model.train()
    with replay_routing(model, recorded):
        expected = router_weight_grads(model, ids, mask)
    expert_grad = model.model.layers[0].mlp.experts.gate_up_proj.grad.clone()

    checkpointing = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers > 5.3; the old name is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    assert model.model.layers[0].gradient_checkpointing
    model.zero_grad(set_to_none=True)
    labels = ids.masked_fill(mask == 0, -100)
    with replay_routing(model, recorded):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        if backward_thread == "caller":
            loss.backward()
        else:
            worker = threading.Thread(target=loss.backward)
            worker.start()
            worker.join()
    for router, want in zip(routers(model), expected, strict=True):
        assert router.weight.grad is not None
        torch.testing.assert_close(router.weight.grad, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(model.model.layers[0].mlp.experts.gate_up_proj.grad, expert_grad, rtol=1e-5, atol=1e-7)


# --- nothing is left behind ---------------------------------------------------------------


def test_a_patched_load_leaves_transformers_unpatched(checkpoints: dict[str, Path], family: str) -> None:
    original = router_class(family)
    module = sys.modules[original.__module__]
    load_model(checkpoints[family], PACK)
    assert getattr(module, original.__name__) is original
    assert type(routers(load_model(checkpoints[family]))[0]) is original


# --- discovery from a real wheel --------------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json, sys
    import importlib_metadata, torch
    import hfpatch_core
    from hfpatch_pack_moe_replay import record_routing, replay_routing
    from transformers import AutoModelForCausalLM

    hfpatch_core.enable()  # HF_PATCH_PACKS=moe-replay
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    plan = hfpatch_core.plan_of(model)
    pack = hfpatch_core.discover().packs["moe-replay"]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        with record_routing(model) as recording:
            model(ids)
        with replay_routing(model, recording.routing), record_routing(model) as again:
            model(ids)
    print(json.dumps({
        "distribution_files": str(importlib_metadata.distribution("hfpatch-pack-moe-replay").locate_file("")),
        "module_file": pack.load().__file__,
        "replaced": {name: claim.pack for name, claim in plan.replaced.items()},
        "router": type(model.model.layers[0].mlp.gate).__module__,
        "replayed": again.routing == recording.routing,
    }))
    """
)


def test_the_pack_is_discovered_from_an_installed_wheel(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # The wheel's copy is alone on the path, ahead of any other install of the pack.
    installed = discover_from_wheel(PACK_DIR, PACK, tmp_path)
    assert installed.wheel.name.startswith("hfpatch_pack_moe_replay-0.2.0-"), installed.wheel
    row = installed.row
    assert (row["distribution"], row["version"], row["enabled"]) == ("hfpatch-pack-moe-replay", "0.2.0", True)
    assert row["transformers"] == "<6,>=5.3" and row["description"]

    probe = installed.run_python("-c", _PROBE, checkpoints["qwen3_moe"])
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(found["distribution_files"]).resolve() == installed.site.resolve()
    assert Path(found["module_file"]).resolve().is_relative_to(installed.site.resolve())
    assert found["replaced"] == {"Qwen3MoeTopKRouter": PACK}
    assert found["router"] == "hfpatch_pack_moe_replay.routers"
    assert found["replayed"] is True


def test_the_pack_is_installed_for_these_tests() -> None:
    """The other tests load through discovery: the pack must be installed (``pip install -e``)."""
    assert PACK in hfpatch_core.discover().packs, (
        "install the pack first: pip install --no-deps -e plugins/hfpatch-pack-moe-replay"
    )
