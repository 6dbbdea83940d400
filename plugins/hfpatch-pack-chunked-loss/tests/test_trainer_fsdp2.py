"""chunked-loss under ``Trainer`` with accelerate's FSDP2 plugin, for real: ``torchrun`` (2 ranks, gloo, CPU).

``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` on the tiny llama, its head
untied and tied (``trainer_fsdp2_worker.py``): accelerate shards the embeddings, the root (and each
decoder layer on transformers 5.25, whose default wrap policy wraps them), and the head in one unit
with the final norm (with the embeddings too when tied), kept gathered after the forward
(``reshard_after_forward=False``).  The norm runs inside the decoder, so the
head is whole when the decoder returns and the chunked step is the single-process one; nothing is
refused.  Against a single-process vanilla run of the same steps (SGD), in the same test: each rank's
losses and the trained weights (gathered from the shards), within what FSDP2 does to vanilla's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from hfpatch_core.testing import safetensors_of, tiny_checkpoint
from hfpatch_core.testing.deepspeed import loss_bound, reference_training, weight_bounds

WORKER = Path(__file__).with_name("trainer_fsdp2_worker.py")
PACKS_SITE = Path(sys.prefix) / "first-party-packs"
VOCAB = 300
MODELS = {"llama": {"tie_word_embeddings": False}, "tied": {"tie_word_embeddings": True}}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trainer-fsdp2")
    checkpoints = {
        name: str(tiny_checkpoint("llama", root / name, vocab_size=VOCAB, **overrides))
        for name, overrides in MODELS.items()
    }
    cases = [
        {"name": f"{model}-{packs}", "checkpoint": path, "packs": packs}
        for model, path in checkpoints.items()
        for packs in ("none", "chunked-loss")
    ]
    out = root / "out"
    out.mkdir()
    spec = root / "cases.json"
    spec.write_text(json.dumps(cases))
    path = [str(WORKER.parent), str(PACKS_SITE), *(entry for entry in sys.path if entry)]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "USE_HUB_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, str(WORKER), str(spec), str(out)], env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return {
        "ranks": [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)],
        "weights": {case["name"]: load_file(out / f"{case['name']}.safetensors") for case in cases},
        "references": {name: reference_training(path, "none", optim="sgd") for name, path in checkpoints.items()},
        "initial": {name: safetensors_of(path) for name, path in checkpoints.items()},
    }


@pytest.mark.parametrize("model", list(MODELS))
def test_trainer_fsdp2_gives_the_single_process_losses_and_weights(run: dict[str, Any], model: str) -> None:
    reference_losses, reference = run["references"][model]
    hidden = int(reference["model.embed_tokens.weight"].shape[1])
    for rank in run["ranks"]:
        vanilla, ours = rank[f"{model}-none"], rank[f"{model}-chunked-loss"]
        assert ours["distributed_type"] == "FSDP"
        # accelerate's units: the head with the final norm (and the tied embeddings), not alone; the decoder
        # layers are units of their own where the arguments' wrap policy says so (5.25's default, not 5.3's)
        head_unit = "model.embed_tokens" if model == "tied" else "model.norm"
        assert {"", head_unit, "lm_head"} <= set(ours["units"]), ours["units"]
        assert ours["steps"] == ["causal-lm-loss [chunked-loss]"], ours["refused"]
        # the chunked step ran (the head called on the last position), vanilla's on every position
        assert ours["head_inputs"] == [[3, 1, hidden]] * 2, ours["head_inputs"]
        assert vanilla["head_inputs"] == [[3, 12, hidden]] * 2, vanilla["head_inputs"]
        bound = loss_bound(vanilla["losses"], reference_losses)
        assert max(abs(a - b) for a, b in zip(ours["losses"], reference_losses, strict=True)) <= bound
    trained = run["weights"][f"{model}-chunked-loss"]
    bounds = weight_bounds(run["weights"][f"{model}-none"], reference)
    assert set(trained) == set(reference)
    for key, bound in bounds.items():
        error = float((trained[key] - reference[key]).abs().max())
        assert error <= bound, (key, error, bound)


@pytest.mark.parametrize("model", list(MODELS))
def test_the_bound_fails_a_head_gradient_one_percent_off(run: dict[str, Any], model: str) -> None:
    reference = run["references"][model][1]
    initial = run["initial"][model]
    head = "lm_head.weight" if "lm_head.weight" in initial else "model.embed_tokens.weight"  # tied: one tensor
    bound = weight_bounds(run["weights"][f"{model}-none"], reference)[head]
    update = reference[head] - initial[head]
    assert 0.01 * float(update.abs().max()) > bound, (float(update.abs().max()), bound)
