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

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import transformers
from datasets import Dataset
from hfpatch_pack_moe_replay import Routing, RoutingError, discover, record_routing, routers_of, scope
from hfpatch_pack_moe_replay.trl import ROUTES_KEY, ReplayGRPOTrainer, continuous_rollout_routing, rollout_routing
from packaging.version import Version
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

import hfpatch_core
from conftest import CASES, PACK, PAD, VOCAB, deepseek_v3_config
from hfpatch_core.testing import tiny_checkpoint

EOS = 2


#: softmax top-k families (qwen2_moe with a shared expert, mixtral) and a sigmoid + correction bias,
#: group-limited one (deepseek_v3; refused on transformers 5.3, where mixtral is the second family)
CONFIGS: dict[str, Callable[[], Any]] = {
    "qwen2_moe": CASES["qwen2_moe"].build,
    "deepseek_v3": deepseek_v3_config,
    "mixtral": CASES["mixtral"].build,
}


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
    #: the lengths of the prompts each continuous batch generated from
    prompt_lengths: list[set[int]] = field(default_factory=list)

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
            if self.use_transformers_continuous_batching:
                return self._generate_continuously(prompt_ids, *args, **kwargs)
            with record_routing(self.accelerator.unwrap_model(self.model)) as recording:
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            routing = recording.routing
            for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
                # the rollout's positions, left padding included, as the training row lays them out
                probe.rollouts.setdefault((*prompt, *completion), []).append(routing.select(row).to_tensor()[0])
            return completion_ids, logprobs

        def _generate_continuously(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
            # each request's routes (every thread), keyed by its own prompt and generated tokens, so that
            # a routing given to the wrong row of TRL's batch shows as a difference
            model = self.accelerator.unwrap_model(self.model)
            generate_batch = model.generate_batch
            outputs: dict[str, Any] = {}

            def capture(*args: Any, **kwargs: Any) -> Any:
                outputs.update(generate_batch(*args, **kwargs))
                return outputs

            model.generate_batch = capture
            try:
                # generate_batch runs the base model's forward (a PEFT model's too)
                generating = model.get_base_model() if hasattr(model, "get_base_model") else model
                with record_routing(generating, threads="any") as recording:
                    completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            finally:
                del model.generate_batch
            routes = recording.requests
            assert len(outputs) == len(prompt_ids) == len(completion_ids)
            probe.prompt_lengths.append({len(prompt) for prompt in prompt_ids})
            longest = max(len(prompt) for prompt in prompt_ids)
            for request_id, output in outputs.items():
                prompt, completion = list(output.prompt_ids), list(output.generated_tokens)
                # left-padded as the training row: the padding positions are masked in the comparison
                routing = routes[request_id].padded(longest - len(prompt) + routes[request_id].seq_len, side="left")
                probe.rollouts.setdefault((*prompt, *completion), []).append(routing.to_tensor()[0])
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
                active = scope.REPLAY.get()
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


def grpo_config(out: Path, **overrides: Any) -> GRPOConfig:
    settings: dict[str, Any] = dict(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=2,
        steps_per_generation=2,
        num_generations=2,
        max_completion_length=6,
        bf16=False,  # TRL trains in bf16 by default: fp32 here
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=1234,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    return GRPOConfig(**{**settings, **overrides})


PROMPTS = {"prompt": ["t5 t9 t13 t21", "t7 t30"] * 2}


def grpo(
    checkpoint: Path,
    out: Path,
    *,
    replay: bool = True,
    gradient_checkpointing: bool = True,
    lora: bool = False,
    beta: float = 0.0,
    learning_rate: float = 0.05,
    continuous_batching: bool = False,
    dataset: dict[str, list[str]] = PROMPTS,
) -> Run:
    """Two optimizer steps of GRPO on one generation batch of 4 rollouts (2 prompts × 2), reused over
    ``steps_per_generation=2`` micro-batches of 2 rows; the old log-probabilities (and the reference's)
    are scored in chunks of 2 rows."""
    probe = Probe()
    base: type[GRPOTrainer] = GRPOTrainer
    if replay:
        base = ReplayGRPOTrainer
    batching: dict[str, Any] = {}
    if continuous_batching:
        # a small cache (on CPU the default sizes it from the free memory), pages of 4 (the duplicated
        # prompts share theirs), 8 tokens a batch: prompts are prefilled in chunks, requests join mid-way
        batching = dict(
            use_transformers_continuous_batching=True,
            transformers_continuous_batching_config=dict(
                num_blocks=32, max_batch_tokens=8, page_size=4, max_memory_percent=0.01
            ),
        )
    config = grpo_config(
        out, learning_rate=learning_rate, beta=beta, gradient_checkpointing=gradient_checkpointing, **batching
    )
    prompts = Dataset.from_dict(dataset)
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


@pytest.mark.parametrize(
    ("name", "setting"),
    [(name, setting) for name in ("qwen2_moe", "deepseek_v3") for setting in SETTINGS]
    + [("mixtral", "checkpointing+reference")],
)
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


# TRL's continuous batching needs transformers >= 5.8 (and 5.3's pins host memory, which needs an accelerator)
needs_continuous_batching = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.8.0"),
    reason="TRL's use_transformers_continuous_batching needs transformers >= 5.8 (5.3's continuous batching also "
    "pins host memory, which needs an accelerator)",
)


@needs_continuous_batching
@pytest.mark.parametrize(
    ("name", "setting"),
    [("qwen2_moe", "checkpointing+reference"), ("mixtral", "checkpointing+reference"), ("qwen2_moe", "lora+reference")],
)
def test_continuous_batching_rollouts_are_replayed_per_request(
    name: str, setting: str, grpo_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """``use_transformers_continuous_batching=True``: generate_batch runs on a background thread, each
    request's routes are recorded and laid out as TRL's row of that request (left-padded prompt, then its
    completion); every later forward replays them, with gradient checkpointing on, and with LoRA (whose
    generate_batch runs the base model)."""
    # two prompts of different lengths, both in the generation batch: the shorter is left-padded in training
    two = {"prompt": PROMPTS["prompt"][:2]}
    run = grpo(grpo_checkpoints[name], tmp_path, continuous_batching=True, dataset=two, **SETTINGS[setting])  # type: ignore[arg-type]
    assert [len(lengths) for lengths in run.probe.prompt_lengths] == [2], run.probe.prompt_lengths
    kinds = [kind for kind, *_ in run.probe.forwards]
    assert kinds == ["old", "reference", "loss", "loss"], kinds
    assert run.probe.replayed == [("old", 4, 4), ("reference", 4, 4), ("loss", 2, 2), ("loss", 2, 2)]
    differ, compared = run.probe.differing()
    assert compared > 0
    assert differ == 0, f"{differ} of {compared} tokens routed otherwise than in their rollout"
    assert len(run.losses) == 2 and all(loss == loss for loss in run.losses)


def test_without_replay_the_reused_rollout_routes_differently(
    grpo_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The same setup with vanilla TRL: nothing replays, and the second micro-batch, scored after an
    optimizer step, routes some of its tokens otherwise than its rollout did."""
    vanilla = grpo(grpo_checkpoints["qwen2_moe"], tmp_path / "vanilla", replay=False)
    assert vanilla.probe.replayed and all(replayed == 0 for _, replayed, _ in vanilla.probe.replayed)
    differ, compared = vanilla.probe.differing(("loss",))
    assert differ > 0, f"vanilla TRL routed all {compared} tokens as their rollouts: nothing for replay to fix here"


def test_the_batch_carries_the_routes_per_row(grpo_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The routes travel as a per-row tensor beside the token ids, and TRL's batch handling keeps them."""
    run = grpo(grpo_checkpoints["qwen2_moe"], tmp_path, learning_rate=0.0)
    assert ROUTES_KEY == "routed_experts"
    old = run.probe.forwards[0]
    assert old[0] == "old" and old[1].shape[0] == 4
    for _, ids, _, routes in run.probe.forwards[1:]:
        assert ids.shape[0] == 2 and routes.shape[0] == 2


def test_the_module_imports_without_trl() -> None:
    script = (
        "import sys; sys.modules['trl'] = None\n"  # an import of trl raises ImportError
        "import hfpatch_pack_moe_replay.trl as module\n"
        "assert module.RoutingReplayMixin and module.ROUTES_KEY\n"
        "try:\n    module.ReplayGRPOTrainer\nexcept ImportError:\n    print('no trl')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "no trl", done.stderr[-2000:]


def test_a_policy_loaded_without_the_pack_or_a_rollout_func_is_refused_when_the_trainer_is_built(
    grpo_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    arguments: dict[str, Any] = dict(
        args=grpo_config(tmp_path), reward_funcs=_reward, train_dataset=Dataset.from_dict(PROMPTS)
    )
    vanilla = AutoModelForCausalLM.from_pretrained(grpo_checkpoints["qwen2_moe"])
    with pytest.raises(RoutingError, match=r"policy cannot replay .* loaded without the moe-replay pack"):
        ReplayGRPOTrainer(model=vanilla, processing_class=_tokenizer(), **arguments)

    with hfpatch_core.enabled(packs=PACK):
        model = AutoModelForCausalLM.from_pretrained(grpo_checkpoints["qwen2_moe"])
    with pytest.raises(RoutingError, match=r"with rollout_func the completions come from elsewhere"):
        ReplayGRPOTrainer(model=model, processing_class=_tokenizer(), rollout_func=lambda *_: {}, **arguments)


def test_a_rollout_that_cannot_be_matched_to_positions_is_refused(grpo_checkpoints: dict[str, Path]) -> None:
    with hfpatch_core.enabled(packs=PACK):
        model = AutoModelForCausalLM.from_pretrained(grpo_checkpoints["qwen2_moe"])
    ids = torch.tensor([[5, 9, 13], [7, 30, 31]])
    # continuous batching runs the model on a background thread: nothing is recorded here
    with record_routing(model) as recording:
        pass
    with pytest.raises(RoutingError, match=r"use_transformers_continuous_batching"):
        rollout_routing(recording, prompt_length=3)
    # generation without a KV cache feeds the whole sequence again at every step
    with torch.no_grad(), record_routing(model) as recording:
        model(ids)
        model(torch.cat([ids, ids[:, :1]], dim=1))
    with pytest.raises(RoutingError, match=r"KV cache"):
        rollout_routing(recording, prompt_length=3)
    with torch.no_grad(), record_routing(model) as recording:
        model(ids)
        model(ids[:, :1])
    routing = rollout_routing(recording, prompt_length=3)
    assert (routing.batch_size, routing.seq_len) == (2, 4)
    with pytest.raises(RoutingError, match=r"prefill of the 4-token"):
        rollout_routing(recording, prompt_length=4)


def test_a_continuous_batch_that_cannot_be_matched_to_rows_is_refused(grpo_checkpoints: dict[str, Path]) -> None:
    with hfpatch_core.enabled(packs=PACK):
        model = AutoModelForCausalLM.from_pretrained(grpo_checkpoints["qwen2_moe"])
    prompts, completions = [[5, 9], [7, 30, 31]], [[3, 4], [6]]
    with record_routing(model, threads="any") as recording:
        pass
    with pytest.raises(RoutingError, match=r"returned 1 requests for 2 prompts"):
        continuous_rollout_routing(recording, ["req_0"], prompts, completions, prompt_length=3)
    # a forward the hooks did not see (a CUDA graph replay) records no continuous batch
    with pytest.raises(RoutingError, match=r"no forward pass of continuous batching.*use_cuda_graph"):
        continuous_rollout_routing(recording, ["req_0", "req_1"], prompts, completions, prompt_length=3)
