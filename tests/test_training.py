"""Training equivalence: N AdamW steps with and without a pack, losses, gradients and weights compared.

The wrong packs here have a right forward (their logits match vanilla exactly) and a wrong
backward, which only training finds: the check must name the step and the parameter, in the
checkpoint's own names also where the pack fuses weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hfpatch_core.testing import (
    BF16_ATOL,
    BF16_TOLERANCES,
    FP32_TOLERANCES,
    EquivalenceError,
    TrainingTolerances,
    assert_pack_equivalent,
    check_pack_equivalence,
    check_training_equivalence,
    training_batches,
)
from packs import DETACHED_PACK, DOUBLING_PACK, MLP_PACK, PackSpec, _fused_qkv_classes, fused_qkv_pack

# a fused q/k/v whose forward is exact and which halves the gradient reaching k: the key
# slice of qkv_proj (k_proj in the checkpoint) gets half its gradient, which AdamW's
# per-element normalisation would hide from the weights
SCALED_QKV_PACK = fused_qkv_pack().replace(
    "        self._parts = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)\n",
    "        q, k, v = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)\n"
    "        self._parts = (q, k.detach() + (k - k.detach()) * 0.5, v)\n",
)


# a fused q/k/v whose backward scales the gradient of every projection by 0.8: each by a
# fifth, within the bf16 bound of one parameter (0.3, where an MoE's routing flips reach)
SCALED_ATTENTION_PACK = fused_qkv_pack().replace(
    "        self._parts = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)\n",
    "        parts = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)\n"
    "        self._parts = tuple(part.detach() + (part - part.detach()) * 0.8 for part in parts)\n",
)


def test_the_scaled_pack_differs_from_the_fused_one_only_in_its_backward() -> None:
    assert fused_qkv_pack() != SCALED_QKV_PACK and _fused_qkv_classes("FusedQKVAttention") in fused_qkv_pack()


def test_a_correct_pack_trains_like_vanilla_with_and_without_checkpointing(install, llama_checkpoint: Path) -> None:
    install(PackSpec("mlp", MLP_PACK))
    report = assert_pack_equivalent("mlp", llama_checkpoint, generate_tokens=0, train_steps=3)
    assert [training.gradient_checkpointing for training in report.training] == [False, True]
    for training in report.training:
        assert training.ok and training.steps == 3 and len(training.losses) == 3
        # a subclass that changes nothing trains bit for bit like vanilla
        assert training.max_loss_diff == training.max_gradient_diff == training.max_parameter_diff == 0.0
        assert training.first_step is None and training.first_parameter is None
        assert len({vanilla for vanilla, _ in training.losses}) == 3  # three batches, three losses


def test_a_fused_pack_is_compared_in_the_checkpoint_layout(install, llama_checkpoint: Path) -> None:
    install(PackSpec("qkv", fused_qkv_pack()))
    report = check_training_equivalence("qkv", llama_checkpoint, steps=3)
    assert report.ok, report.failures
    assert report.max_loss_diff <= FP32_TOLERANCES.loss and report.max_parameter_diff <= FP32_TOLERANCES.parameters
    assert report.max_gradient_diff > 0  # a fused matmul sums in another order: compared, not bit-equal


def test_a_scaled_gradient_is_caught_at_step_1_naming_the_checkpoint_parameter(install, llama_checkpoint) -> None:
    install(PackSpec("qkv", SCALED_QKV_PACK))
    # the forward is right: logits, generation and the round trip pass
    assert assert_pack_equivalent("qkv", llama_checkpoint, generate_tokens=2).ok
    with pytest.raises(EquivalenceError) as caught:
        assert_pack_equivalent("qkv", llama_checkpoint, generate_tokens=0, train_steps=2)
    failures = caught.value.failures
    for setting in ("off", "on"):
        prefix = f"training (2 AdamW steps, float32, gradient checkpointing {setting})"
        first = f"{prefix}: gradients diverge first at step 1, most in model.layers.0.self_attn.k_proj.weight ("
        assert any(f.startswith(first) for f in failures), failures
    report = check_training_equivalence("qkv", llama_checkpoint, steps=2)
    # the culprit is named, in the checkpoint's names (the model itself only has qkv_proj)
    assert report.first_step == 1 and report.first_parameter == "model.layers.0.self_attn.k_proj.weight"
    assert report.max_gradient_diff is not None and report.max_gradient_diff >= 0.5


def test_a_detached_weight_is_caught_naming_the_parameter_with_no_gradient(install, llama_checkpoint) -> None:
    install(PackSpec("detached", DETACHED_PACK))
    report = check_training_equivalence("detached", llama_checkpoint, steps=2)
    assert not report.ok and report.first_step == 1
    assert report.first_parameter == "model.layers.0.mlp.down_proj.weight"
    prefix = "training (2 AdamW steps, float32, gradient checkpointing off)"
    gradients = (
        f"{prefix}: gradients diverge first at step 1, most in model.layers.0.mlp.down_proj.weight (no gradient "
        "in the patched model, a gradient in the other), first in checkpoint order model.layers.0.mlp.down_proj"
    )
    assert any(f.startswith(gradients) for f in report.failures), report.failures
    weights = f"{prefix}: parameters diverge first after step 1, most in model.layers.0.mlp.down_proj.weight (max abs"
    assert any(f.startswith(weights) for f in report.failures), report.failures


def test_a_wrong_forward_diverges_in_the_loss_from_step_1(install, llama_checkpoint: Path) -> None:
    install(PackSpec("doubling", DOUBLING_PACK))
    report = check_training_equivalence("doubling", llama_checkpoint, steps=2, gradient_checkpointing=True)
    prefix = "training (2 AdamW steps, float32, gradient checkpointing on)"
    assert report.failures[0].startswith(f"{prefix}: the loss diverges from step 1 on: vanilla ")
    assert report.failures[0].endswith(f"2 of 2 steps differ, at most by {report.max_loss_diff:.3g}")


def test_bf16_trains_within_its_own_tolerances(install, llama_checkpoint: Path) -> None:
    install(PackSpec("qkv", fused_qkv_pack()))
    report = check_training_equivalence("qkv", llama_checkpoint, steps=3, dtype=torch.bfloat16)
    assert report.ok, report.failures
    floors = TrainingTolerances.default(torch.bfloat16)
    assert report.dtype == "torch.bfloat16" and report.tolerances.calibration == floors.calibration == 3.0
    for field in ("loss", "gradients", "parameters", "model_gradients"):
        assert getattr(report.tolerances, field) >= getattr(floors, field), field  # calibrated, never below
    assert report.forced_routes == 0  # a dense model: no top-k, nothing held
    strict = TrainingTolerances(loss=0, gradients=0, parameters=0)
    assert not check_training_equivalence("qkv", llama_checkpoint, steps=3, tolerances=strict).ok


def test_bf16_catches_a_gradient_scaled_in_every_layer_that_one_parameter_s_bound_lets_through(
    install, llama_checkpoint: Path
) -> None:
    install(PackSpec("scaled", SCALED_ATTENTION_PACK))
    report = check_training_equivalence("scaled", llama_checkpoint, steps=2, dtype=torch.bfloat16)
    # each parameter within its own bound, the model's gradient as a whole not; both bounds
    # calibrated in the run, never below the floors
    assert report.max_gradient_diff is not None and report.max_gradient_diff <= report.tolerances.gradients
    model_bound = report.tolerances.model_gradients
    assert model_bound is not None and report.max_model_gradient_diff is not None
    assert BF16_TOLERANCES.model_gradients is not None and model_bound >= BF16_TOLERANCES.model_gradients
    assert report.max_model_gradient_diff > model_bound
    assert not report.ok and report.first_step == 1
    prefix = "training (2 AdamW steps, bfloat16, gradient checkpointing off)"
    (failure,) = report.failures
    assert failure.startswith(
        f"{prefix}: the model's gradients, all parameters together, diverge first at step 1: relative difference "
        f"{report.max_model_gradient_diff:.3g} > {model_bound:g}, most from {report.first_parameter}; "
    ), failure


def test_the_training_batches_are_seeded_and_padded_on_both_sides() -> None:
    batches = training_batches(128, 2, pad_token_id=0, seed=3)
    again = training_batches(128, 2, pad_token_id=0, seed=3)
    assert all(torch.equal(a, b) for x, y in zip(batches, again, strict=True) for a, b in zip(x, y, strict=True))
    ids, mask, labels = batches[0]
    assert ids.shape == (4, 12) and mask.sum(dim=1).tolist() == [12, 8, 9, 12]
    assert mask[1, :4].sum() == 0 and mask[2, -3:].sum() == 0  # one left-, one right-padded row
    assert torch.equal(labels == -100, mask == 0) and torch.equal(labels[mask == 1], ids[mask == 1])
    assert not torch.equal(batches[0][0], batches[1][0])


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TrainingTolerances(loss=-1, gradients=0, parameters=0), "loss must be a number >= 0"),
        (lambda: training_batches(3, 1), "vocab_size must be above 3"),
        (lambda: check_training_equivalence("x", "llama", steps=0), "steps must be 1 or more, got 0"),
    ],
)
def test_bad_arguments_say_what_is_wrong(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_the_equivalence_report_carries_the_training_reports_as_json(install, llama_checkpoint: Path) -> None:
    install(PackSpec("mlp", MLP_PACK))
    report = check_pack_equivalence(
        "mlp", llama_checkpoint, generate_tokens=0, train_steps=1, train_checkpointing=[True]
    )
    (training,) = json.loads(json.dumps(report.to_json()))["training"]
    assert (
        training["ok"] and training["gradient_checkpointing"] and training["losses"][0][0] == training["losses"][0][1]
    )


def test_the_training_report_is_json(install, llama_checkpoint: Path) -> None:
    install(PackSpec("detached", DETACHED_PACK))
    report = check_training_equivalence("detached", llama_checkpoint, steps=1)
    data = json.loads(json.dumps(report.to_json()))
    assert data["ok"] is False and data["first_step"] == 1 and data["steps"] == 1
    assert data["first_parameter"] == "model.layers.0.mlp.down_proj.weight"
    assert data["tolerances"] == {
        "loss": 1e-4,
        "gradients": 1e-4,
        "parameters": 5e-4,
        "model_gradients": None,
        "calibration": None,
    }


# --- routing held equal on both sides (MoE) -----------------------------------------------

# a Qwen3-MoE router that picks its top-k experts from its probabilities scaled by
# (1 + NUDGE * expert index), and scores them with the unscaled ones: with a NUDGE within a
# bf16 tie it routes like vanilla but for near-ties; with a large one, it routes otherwise
NUDGED_ROUTER_PACK = """
import inspect
import torch
import torch.nn.functional as F
from hfpatch_core import Patch, hookimpl
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

