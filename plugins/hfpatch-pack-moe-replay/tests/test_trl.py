"""Routing replay in TRL's ``GRPOTrainer``, with the real TRL (issue 31 item 4).

A probe trainer records, independently of the integration, the experts each rollout's ``generate``
selected per sequence, and the experts the routers selected in every later forward pass of the
policy (and of the reference model) over those sequences: the old log-probability pass and the
reference pass (in chunks of ``per_device_train_batch_size`` rows) and the loss forward. A row of
a training forward is matched to its rollout by its tokens, so a routing that did not follow its
row through TRL's shuffling and splitting, or a forward that routed live, shows as a difference.
With ``steps_per_generation=2`` the second micro-batch reuses the rollout after an optimizer step:
vanilla TRL routes some of its tokens differently there, the integration replays them. Gradient
checkpointing (TRL's default) recomputes the routers in ``accelerator.backward``: a replay closed
before it raises ``RoutingError`` (scope.py), so a run that completes replayed there too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from datasets import Dataset
from hfpatch_pack_moe_replay import Routing, discover, record_routing, routers_of, scope
from hfpatch_pack_moe_replay.trl import ROUTES_KEY, RoutingReplayMixin
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, DeepseekV3Config, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

import hfpatch_core
from conftest import CASES, COMMON, PACK, PAD, VOCAB
from hfpatch_core.testing import FP32_TOLERANCES, tiny_checkpoint

EOS = 2


def _deepseek_v3() -> DeepseekV3Config:
    return DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


#: a softmax top-k family and a sigmoid + correction bias, group-limited one
CONFIGS: dict[str, Callable[[], Any]] = {"qwen2_moe": CASES["qwen2_moe"].build, "deepseek_v3": _deepseek_v3}


@pytest.fixture(scope="module")
def grpo_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for seed, (name, build) in enumerate(CONFIGS.items()):
        path = tiny_checkpoint(build(), tmp_path_factory.mktemp(name), seed=seed)
        model = AutoModelForCausalLM.from_pretrained(path)
        biases = [buffer for key, buffer in model.named_buffers() if key.endswith("e_score_correction_bias")]
        if biases:
            with torch.no_grad():
                for buffer in biases:  # a bias that changes the selection, so that selecting by it is replayed
                    buffer.copy_(torch.rand(buffer.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)
            model.save_pretrained(path)
        paths[name] = path
    return paths


def _replayable(name: str) -> None:
    config = CONFIGS[name]()
    found = discover(config.model_type, config)
    if not found.replayable:
        # 5.3's deepseek_v3 router picks groups and experts in one forward: refused there (test_router_families)
        pytest.skip(f"{name} is refused on this transformers: {found.refused}")


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (no download): token ``t<i>`` is id ``i``."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token=f"t{PAD}", unk_token="t1", eos_token=f"t{EOS}")


def _reward(completions: list[str], **_kwargs: Any) -> list[float]:
    return [float(len(completion)) for completion in completions]


@dataclass
class Probe:
    """What the probe trainer saw: the rollouts' routes per sequence, and every scoring forward's."""

    rollouts: dict[tuple[int, ...], list[torch.Tensor]] = field(default_factory=dict)
    #: (pass, input_ids, attention_mask, routes (rows, seq_len, layers, top_k)) per scoring call
    forwards: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    scoring: list[str] = field(default_factory=list)
    #: (pass, router calls under a replay, router calls) per scoring call
    replayed: list[tuple[str, int, int]] = field(default_factory=list)

    def key(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, ...]:
        return tuple(int(token) for token in ids[mask.bool()])

    def differing(self, kinds: tuple[str, ...] = ("old", "reference", "loss")) -> tuple[int, int]:
        """(tokens whose experts differ from their rollout's in some layer, tokens compared)."""
        differ = compared = 0
        for kind, ids, mask, routes in self.forwards:
            if kind not in kinds:
                continue
            for row in range(ids.shape[0]):
                candidates = self.rollouts[self.key(ids[row], mask[row])]
                counts = []
                for rollout in candidates:
                    # positions routed in the rollout and real tokens in the training row (the last
                    # generated token is never fed back during generate)
                    length = min(rollout.shape[0], routes.shape[1])
                    keep = mask[row, :length].bool()
                    got = routes[row, :length][keep].sort(dim=-1).values
                    want = rollout[:length][keep].sort(dim=-1).values
                    counts.append((int((got != want).any(dim=-1).any(dim=-1).sum()), int(keep.sum())))
                best = min(counts)
                differ, compared = differ + best[0], compared + best[1]
        return differ, compared


def _probe_trainer(base: type[GRPOTrainer], probe: Probe) -> type[GRPOTrainer]:
    """``base`` with the probe's records; its overrides run outside ``base``'s (and so the mixin's)."""

    class Probed(base):  # type: ignore[misc,valid-type]
        def _generate_single_turn(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
            with record_routing(self.accelerator.unwrap_model(self.model)) as recording:
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            routing = recording.routing
            for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
                # the rollout's positions, left padding included, as the training row lays them out
                probe.rollouts.setdefault((*prompt, *completion), []).append(routing.select(row).to_tensor()[0])
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            probe.scoring = ["old", "reference"]
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                probe.scoring = []

        def _get_per_token_logps_and_entropies(
            self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *args: Any, **kwargs: Any
        ) -> Any:
            # in _generate_and_score_completions, the old log-probabilities come first, then the reference's
            kind = probe.scoring.pop(0) if probe.scoring else "loss"
            calls: list[bool] = []

            def replayed(router: nn.Module, _args: Any) -> None:
                active = scope._REPLAY.get()
                calls.append(active is not None and router in active)

            unwrapped = self.accelerator.unwrap_model(model)
            handles = [router.register_forward_pre_hook(replayed) for _, router in routers_of(unwrapped)]
            try:
                with record_routing(unwrapped) as recording:
                    result = super()._get_per_token_logps_and_entropies(
                        model, input_ids, attention_mask, *args, **kwargs
                    )
            finally:
                for handle in handles:
                    handle.remove()
            probe.replayed.append((kind, sum(calls), len(calls)))
            routes = Routing.stack(recording.steps).to_tensor()
            probe.forwards.append((kind, input_ids.detach().cpu(), attention_mask.detach().cpu(), routes.cpu()))
            return result

    return Probed


@dataclass
class Run:
    losses: list[float]
    probe: Probe


def grpo(
    checkpoint: Path,
    out: Path,
    *,
    replay: bool = True,
    gradient_checkpointing: bool = True,
    lora: bool = False,
    beta: float = 0.0,
    learning_rate: float = 0.05,
) -> Run:
    """Two optimizer steps of GRPO on one generation batch of 4 rollouts (2 prompts × 2), reused over
    ``steps_per_generation=2`` micro-batches of 2 rows; the old log-probabilities (and the reference's)
    are scored in chunks of 2 rows."""
    probe = Probe()
    base: type[GRPOTrainer] = GRPOTrainer
    if replay:
        base = type("ReplayGRPOTrainer", (RoutingReplayMixin, GRPOTrainer), {})
    config = GRPOConfig(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        num_generations=2,
        max_completion_length=6,
        learning_rate=learning_rate,
        beta=beta,
        bf16=False,  # TRL trains in bf16 by default: fp32 here
        gradient_checkpointing=gradient_checkpointing,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=1234,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    prompts = Dataset.from_dict({"prompt": ["t5 t9 t13 t21", "t7 t30"] * 2})
    with hfpatch_core.enabled(packs=PACK):  # the policy and the reference TRL loads from its path
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        torch.manual_seed(1234)
        trainer = _probe_trainer(base, probe)(
            model=model,
            args=config,
            reward_funcs=_reward,
            train_dataset=prompts,
            processing_class=_tokenizer(),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]) if lora else None,
        )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return Run(losses, probe)


SETTINGS = {
    # TRL's default gradient checkpointing, and a reference model (beta > 0) scored in chunks
    "checkpointing+reference": dict(gradient_checkpointing=True, beta=0.1),
    # no checkpointing, LoRA: the reference is the policy with its adapter disabled
    "lora+reference": dict(gradient_checkpointing=False, lora=True, beta=0.1),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_forward_replays_the_rollouts_routes(
    name: str, setting: str, grpo_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    _replayable(name)
    run = grpo(grpo_checkpoints[name], tmp_path, **SETTINGS[setting])  # type: ignore[arg-type]
    kinds = [kind for kind, *_ in run.probe.forwards]
    # one generation batch: its old log-probabilities and its reference, then two loss forwards
    assert kinds == ["old", "reference", "loss", "loss"], kinds
    for kind, ids, _, routes in run.probe.forwards:
        assert routes.shape[:2] == ids.shape, (kind, routes.shape, ids.shape)
    # every router call of every scoring forward ran under a replay (4 rows in 2 chunks of 2, or 2 rows;
    # 2 MoE layers per forward pass)
    expected = [("old", 4, 4), ("reference", 4, 4), ("loss", 2, 2), ("loss", 2, 2)]
    assert run.probe.replayed == expected, run.probe.replayed
    differ, compared = run.probe.differing()
    assert compared > 0
    assert differ == 0, f"{differ} of {compared} tokens routed otherwise than in their rollout"
    assert len(run.losses) == 2 and all(loss == loss for loss in run.losses)


def test_without_replay_the_reused_rollout_routes_differently_and_losses_agree_where_routes_do(
    grpo_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    vanilla = grpo(grpo_checkpoints["qwen2_moe"], tmp_path / "vanilla", replay=False)
    replayed = grpo(grpo_checkpoints["qwen2_moe"], tmp_path / "replayed")
    # the second micro-batch runs after an optimizer step: live, some of its tokens take other experts
    assert all(replayed == 0 for _, replayed, _ in vanilla.probe.replayed), vanilla.probe.replayed
    differ, compared = vanilla.probe.differing(("loss",))
    assert differ > 0, f"vanilla TRL routed all {compared} tokens as their rollouts: nothing for replay to fix here"
    assert replayed.probe.differing() == (0, replayed.probe.differing()[1])
    # the first step scores the rollout with the weights that generated it: where vanilla's loss forward
    # routed every token as the rollout did, replaying changes nothing
    first = vanilla.probe.forwards[1]
    assert first[0] == "loss"
    single = Probe(rollouts=vanilla.probe.rollouts, forwards=[first])
    if single.differing()[0] == 0:
        assert abs(vanilla.losses[0] - replayed.losses[0]) <= FP32_TOLERANCES.loss, (vanilla.losses, replayed.losses)
    assert vanilla.losses[1] != replayed.losses[1]


def test_the_batch_carries_the_routes_per_row(grpo_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The routes travel as a per-row tensor beside the token ids, and TRL's batch handling keeps them."""
    run = grpo(grpo_checkpoints["qwen2_moe"], tmp_path, learning_rate=0.0)
    assert ROUTES_KEY == "routed_experts"
    old = run.probe.forwards[0]
    assert old[0] == "old" and old[1].shape[0] == 4
    for _, ids, _, routes in run.probe.forwards[1:]:
        assert ids.shape[0] == 2 and routes.shape[0] == 2
