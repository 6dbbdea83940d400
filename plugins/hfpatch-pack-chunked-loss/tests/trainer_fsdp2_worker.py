"""A rank of ``test_trainer_fsdp2.py``, run by ``torchrun --nproc_per_node 2`` (gloo, CPU).

``python -m torch.distributed.run --standalone --nproc_per_node 2 trainer_fsdp2_worker.py CASES_JSON OUT``:
each case loads its checkpoint with its packs (``HF_PATCH_PACKS``-style), trains ``STEPS`` SGD steps with
``Trainer`` and ``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` (accelerate's
FSDP2 plugin: ``Accelerator.prepare`` shards the model with ``fsdp2_prepare_model``), every rank on the
same batch (the three rows of ``TrainerBatches``), and writes ``OUT/rankN.json`` (the losses, the
installed steps, the FSDP2 units, the head's inputs) and, on rank 0, ``OUT/NAME.safetensors`` (the
trained weights, gathered from the shards).

accelerate 1.15 turns its FSDP plugin on for GPU backends only: on CPU (``use_cpu=True``) it keeps
``MULTI_CPU`` and ``Trainer`` wraps the model in DDP, silently.  The worker sets, before the
``Trainer`` is built, the state accelerate sets on a GPU (``distributed_type=FSDP`` and the plugin
``Trainer`` builds from the arguments); the rest, the sharding included, is accelerate's and ``Trainer``'s.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, TrainingArguments
from zero3_worker import head_inputs

import hfpatch_core
from hfpatch_core.plan import plan_of
from hfpatch_core.testing.deepspeed import DEFAULT_STEPS, in_order_trainer, training_arguments

STEPS = DEFAULT_STEPS


def fsdp_on_cpu(args: TrainingArguments) -> None:
    """What accelerate sets on a GPU for its FSDP plugin (see the module's docstring)."""
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    accelerator = Accelerator(cpu=True)
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def run_case(name: str, checkpoint: str, packs: str, out: Path) -> dict[str, Any]:
    # reference_training's arguments, sharded by accelerate's FSDP2 plugin
    args = training_arguments(str(out / name), STEPS, optim="sgd", fsdp="full_shard", fsdp_config={"fsdp_version": 2})
    fsdp_on_cpu(args)
    with hfpatch_core.enabled(packs=packs):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    plan = plan_of(model)
    observed = head_inputs(model)
    trainer = in_order_trainer(model, args, STEPS)
    trainer.train()
    wrapped = trainer.model_wrapped
    units = [n for n, m in wrapped.named_modules() if isinstance(m, FSDPModule)]
    weights = {}
    for key, value in wrapped.state_dict().items():  # full_tensor: a collective, on every rank
        weights[key] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{name}.safetensors"))
    return {
        "losses": [float(e["loss"]) for e in trainer.state.log_history if "loss" in e],
        "steps": [f"{c.target} [{c.pack}]" for c in plan.installed_steps] if plan else [],
        "refused": {r.target: r.reason for r in plan.refused} if plan else {},
        "units": units,
        "distributed_type": trainer.accelerator.distributed_type.name,
        "head_inputs": observed(),
    }


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo")
    results = {case["name"]: run_case(case["name"], case["checkpoint"], case["packs"], out) for case in spec}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the finalization, where gloo's threads may still hold FSDP2's work


if __name__ == "__main__":
    main()
