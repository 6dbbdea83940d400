"""TRL 1.16's trainers on a model with the chunked loss installed (issue 52.2).

Every TRL 1.16 trainer wraps ``model.forward`` with its own tiled head (``trl.trainer.utils.add_fused_lm_head``)
and computes its loss by calling the wrapper with ``fused_lm_head=True``, which runs the decoder and that head
and never reaches the pack: the wrapper computes every training step's loss, the pack none, and a
``PackWarning`` says so at the first.  These runs show it with TRL's defaults (gradient checkpointing, AdamW,
bf16 autocast), gradient accumulation 2, the pack installed at the load or over the trainer's wrapper: the
logged metrics and the trained weights are TRL's without the pack, within vanilla's own run-to-run spread
measured here (zero on CPU: the same code computes both)."""

from __future__ import annotations

import importlib
import logging
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.trainer.utils import add_fused_lm_head

from conftest import VOCAB, load
from hfpatch_core import PackError, PackWarning

# the installed forward's module, whose chunked_causal_lm_loss a step of the pack's calls (the probe's is compare's)
forward_module = importlib.import_module("hfpatch_pack_chunked_loss.forward")

FUSED = "trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward"
# the log's entries that time the run, which differ between any two runs
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
# the arguments every run sets; everything else is TRL's default (gradient checkpointing, AdamW, its learning
# rate, bf16 autocast, loss_type="nll")
COMMON: dict[str, Any] = {
    "max_steps": 2,
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "logging_steps": 1,
    "report_to": [],
    "save_strategy": "no",
    "seed": 1234,
    "use_cpu": True,
    "dataloader_num_workers": 0,
}


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (no download): token ``t<i>`` is id ``i``."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", unk_token="t1", eos_token="t2")


class Run:
    """One training run: its log (timings left out), and its trainable weights before and after."""

    def __init__(self, trainer: Any) -> None:
        trained = [(name, p) for name, p in trainer.model.named_parameters() if p.requires_grad]
        self.initial = {name: p.detach().clone() for name, p in trained}
        # read by Trainer from model.forward's signature (the pack's forward, at the load): whether the model takes
        # num_items_in_batch, else Trainer divides each micro-batch's loss by the accumulation steps itself
        self.accepts_loss_kwargs = trainer.model_accepts_loss_kwargs
        trainer.train()
        self.log = [{k: v for k, v in entry.items() if k not in TIMINGS} for entry in trainer.state.log_history]
        self.weights = {name: p.detach().clone() for name, p in trained}


def _sft(checkpoint: Path, out: Path, install: str | None = None, **extra: Any) -> Run:
    """TRL's SFT, defaults but ``COMMON``, on 8 rows of 10 to 17 tokens (so that ``num_items_in_batch``, the
    token count over the two accumulated micro-batches, differs from each micro-batch's); ``install``: the pack
    installed at the load (``"load"``) or on the trainer's model, over TRL's wrapper (``"trainer"``)."""
    generator = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, VOCAB, (10 + i,), generator=generator).tolist() for i in range(8)]
    model = load(checkpoint)
    if install == "load":
        chunked.install(model, chunk=5)
    torch.manual_seed(1234)  # LoRA's adapters are drawn when the trainer wraps the model
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(output_dir=str(out), **COMMON),
        train_dataset=Dataset.from_dict({"input_ids": rows}),
        processing_class=_tokenizer(),
        **extra,
    )
    if install == "trainer":
        chunked.install(trainer.model.get_base_model() if "peft_config" in extra else trainer.model, chunk=5)
    return Run(trainer)


