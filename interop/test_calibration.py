"""Routed experts under llm-compressor's calibration (issue 51 point 3); run by `make interop` in `.venv-interop`.

llm-compressor's ``oneshot`` calibrates inside ``moe_calibration_context()`` by default
(``moe_calibrate_all_experts=True``): an experts loop that reads its flag runs every expert on
every calibration token and keeps only the routed rows, as its own ``LinearExperts2D`` does.
qwen-moe's ``PerExpertExperts`` (qwen3_moe here) and linear-experts' ``LinearExperts`` (mixtral)
read it through ``hfpatch_core.authoring.calibration``. What these tests pin, with the real
llm-compressor and GPTQ W4A16 on tiny checkpoints (8 experts, 2 per token, 2 layers):

* inside the context every expert's linears see every token once, in one call whose routed rows
  are kept (as in llm-compressor's own ``LinearExperts2D``), outside it only the routed rows; the
  logits move no further than llm-compressor's own experts' (calibrated in the run);
* with the flag on every expert projection goes through GPTQ, with finite positive scales, and
  comes out as llm-compressor's own path (its post-load ``LinearExperts2D``) quantizes it: the
  same scales, the same weights but where GPTQ's rounding meets a boundary (the Hessians sum the
  same rows in another order), and logits a tenth of the quantization's own change apart at most;
* with the flag off (``moe_calibrate_all_experts=False``) and too few tokens for every expert,
  the pack runs an expert that got no token on every token instead of skipping it (skipped,
  llm-compressor saved it with uninitialised scales), names it in a ``PackWarning``, and raises
  ``PackError`` with ``HF_PATCH_STRICT=1``; llm-compressor's own experts, called with zero rows,
  come out of GPTQ all zero (the control).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from harness import calibration, load, logits
from transformers import AutoModelForCausalLM

import hfpatch_core
from hfpatch_core import PackError, PackWarning
from hfpatch_core.authoring.calibration import calibrating_all_experts
from hfpatch_core.testing import tiny_checkpoint

transformers.utils.logging.disable_progress_bar()

#: Multiples of 128, so that group-128 schemes (W4A16) fit; 8 experts, 2 per token.
SIZES = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128, num_hidden_layers=2)
MODELS = {
    "qwen3_moe": ("qwen-moe", dict(SIZES, num_experts=8, num_experts_per_tok=2)),
    "mixtral": (
        "linear-experts",
        dict(SIZES, num_local_experts=8, num_experts_per_tok=2, head_dim=32, num_attention_heads=4),
    ),
}
#: llm-compressor's per-expert names (``LinearExperts2D``) for the pack's (mixtral keeps the checkpoint's w1/w3/w2)
OURS_TO_THEIRS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@pytest.fixture(autouse=True)
def _defused(defused) -> None:
    """Every test meets llm-compressor's calls into transformers 5.17's alias modules (conftest)."""
    yield
    hfpatch_core.disable()


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_type(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        model_type: tiny_checkpoint(model_type, tmp_path_factory.mktemp(model_type), **overrides)
        for model_type, (_, overrides) in MODELS.items()
    }


def experts_of(model) -> list[torch.nn.Module]:
    return [layer.mlp.experts for layer in model.model.layers]


def canonical(name: str) -> str:
    """A module's name in llm-compressor's layout (``...experts.3.gate_proj`` for mixtral's ``...experts.3.w1``)."""
    prefix, _, last = name.rpartition(".")
    return f"{prefix}.{OURS_TO_THEIRS.get(last, last)}"


def expert_linears(model) -> dict[str, torch.nn.Linear]:
    """Every routed expert projection, by its name in llm-compressor's layout."""
    return {
        canonical(name): module
        for name, module in model.named_modules()
        if ".experts." in name and isinstance(module, torch.nn.Linear)
    }


def gptq(model, samples: int, length: int, *, all_experts: bool = True) -> set[str]:
    """``oneshot`` GPTQ W4A16; returns the names of the modules GPTQ quantized (llm-compressor's own record)."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    quantized: set[str] = set()
    compress = GPTQModifier.compress_module_list

    def recorded(self, module_list):
        quantized.update(canonical(self._module_names[module]) for module in module_list)
        return compress(self, module_list)

    GPTQModifier.compress_module_list = recorded
    try:
        oneshot(
            model=model,
            **calibration(model.config, samples, length),
            recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
            num_calibration_samples=samples,
            max_seq_length=length,
            shuffle_calibration_samples=False,
            moe_calibrate_all_experts=all_experts,
        )
    finally:
        GPTQModifier.compress_module_list = compress
    return quantized


def tokens(config) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))


def test_the_flag_is_read_only_where_llmcompressor_is_imported() -> None:
    """``calibrating_all_experts`` never imports llm-compressor, and reads its context where it is imported."""
    code = (
        "import sys; from hfpatch_core.authoring.calibration import calibrating_all_experts; "
        "print(calibrating_all_experts(), 'llmcompressor' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]

    from llmcompressor.modeling.moe.context import moe_calibration_context

    assert not calibrating_all_experts()
    with moe_calibration_context():
        assert calibrating_all_experts()
    assert not calibrating_all_experts()


def departure(model, ids) -> float:
    """How far ``model``'s logits move inside llm-compressor's calibration context from outside it."""
    from llmcompressor.modeling.moe.context import moe_calibration_context

    outside = logits(model, ids)
    with moe_calibration_context():
        inside = logits(model, ids)
    return float((inside - outside).abs().max())


def test_inside_the_context_every_expert_sees_every_token_as_in_llmcompressors_own_experts(
    checkpoints, model_type
) -> None:
    """Inside the context each expert runs once on every token and keeps its routed rows, as
    llm-compressor's ``LinearExperts2D`` does (so the observers see what they see there); a linear
    on all rows, then indexed, may differ from one on the routed rows in the last bits, so the
    logits may move as far as llm-compressor's own experts' move, calibrated in this run."""
    from llmcompressor.modeling.moe.context import moe_calibration_context
    from llmcompressor.modeling.moe.linearize import linearize_moe

    pack, _ = MODELS[model_type]
    theirs = load(checkpoints[model_type], None)
    linearize_moe(theirs)
    model = load(checkpoints[model_type], pack)
    ids = tokens(model.config)
    bound = 4 * max(departure(theirs, ids), departure(theirs, ids[:1, :1])) + 8 * torch.finfo(torch.float32).eps
    every = ids.numel()
    outside, one_outside = logits(model, ids), logits(model, ids[:1, :1])
    linears = expert_linears(model)
    rows = dict.fromkeys(linears, 0)

    def counted(name, forward):
        # counts through the forward, not a hook: a hook is what makes an unrouted expert run (observed)
        def wrapped(states):
            rows[name] += states.shape[0]
            return forward(states)

        return wrapped

    for name, linear in linears.items():
        linear.forward = counted(name, linear.forward)
    assert torch.equal(logits(model, ids), outside)
    # only the routed rows: each token goes to 2 experts, 3 projections each, in each layer
    assert sum(rows.values()) == every * model.config.num_experts_per_tok * 3 * model.config.num_hidden_layers
    rows.update(dict.fromkeys(rows, 0))
    with moe_calibration_context():
        inside = logits(model, ids)
    assert set(rows.values()) == {every}  # every projection of every expert, each token once
    torch.testing.assert_close(inside, outside, rtol=0, atol=bound * max(1.0, float(outside.abs().max())))
    # one token (a decode step) too: inside, every expert runs on it
    rows.update(dict.fromkeys(rows, 0))
    with moe_calibration_context():
        one = logits(model, ids[:1, :1])
    assert set(rows.values()) == {1}
    torch.testing.assert_close(one, one_outside, rtol=0, atol=bound * max(1.0, float(one_outside.abs().max())))


def test_with_the_flag_every_expert_goes_through_gptq_as_without_the_pack(checkpoints, model_type) -> None:
    """8 samples of 32 tokens; llm-compressor's own path (its post-load ``LinearExperts2D``) is the reference."""
    pack, _ = MODELS[model_type]
    path = checkpoints[model_type]
    vanilla = load(path, None)
    theirs_quantized = gptq(vanilla, 8, 32)
    theirs = expert_linears(vanilla)
    assert set(theirs) <= theirs_quantized  # llm-compressor's own path: every expert projection

    model = load(path, pack)
    assert type(experts_of(model)[0]).__name__ != type(experts_of(vanilla)[0]).__name__
    ids = tokens(model.config)
    reference = logits(model, ids)
    quantized = gptq(model, 8, 32)
    ours = expert_linears(model)
    assert len(ours) == model.config.num_hidden_layers * 8 * 3
    assert set(ours) <= quantized
    assert all(
        torch.isfinite(linear.weight_scale).all() and (linear.weight_scale > 0).all() for linear in ours.values()
    )

    # the same scales: the weight observer reads the weights alone, before GPTQ
    assert all(torch.equal(ours[name].weight_scale, theirs[name].weight_scale) for name in ours)
    # the same quantized weights but where GPTQ's rounding meets a boundary: the Hessians are the same sums
    # of the same rows but for their order (a separate call for the unrouted rows; after the first layer,
    # inputs a few ulps apart: qwen-moe fuses q/k/v), so a weight at most one step apart, and rarely
    # (measured: 0 of 786432 on mixtral, 22 on qwen3_moe)
    flipped = 0
    for name in ours:
        step = theirs[name].weight_scale.repeat_interleave(128, dim=1)
        difference = (ours[name].weight - theirs[name].weight).abs()
        assert (difference <= step * (1 + 1e-6)).all(), name
        flipped += int((difference > 0).sum())
    entries = sum(linear.weight.numel() for linear in ours.values())
    assert flipped < 0.01 * entries
    # as good: the quantized models differ by a tenth of what quantization moved the logits, at most
    quantized_logits, theirs_logits = logits(model, ids), logits(vanilla, ids)
    moved = (theirs_logits - logits(load(path, None), ids)).abs().max()
    assert (quantized_logits - theirs_logits).abs().max() <= 0.1 * moved
    print(f"{model_type}: {flipped}/{entries} quantized expert weights differ from llm-compressor's own path")
    assert not torch.equal(quantized_logits, reference)  # the quantized experts ran


def test_without_the_flag_an_expert_given_no_token_runs_on_every_token_and_is_named(
    checkpoints, model_type, monkeypatch
) -> None:
    """1 sample of 4 tokens: 8 routed rows per layer for 8 experts, so some get none."""
    pack, _ = MODELS[model_type]
    path = checkpoints[model_type]
    model = load(path, pack)
    ids = tokens(model.config)
    with pytest.warns(PackWarning) as caught:
        quantized = gptq(model, 1, 4, all_experts=False)
    named = [
        re.search(r"(model\.layers\.\d+\.mlp\.experts): the router gave experts? ([\d, ]+) no token", str(each.message))
        for each in caught
    ]
    assert all(named) and {match[1] for match in named} == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    ours = expert_linears(model)
    assert set(ours) <= quantized
    assert all(
        torch.isfinite(linear.weight_scale).all() and (linear.weight_scale > 0).all() for linear in ours.values()
    )
    assert not any((linear.weight == 0).all() for linear in ours.values())
    assert torch.isfinite(logits(model, ids)).all()

    # strict mode, asked for at the load (enable(strict=True)) or in the environment at calibration
    hfpatch_core.enable(pack, strict=True)
    try:
        strict = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        hfpatch_core.disable()
    with pytest.raises(PackError, match="no token") as raised:
        gptq(strict, 1, 4, all_experts=False)
    assert raised.value.stage == "calibration" and raised.value.pack == pack
    monkeypatch.setenv("HF_PATCH_STRICT", "1")
    with pytest.raises(PackError, match="no token"):
        gptq(load(path, pack), 1, 4, all_experts=False)


def test_the_control_llmcompressors_own_experts_given_no_token_come_out_of_gptq_all_zero(checkpoints) -> None:
    """Why the pack does not call such an expert on zero rows, as ``LinearExperts2D`` does: GPTQ then sees
    an all-zero Hessian, takes every column for dead and zeroes the whole weight."""
    vanilla = load(checkpoints["qwen3_moe"], None)
    gptq(vanilla, 1, 4, all_experts=False)
    zero = [name for name, linear in expert_linears(vanilla).items() if (linear.weight == 0).all()]
    assert zero and len(zero) % 3 == 0  # whole experts: gate, up and down
    assert math.isfinite(sum(linear.weight_scale.sum().item() for linear in expert_linears(vanilla).values()))
