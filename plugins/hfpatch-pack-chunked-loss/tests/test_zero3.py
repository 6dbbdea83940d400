"""chunked-loss under DeepSpeed ZeRO-3, for real: ``Trainer`` on 2 CPU ranks (gloo), one ``torchrun``.

The core's ZeRO-3 harness (``hfpatch_core.testing.deepspeed``) runs every case on both ranks:
the tiny llama, with its head untied and tied to the embeddings, loaded with
``HF_PATCH_PACKS=chunked-loss`` on both load paths (``zero.Init``: ``from_pretrained`` builds the
model partitioned, and the pack's probe runs on it, gathered; ``initialize``: a plain load,
partitioned by ``deepspeed.initialize`` after the install), trained 2 SGD steps with a ZeRO-3
config, and saved with ``Trainer.save_model``.  Against a single-process vanilla run of the same
steps, in the same test: each rank's losses and the trained weights (gathered), within what ZeRO-3
does to vanilla's own (vanilla under ZeRO-3 in the same torchrun); the head called on the last
position only (the chunked step ran, not vanilla's); the checkpoint vanilla transformers reloads
equal to the trained weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hfpatch_core.testing import safetensors_of, tiny_checkpoint
from hfpatch_core.testing.deepspeed import (
    EXTENSIONS_DIR,
    Zero3Case,
    Zero3Result,
    loss_bound,
    reference_training,
    weight_bounds,
    zero3_training,
)

PACKS_SITE = Path(sys.prefix) / "first-party-packs"
TESTS = Path(__file__).parent
# SGD: an update is the gradient times the learning rate, so the trained weights compare gradients
OPTIM = "sgd"
# a vocabulary told from the hidden size (32) and the sequence (12) by shape
VOCAB = 300
MODELS = {"llama": {"tie_word_embeddings": False}, "tied": {"tie_word_embeddings": True}}
# (model, case name, load path, saved)
CASES = [
    ("llama", "llama/chunked-loss", "zero.Init", True),
    ("llama", "llama/chunked-loss/initialize", "initialize", False),
    ("tied", "tied/chunked-loss", "zero.Init", True),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    assert any(EXTENSIONS_DIR.glob("deepspeed_shm_comm/*.so")), f"run make venv: no shm_comm op in {EXTENSIONS_DIR}"
    assert (PACKS_SITE / "hfpatch_pack_chunked_loss").is_dir(), f"no first-party packs in {PACKS_SITE}: run make venv"
    root = tmp_path_factory.mktemp("zero3")
    checkpoints = {
        name: str(tiny_checkpoint("llama", root / name, vocab_size=VOCAB, **overrides))
        for name, overrides in MODELS.items()
    }
    observe = "zero3_worker:head_inputs"
    cases = [
        Zero3Case(
            f"{name}/vanilla",
            path,
            "none",
            optim=OPTIM,
            weights=str(root / f"{name}-vanilla.safetensors"),
            save=False,
            observe="zero3_worker:install_after_the_engine",
        )
        for name, path in checkpoints.items()
    ]
    cases += [
        Zero3Case(
            name,
            checkpoints[model],
            "chunked-loss",
            init=init,
            optim=OPTIM,
            save=saved,
            observe=observe,
            weights=str(root / f"{name.replace('/', '-')}.safetensors"),
        )
        for model, name, init, saved in CASES
    ]
    results = zero3_training(cases, extra_path=[TESTS, PACKS_SITE])
    weights = {case.name: load_file(case.weights) for case in cases if case.weights}
    references = {name: reference_training(path, "none", optim=OPTIM) for name, path in checkpoints.items()}
    initial = {name: safetensors_of(path) for name, path in checkpoints.items()}
    return {"results": results, "weights": weights, "references": references, "initial": initial}


@pytest.mark.parametrize(("model", "name", "init", "saved"), CASES)
def test_zero3_training_equals_the_single_process_reference(
    run: dict[str, object], model: str, name: str, init: str, saved: bool
) -> None:
    results: dict[str, Zero3Result] = run["results"]  # type: ignore[assignment]
    weights: dict[str, dict[str, torch.Tensor]] = run["weights"]  # type: ignore[assignment]
    reference_losses, reference = run["references"][model]  # type: ignore[index]
    vanilla, ours = results[f"{model}/vanilla"], results[name]
    for result in (vanilla, ours):
        assert not any(result.errors), result.errors
        assert result.ranks_agree, result.losses
    # installed on every rank (the probe ran on the partitioned model under zero.Init) ...
    assert ours.steps == [["causal-lm-loss [chunked-loss]"]] * 2, ours.refused
    assert not any(ours.warnings), ours.warnings
    # ... and its step ran: the head saw the last position (batch 3, 1 token), vanilla's every position
    hidden = int(reference["model.embed_tokens.weight"].shape[1])
    for rank in range(2):
        assert ours.observed[rank] == [[3, 1, hidden]] * 2, ours.observed[rank]
        assert vanilla.observed[rank]["head_inputs"] == [[3, 12, hidden]] * 2, vanilla.observed[rank]
    assert ours.max_loss_diff(reference_losses) <= loss_bound(vanilla.losses, reference_losses)
    trained, bounds = weights[name], weight_bounds(weights[f"{model}/vanilla"], reference)
    assert set(trained) == set(reference)
    for key, bound in bounds.items():
        error = float((trained[key] - reference[key]).abs().max())
        assert error <= bound, (key, error, bound)
    if saved:
        assert "model.safetensors" in ours.saved, ours.saved
        assert ours.reload_keys == []
        assert ours.reload_diff == 0.0  # vanilla reloads exactly the trained weights


@pytest.mark.parametrize("model", list(MODELS))
def test_the_bound_fails_a_head_gradient_one_percent_off(run: dict[str, object], model: str) -> None:
    # SGD: a head gradient 1% off (a rank's share lost in the reduce-scatter would be 50%) moves the trained
    # head by 1% of its update, which the bound must catch
    weights: dict[str, dict[str, torch.Tensor]] = run["weights"]  # type: ignore[assignment]
    reference = run["references"][model][1]  # type: ignore[index]
    initial = run["initial"][model]  # type: ignore[index]
    head = "lm_head.weight" if "lm_head.weight" in initial else "model.embed_tokens.weight"  # tied: one tensor
    bound = weight_bounds(weights[f"{model}/vanilla"], reference)[head]
    update = reference[head] - initial[head]
    assert 0.01 * float(update.abs().max()) > bound, (float(update.abs().max()), bound)


@pytest.mark.parametrize("model", list(MODELS))
def test_an_install_once_the_engine_runs_the_model_is_refused_with_the_way_to_install(
    run: dict[str, object], model: str
) -> None:
    results: dict[str, Zero3Result] = run["results"]  # type: ignore[assignment]
    # on every rank (no rank waits in a gather alone), before the probe runs anything
    for observed in results[f"{model}/vanilla"].observed:
        raised = observed["late_install"]
        assert raised is not None and raised.startswith("ChunkedLossRefused: the model is already run by a DeepSpeed")
        assert "HF_PATCH_PACKS=chunked-loss" in raised and "before deepspeed.initialize" in raised
