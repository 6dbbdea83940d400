"""What ``test_zero3.py``'s ranks record (``Zero3Case.observe``), and the step-peak measurement.

``head_inputs``: an observer that records the shape of every input of the LM head during the
training, so a test tells the chunked step (the head called on the last position only,
``logits_to_keep=1``) from vanilla's (every position); ``install_after_the_engine`` also tries
``install`` on the model once DeepSpeed's engine runs it.

``python -m torch.distributed.run --standalone --nproc_per_node 2 zero3_worker.py peak CHECKPOINT
PACKS TOKENS``: one ZeRO-3 training step (``deepspeed.initialize``, the model built under
``zero.Init``) on ``TOKENS`` tokens per rank; each rank prints its step's peak resident memory
above the resident memory before it (``VmHWM`` after the step minus ``VmRSS`` before it, the
high-water mark reset first), in MiB.  One process per measurement: memory freed by an earlier
model stays with the allocator and would hide a later step's growth.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


def head_inputs(model: nn.Module) -> Callable[[], list[list[int]]]:
    """Record the shapes of the LM head's inputs in a training step; the returned function stops and gives them."""
    seen: list[list[int]] = []
    head: Any = model.get_output_embeddings()  # type: ignore[operator]

    def record(module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            seen.append(list(args[0].shape))

    handle = head.register_forward_pre_hook(record)

    def done() -> list[list[int]]:
        handle.remove()
        return seen

    return done


def install_after_the_engine(model: nn.Module) -> Callable[[], dict[str, Any]]:
    """``head_inputs``, and after the training (the model run by DeepSpeed's engine) ``install`` tried on the
    model: what it raised."""
    import hfpatch_pack_chunked_loss as chunked

    inputs = head_inputs(model)

    def done() -> dict[str, Any]:
        try:
            chunked.install(model)  # type: ignore[arg-type]
        except Exception as exc:
            raised: str | None = f"{type(exc).__name__}: {exc}"
        else:
            raised = None
        return {"head_inputs": inputs(), "late_install": raised}

    return done


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak(checkpoint: str, packs: str, tokens: int) -> None:
    """One ZeRO-3 step on ``tokens`` tokens per rank; prints the rank's step peak above its resident memory."""
    import deepspeed
    import torch.distributed as dist
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import hfpatch_core
    from hfpatch_core.plan import plan_of

    transformers.utils.logging.set_verbosity_error()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,  # torch SGD, as Trainer allows its optimizers
    }
    keep = HfDeepSpeedConfig(config)  # alive during from_pretrained: the model is built under zero.Init
    with hfpatch_core.enabled(packs=packs):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):  # the first step allocates DeepSpeed's buffers: the second is measured
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        grown = _status("VmHWM") - before
    steps = [claim.target for claim in plan.installed_steps] if (plan := plan_of(model)) else []
    print(
        f"rank {dist.get_rank()} packs={packs} steps={steps} tokens={tokens} vocab={vocab} "
        f"step peak +{grown / 2**20:.0f} MiB"
    )
    del keep


if __name__ == "__main__":
    if sys.argv[1] == "peak":
        peak(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    sys.stdout.flush()
    os._exit(0)  # skip gloo's finalization (as hfpatch_core.testing.deepspeed does)