NUDGE = {nudge}
# the release's scores dtype: 5.3 casts them to the probabilities' float32 (it reuses the
# name router_logits for them), later releases to the logits' dtype
LOGITS_DTYPE = "router_probs" in inspect.getsource(Qwen3MoeTopKRouter.forward)

class NudgedRouter(Qwen3MoeTopKRouter):
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probabilities = F.softmax(logits, dtype=torch.float, dim=-1)
        scale = 1 + NUDGE * torch.arange(self.num_experts, dtype=torch.float)
        _, indices = torch.topk(probabilities * scale, self.top_k, dim=-1)
        values = probabilities.gather(-1, indices)
        if self.norm_topk_prob:
            values = values / values.sum(dim=-1, keepdim=True)
        return logits, values.to(logits.dtype) if LOGITS_DTYPE else values, indices

@hookimpl
def provide_patches(context):
    return [Patch("Qwen3MoeTopKRouter", NudgedRouter)] if context.model_type == "qwen3_moe" else []
"""


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=0.2,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_a_bf16_tie_routed_otherwise_is_held_to_vanilla_s_route_and_counted(
    install, moe_checkpoint: Path, checkpointing: bool
) -> None:
    install(PackSpec("nudged", NUDGED_ROUTER_PACK.format(nudge=0.02)))
    report = check_training_equivalence(
        "nudged", moe_checkpoint, steps=3, dtype=torch.bfloat16, gradient_checkpointing=checkpointing
    )
    assert report.ok, report.failures
    assert report.forced_routes is not None and report.forced_routes > 0
    # held to vanilla's routes, a router that computes vanilla's math trains as vanilla does
    assert report.max_loss_diff is not None and report.max_loss_diff <= 1e-6
    assert report.max_gradient_diff == 0.0 and report.max_parameter_diff == 0.0
    free = check_training_equivalence("nudged", moe_checkpoint, steps=3, dtype=torch.bfloat16, hold_routing=False)
    assert free.forced_routes is None and free.max_gradient_diff is not None and free.max_gradient_diff > 0


def test_a_route_changed_beyond_a_tie_is_caught_not_forced(install, moe_checkpoint: Path) -> None:
    install(PackSpec("nudged", NUDGED_ROUTER_PACK.format(nudge=1.0)))
    report = check_training_equivalence("nudged", moe_checkpoint, steps=1, dtype=torch.bfloat16)
    routing = [failure for failure in report.failures if "routing: " in failure]
    assert not report.ok and routing, report.failures
    prefix = "training (1 AdamW steps, bfloat16, gradient checkpointing off): routing: at step 1, top-k call 1, row "
    assert routing[0].startswith(prefix) and "beyond a tie in bfloat16 (at most 0.125, 16 ulps)" in routing[0]
    assert (
        routing[-1].endswith("differed in all") and " top-k decisions of the patched model differ from " in routing[-1]
    )


def test_in_float32_no_routing_difference_is_a_tie(install, moe_checkpoint: Path) -> None:
    install(PackSpec("nudged", NUDGED_ROUTER_PACK.format(nudge=0.02)))
    report = check_training_equivalence("nudged", moe_checkpoint, steps=2)
    assert any("beyond a tie in float32" in failure for failure in report.failures), report.failures


def test_bf16_logits_hold_routing_and_calibrate_the_tolerance(install, moe_checkpoint: Path) -> None:
    install(PackSpec("nudged", NUDGED_ROUTER_PACK.format(nudge=0.02)))
    report = check_pack_equivalence("nudged", moe_checkpoint, dtype=torch.bfloat16, generate_tokens=0)
    assert report.ok, report.failures
    assert report.forced_routes is not None and report.max_abs_diff == 0.0
    assert report.atol is not None and report.atol >= BF16_ATOL
    wrong = check_pack_equivalence("nudged", moe_checkpoint, atol=10.0, generate_tokens=0)
    assert wrong.atol == 10.0 and any(f.startswith("logits: routing: at top-k call") for f in wrong.failures)