def _reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward that tells sampled completions apart: the sum of their token ids, mod 17."""
    return [float(sum(int(word[1:]) for word in text.split() if word[1:].isdigit()) % 17) for text in completions]


def _grpo(checkpoint: Path, out: Path, install: str | None = None) -> Run:
    """TRL's GRPO, defaults but ``COMMON`` (no vLLM: transformers' generate samples), two completions of 4
    tokens per prompt."""
    prompts = [" ".join(f"t{(7 * i + j) % 290 + 5}" for j in range(3 + i % 3)) for i in range(8)]
    model = load(checkpoint)
    if install == "load":
        chunked.install(model, chunk=5)
    config = GRPOConfig(output_dir=str(out), num_generations=2, max_completion_length=4, **COMMON)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=_tokenizer(),
    )
    if install == "trainer":
        chunked.install(trainer.model, chunk=5)
    return Run(trainer)


def _spread(a: Run, b: Run) -> tuple[dict[str, float], dict[str, float]]:
    """Per logged metric and per weight, the largest difference between two runs (their logs' keys alike)."""
    assert [entry.keys() for entry in a.log] == [entry.keys() for entry in b.log]
    metrics: dict[str, float] = {}
    for x, y in zip(a.log, b.log, strict=True):
        for key in x:
            metrics[key] = max(metrics.get(key, 0.0), abs(float(x[key]) - float(y[key])))
    assert a.weights.keys() == b.weights.keys()
    weights = {name: float((a.weights[name] - b.weights[name]).abs().max()) for name in a.weights}
    return metrics, weights


Baselines = dict[str, tuple[Run, Run]]


@pytest.fixture(scope="module")
def baselines() -> Baselines:
    """Each kind of run without the pack, twice, computed once for the module's tests."""
    return {}


def _within_vanillas_spread(
    run: Callable[..., Run], checkpoint: Path, tmp_path: Path, install: str, baselines: Baselines
) -> Run:
    """``run`` with the pack installed (``install``) against vanilla, within vanilla against itself; checks
    that the pack computed no step and that the PackWarning says who did."""
    if run.__name__ not in baselines:
        baselines[run.__name__] = (run(checkpoint, tmp_path / "vanilla"), run(checkpoint, tmp_path / "again"))
    vanilla, again = baselines[run.__name__]
    metric_bound, weight_bound = _spread(vanilla, again)
    losses: list[Any] = []
    loss = forward_module.chunked_causal_lm_loss

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        losses.append(args[0].shape)
        return loss(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PackWarning)
        patch.setattr(forward_module, "chunked_causal_lm_loss", counted)
        ours = run(checkpoint, tmp_path / "pack", install=install)
    assert losses == []  # the installed forward computed no step's loss
    said = [str(w.message) for w in caught if issubclass(w.category, PackWarning)]
    assert len(said) == 1
    # TRL's head named, not only the forward on the model (under bf16, accelerate's autocast wrapper around
    # TRL's, where accelerate wraps the model TRL patched: not the PEFT model's base model)
    head, _, tail = said[0].partition(f"computed by {FUSED}, ")
    who, _, rest = tail.partition("; ")
    assert head == "hfpatch: LlamaForCausalLM: this training step's loss is "
    if install == "load":
        replaced = "which replaced the forward after chunked-loss's install"
        assert re.fullmatch(rf"(inside accelerate\.[\w.<>]+, )?{replaced}", who), who
    else:
        assert who == "set on the model before chunked-loss's install, called with fused_lm_head=True"
    assert rest == (
        "chunked-loss computes none of the steps it answers (their loss, gradients and memory are the "
        "wrapper's own, as without the pack)"
    )
    assert ours.accepts_loss_kwargs == vanilla.accepts_loss_kwargs
    metrics, weights = _spread(ours, vanilla)
    assert [entry["step"] for entry in ours.log if "loss" in entry] == [1, 2]
    for key, difference in metrics.items():
        assert difference <= metric_bound[key], (key, difference, metric_bound[key])
    for name, difference in weights.items():
        assert difference <= weight_bound[name], (name, difference, weight_bound[name])
    # the weights trained (an untrained run would equal vanilla's too): every trainable one moved
    moved = [name for name, weight in vanilla.weights.items() if not torch.equal(weight, vanilla.initial[name])]
    assert moved == list(vanilla.weights)
    return ours


@pytest.mark.parametrize("install", ["load", "trainer"])
def test_sft_defaults_with_gradient_accumulation(
    checkpoints: dict[str, Path], tmp_path: Path, install: str, baselines: Baselines, caplog: pytest.LogCaptureFixture
) -> None:
    """SFTTrainer's defaults, gradient accumulation 2: TRL's fused head computes every step; the pack, installed
    at the load or over TRL's wrapper, changes nothing, and says so (the load's log, then a PackWarning)."""
    with caplog.at_level(logging.INFO, logger="hfpatch"):
        ours = _within_vanillas_spread(_sft, checkpoints["llama"], tmp_path, install, baselines)
    assert {"loss", "grad_norm", "entropy", "mean_token_accuracy"} <= ours.log[0].keys()
    told = [r.getMessage() for r in caplog.records if "the loss of a training step" in r.getMessage()]
    assert len(told) == 1 and "(TRL's add_fused_lm_head: SFTTrainer, GRPOTrainer" in told[0]
    assert (f"It wraps {FUSED}" in told[0]) == (install == "trainer")


def test_sft_with_lora(checkpoints: dict[str, Path], tmp_path: Path, baselines: Baselines) -> None:
    """The same with a LoRA adapter (TRL wraps the PEFT model's base model): the adapters' training is TRL's."""

    def sft_lora(checkpoint: Path, out: Path, install: str | None = None) -> Run:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return _sft(checkpoint, out, install, peft_config=lora)

    ours = _within_vanillas_spread(sft_lora, checkpoints["llama"], tmp_path, "load", baselines)
    assert ours.weights and all("lora_" in name for name in ours.weights)


@pytest.mark.parametrize("install", ["load", "trainer"])
def test_grpo_with_gradient_accumulation(
    checkpoints: dict[str, Path], tmp_path: Path, install: str, baselines: Baselines
) -> None:
    """GRPOTrainer (no vLLM; two completions per prompt; gradient accumulation 2): its log-probabilities, loss and
    updates are TRL's fused head's, the generations vanilla's (the same rewards)."""
    ours = _within_vanillas_spread(_grpo, checkpoints["llama"], tmp_path, install, baselines)
    assert {"loss", "grad_norm", "entropy", "reward", "reward_std"} <= ours.log[0].keys()


def test_strict_mode_refuses_a_step_the_pack_does_not_compute(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Selected, and computing nothing: with HF_PATCH_STRICT=1 the first step TRL's head computes raises
    (the same message as the warning), rather than training with a pack that does not take part."""
    monkeypatch.setenv("HF_PATCH_STRICT", "1")
    with pytest.raises(PackError, match=r"this training step's loss is computed by ") as raised:
        _sft(checkpoints["llama"], tmp_path / "strict", install="load")
    assert (raised.value.pack, raised.value.stage) == ("chunked-loss", "step")


def test_the_pack_computes_when_the_fused_head_is_off(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """TRL's wrapper without ``fused_lm_head`` calls the forward it wrapped: the pack's step, exact; with it,
    the wrapper's own; the log, the PackWarning and ``loss_computed_by`` say which."""
    input_ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    vanilla = load(checkpoints["llama"])
    vanilla_loss = vanilla(input_ids=input_ids, labels=input_ids).loss
    model = load(checkpoints["llama"])
    chunked.install(model, chunk=5)
    assert chunked.loss_computed_by(model) == "chunked-loss"
    add_fused_lm_head(model)
    assert chunked.loss_computed_by(model) == FUSED
    with caplog.at_level(logging.INFO, logger="hfpatch"), pytest.warns(PackWarning) as caught:
        out = model(input_ids=input_ids, labels=input_ids)
        fused_out = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
        model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)  # said once
    assert out.logits.shape == (2, 1, VOCAB)  # the pack's step
    assert abs(float(out.loss - vanilla_loss)) <= 1e-6 * abs(float(vanilla_loss))
    assert abs(float(fused_out.loss - vanilla_loss)) <= 1e-5 * abs(float(vanilla_loss))
    said = [r.getMessage() for r in caplog.records if "this training step's loss is computed by" in r.getMessage()]
    assert said == [
        "hfpatch: LlamaForCausalLM: this training step's loss is computed by chunked-loss "
        f"(called with labels by {FUSED})"
    ]
    assert [str(w.message) for w in caught if issubclass(w.category, PackWarning)] == [
        f"hfpatch: LlamaForCausalLM: this training step's loss is computed by {FUSED}, which replaced the forward "
        "after chunked-loss's install; chunked-loss computes none of the steps it answers (their loss, gradients "
        "and memory are the wrapper's own, as without the pack)"
    ]
    chunked.uninstall(model)
    assert chunked.loss_computed_by(model) is None


def test_installed_over_the_fused_head(checkpoints: dict[str, Path]) -> None:
    """Installed after TRL wrapped the forward (``hfpatch_core.apply(trainer.model)``): a ``fused_lm_head=True``
    call is TRL's own, bit for bit (the pack once replaced its labels and failed in it); a call with labels
    only is the pack's step."""
    input_ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))
    model = load(checkpoints["llama"])
    add_fused_lm_head(model)
    reference = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    reference.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    chunked.install(model, chunk=5)
    with pytest.warns(PackWarning, match=r"set on the model before chunked-loss's install, called with fused_lm_he"):
        out = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
    out.loss.backward()
    assert torch.equal(out.loss, reference.loss) and torch.equal(out.log_probs, reference.log_probs)
    assert all(torch.equal(p.grad, grads[name]) for name, p in model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackWarning)  # the pack's own step warns nothing
        step = model(input_ids=input_ids, labels=input_ids)
    assert step.logits.shape == (2, 1, VOCAB)
    assert abs(float(step.loss - reference.loss)) <= 1e-5 * abs(float(reference.loss))
