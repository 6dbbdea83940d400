"""Replay on routers of other families than softmax top-k, found by discovery, not by name.

Sigmoid scores with a selection-only correction bias and group-limited top-k
(deepseek_v3), llama4's sigmoid of the selected logits (a router that returns no
indices), gpt-oss's softmax over the selected biased logits; a sparse mixer (phimoe) is
refused with its reason; and every MoE model type of the installed transformers is
either replayed or refused with a reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import transformers
from hfpatch_pack_moe_replay import (
    ReplayableRouter,
    Routing,
    RoutingError,
    discover,
    moe_model_types,
    provide_patches,
    record_routing,
    replay_routing,
    routers_of,
)
from transformers import AutoModelForCausalLM, GptOssConfig, Llama4TextConfig, PhimoeConfig

import hfpatch_core
from conftest import COMMON, PACK, PAD, VOCAB, deepseek_v3_config
from hfpatch_core import LoadContext, Refusal
from hfpatch_core.testing import load_model, padded_batch

FAMILIES: dict[str, tuple[Callable[[], Any], str]] = {
    "deepseek_v3": (
        deepseek_v3_config,
        "sigmoid top-k, renormalised, scaled by 2.5; a correction bias used only to select; group-limited",
    ),
    "gpt_oss": (
        lambda: GptOssConfig(
            **COMMON, num_local_experts=4, head_dim=8, layer_types=["sliding_attention", "full_attention"]
        ),
        "softmax top-k, renormalised",
    ),
    "llama4_text": (
        lambda: Llama4TextConfig(
            **{**COMMON, "num_experts_per_tok": 1},
            intermediate_size_mlp=64,
            num_local_experts=4,
            head_dim=8,
            interleave_moe_layer_step=1,
            no_rope_layers=[1, 1],
            attention_chunk_size=64,
        ),
        "sigmoid of the selected logits, scattered over the experts (llama4)",
    ),
    # probed from the instance in the model (its constructor takes sizes, not the config); it
    # returns the weights grouped by expert, with the permutation
    "jetmoe": (
        lambda: transformers.AutoConfig.for_model(
            "jetmoe",
            **{key: value for key, value in COMMON.items() if key != "num_attention_heads"},
            num_local_experts=4,
            kv_channels=8,
        ),
        "softmax top-k, renormalised",
    ),
    # a learned scale per expert on the selected weights (not in transformers 5.3)
    "gemma4_text": (
        lambda: transformers.AutoConfig.for_model(
            "gemma4_text",
            **{key: value for key, value in COMMON.items() if key not in ("num_experts_per_tok", "bos_token_id")},
            head_dim=8,
            global_head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=16,
            hidden_size_per_layer_input=0,
        ),
        "softmax top-k, renormalised, times the selected experts' per_expert_scale",
    ),
}


def _available(name: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return name in CONFIG_MAPPING_NAMES


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    hfpatch_core.disable()
    paths = {}
    for seed, (name, (build, _)) in enumerate(FAMILIES.items()):
        if not _available(name):
            continue
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(build())
        with torch.no_grad():
            for module_name, buffer in model.named_buffers():
                if module_name.endswith("e_score_correction_bias"):
                    # a bias that changes the selection, so that selecting by it is tested
                    buffer.copy_(torch.rand(buffer.shape) * 0.2)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        paths[name] = path
    return paths


@pytest.fixture(params=list(FAMILIES))
def router_family(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if not _available(name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    build, _ = FAMILIES[name]
    config = build()
    found = discover(config.model_type, config)
    if found.refused is not None and found.candidate is not None and "without a top-k" in found.refused:
        # an older release computes this family's selection otherwise (5.3's deepseek_v3 router picks
        # groups and experts in one forward): refused there, with its reason, and tested where it is not
        pytest.skip(f"{name} on transformers {transformers.__version__}: {found.refused}")
    return name


def _record(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, routing: Routing | None = None) -> Routing:
    with torch.no_grad(), record_routing(model) as recording:
        if routing is None:
            model(input_ids=ids, attention_mask=mask)
        else:
            with replay_routing(model, routing):
                model(input_ids=ids, attention_mask=mask)
    return recording.routing


def _router_weights(model: nn.Module) -> list[nn.Parameter]:
    """The linear maps the routers score the experts with (weight: (experts, hidden))."""
    found = []
    for _, router in routers_of(model):
        width = next(p.shape[0] for p in router.parameters() if p.dim() == 2)
        found.extend(p for p in router.parameters() if p.dim() == 2 and p.shape[0] == width)
    return found


def test_discovery_classifies_each_family(router_family: str) -> None:
    build, rule = FAMILIES[router_family]
    config = build()
    found = discover(config.model_type, config)
    assert found.replayable and found.refused is None
    assert [family.rule for family in found.routers] == [rule]
    (patch,) = provide_patches(LoadContext(config.model_type, "AnyForCausalLM", config=config))
    assert patch.target == found.routers[0].router_class.__name__


def test_outside_a_replay_the_patched_model_is_vanilla(family_checkpoints: dict[str, Path], router_family: str) -> None:
    vanilla = load_model(family_checkpoints[router_family])
    patched = load_model(family_checkpoints[router_family], PACK)
    assert all(isinstance(router, ReplayableRouter) for _, router in routers_of(patched))
    assert not any(isinstance(router, ReplayableRouter) for _, router in routers_of(vanilla))
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD)
    with torch.no_grad():
        expected = vanilla(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(patched(input_ids=ids, attention_mask=mask).logits, expected)
    assert _record(vanilla, ids, mask) == _record(patched, ids, mask)


def test_replaying_own_routes_gives_the_same_logits_and_another_runs_routes_are_forced(
    family_checkpoints: dict[str, Path], router_family: str
) -> None:
    rollout = load_model(family_checkpoints[router_family], PACK)
    trained = load_model(family_checkpoints[router_family], PACK)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=3)
    own = _record(trained, ids, mask)
    with torch.no_grad():
        live = trained(input_ids=ids, attention_mask=mask).logits
        with replay_routing(trained, own):
            assert torch.equal(trained(input_ids=ids, attention_mask=mask).logits, live)

    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in _router_weights(rollout):
            weight.add_(torch.randn(weight.shape, generator=generator) * weight.abs().mean() * 3)
    recorded = _record(rollout, ids, mask)
    differing = sum(int((a != b).any(dim=1).sum()) for a, b in zip(recorded.layers, own.layers, strict=True))
    assert differing > 0, "the other run must route otherwise for the test to prove anything"
    # the replayed selection is the other run's (recording inside a replay records the replayed routes)
    assert _record(trained, ids, mask, recorded) == recorded
    with torch.no_grad(), replay_routing(trained, recorded):
        forced = trained(input_ids=ids, attention_mask=mask).logits
    assert not torch.equal(forced, live)


def test_gradients_reach_the_router_weights_under_a_replay(
    family_checkpoints: dict[str, Path], router_family: str
) -> None:
    model = load_model(family_checkpoints[router_family], PACK)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=4)
    routing = _record(model, ids, mask)
    shifted = Routing(
        tuple(
            (layer + 1) % next(p.shape[0] for p in router.parameters() if p.dim() == 2)
            for layer, (_, router) in zip(routing.layers, routers_of(model), strict=True)
        ),
        batch_size=routing.batch_size,
    )
    labels = ids.masked_fill(mask == 0, -100)
    for replayed in (routing, shifted):
        model.zero_grad(set_to_none=True)
        with replay_routing(model, replayed):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        for weight in _router_weights(model):
            assert weight.grad is not None and bool(weight.grad.abs().sum() > 0)


def test_a_sparse_mixer_is_refused_with_its_reason(tmp_path: Path) -> None:
    config = PhimoeConfig(**COMMON, num_local_experts=4)
    found = discover("phimoe", config)
    assert not found.replayable and found.refused and "without a top-k" in found.refused
    [refusal] = provide_patches(LoadContext("phimoe", "PhimoeForCausalLM", config=config))
    assert isinstance(refusal, Refusal) and refusal.target == found.candidate and refusal.reason == found.refused
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_model(tmp_path, PACK)
    plan = hfpatch_core.plan_of(model)
    assert plan is not None and [(r.pack, r.target) for r in plan.refused] == [(PACK, found.candidate)]
    with pytest.raises(RoutingError, match=r"cannot replay the routing of phimoe models: .*without a top-k"):
        routers_of(model)


def test_every_moe_model_type_is_replayed_or_refused_with_a_reason() -> None:
    types = moe_model_types()
    # the enumeration reads the installed release (36 MoE types on 5.3.0, 67 on 5.25.0): it must find these
    assert {"deepseek_v3", "qwen3_moe", "llama4", "gpt_oss", "phimoe"} <= set(types), types
    silent = []
    for model_type in types:
        found = discover(model_type)
        if found.replayable == bool(found.refused):
            silent.append(model_type)
    assert not silent, f"neither replayed nor refused with a reason: {silent}"


@pytest.mark.parametrize("model_type", ["xlm", "doge"])
def test_a_top_k_outside_an_moe_block_is_no_router_candidate(model_type: str) -> None:
    """xlm's QA head (beam search) and doge's attention (a dynamic mask) compute a top-k but
    sit beside no experts: discovery proposes nothing, so the pack neither patches nor refuses."""
    found = discover(model_type)
    assert not found.routers and found.candidate is None
    assert found.refused is not None and "no module of it selects experts" in found.refused
    config = transformers.AutoConfig.for_model(model_type)
    assert provide_patches(LoadContext(model_type, "AnyForCausalLM", config=config)) == []


def test_a_router_over_a_single_expert_is_replayed() -> None:
    """hunyuan_v1_moe's default config has one expert: every token selects it, any routing is the live one."""
    config = transformers.AutoConfig.for_model("hunyuan_v1_moe")
    assert config.num_experts == 1
    (family,) = discover("hunyuan_v1_moe", config).routers
    assert family.rule == "a single expert, selected by every token"
    # 5.3's MoE block selects itself around a gate that only scores: the block is the router
    assert family.router_class.__name__ in ("HunYuanMoEV1Gate", "HunYuanMoEV1Moe")
