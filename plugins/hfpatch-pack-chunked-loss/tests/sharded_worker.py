"""A rank of ``test_distributed.py``'s sharded cases, run by ``torchrun --nproc_per_node 2`` (gloo, CPU).

``python -m torch.distributed.run --standalone --nproc_per_node 2 sharded_worker.py CHECKPOINT OUT``:
each rank trains one step on its own batch of the checkpoint loaded as one process, then sharded by
FSDP2 by hand (``fully_shard`` on each decoder layer, then on the model), vanilla and with the pack
installed before or after the sharding, and writes ``OUT/rankN.json``: per case the loss, its
distance from the single-process reference, the gradients' distance (the whole gradient, gathered
from the shards), and the most bytes of vocabulary-sized tensors (logits) alive during the step.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hfpatch_pack_chunked_loss as chunked
import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

RANK = int(os.environ.get("RANK", "0"))
CHUNK = 5  # tokens per chunk: several chunks per batch, a last one shorter


class LiveLogits(TorchDispatchMode):
    """The most bytes of tensors with a vocabulary-sized dimension and no hidden-sized one alive at once."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden = vocab, hidden
        self.live: dict[int, tuple[weakref.ref[Any], int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (
                type(tensor) is torch.Tensor  # a DTensor's local tensor is counted as it is made
                and self.vocab in tensor.shape
                and self.hidden not in tensor.shape
            ):
                storage = tensor.untyped_storage()
                self.live[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        self.live = {key: value for key, value in self.live.items() if value[0]() is not None}
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def load(path: str) -> Any:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    return model


def batch(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(100 + rank))
    labels = ids.clone()
    labels[0, :3] = -100  # ignored tokens: the mean is over the others
    return ids, labels


def reference(path: str, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, vanilla: each rank's loss, and the gradient FSDP2 averages over the ranks."""
    model = load(path)
    vocab = model.config.vocab_size
    losses = []
    for rank in range(world):
        ids, labels = batch(rank, vocab)
        loss = model(input_ids=ids, labels=labels).loss
        (loss / world).backward()
        losses.append(float(loss))
    return losses, {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def shard(model: Any) -> None:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def step(model: Any) -> dict[str, Any]:
    config = model.config
    ids, labels = batch(RANK, config.vocab_size)
    with LiveLogits(config.vocab_size, config.hidden_size) as mode:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return {
        "loss": float(out.loss),
        "logits_shape": list(out.logits.shape),
        "peak_logits_bytes": mode.peak,
        "grads": grads,
    }


def vanilla_sharded(model: Any) -> Any:
    shard(model)
    return model


def installed_then_sharded(model: Any) -> Any:
    chunked.install(model, chunk=CHUNK)
    shard(model)
    return model


def sharded_then_installed(model: Any) -> Any:
    shard(model)
    chunked.install(model, chunk=CHUNK)
    return model


def head_own_unit(model: Any) -> Any:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    try:
        chunked.install(model, chunk=CHUNK)
    except chunked.ChunkedLossRefused as exc:
        model.refusal = str(exc)
    return model


def transformers_fsdp(path: str, install: bool) -> Any:
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=2)
    )
    model.train()
    if install:
        chunked.install(model, chunk=CHUNK)
    return model


def transformers_tp(path: str) -> Any:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    model.train()
    # 5.25 shards the head's rows (a DTensor); 5.3 keeps it whole on every rank
    model.head_sharded = type(model.lm_head.weight).__name__ == "DTensor"
    try:
        chunked.install(model, chunk=CHUNK)
    except chunked.ChunkedLossRefused as exc:
        model.refusal = str(exc)
    return model


CASES: dict[str, Callable[[Any], Any]] = {
    "vanilla": vanilla_sharded,
    "installed-then-sharded": installed_then_sharded,
    "sharded-then-installed": sharded_then_installed,
    "head-own-unit": head_own_unit,
    "transformers-fsdp-vanilla": lambda path: transformers_fsdp(path, False),
    "transformers-fsdp": lambda path: transformers_fsdp(path, True),
    "transformers-tp": transformers_tp,
}


def main() -> None:
    path, out = sys.argv[1], Path(sys.argv[2])
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    losses, expected = reference(path, world)
    payload: dict[str, Any] = {"rank": RANK, "reference_loss": losses[RANK], "cases": {}}
    from transformers.distributed import DistributedConfig

    # 5.3 has no FSDP2 load (no DistributedConfig.fsdp_size)
    has_fsdp_load = "fsdp_size" in getattr(DistributedConfig, "__dataclass_fields__", {})
    for name, prepare in CASES.items():
        if name.startswith("transformers-fsdp") and not has_fsdp_load:
            continue
        torch.manual_seed(0)
        model = prepare(path) if name.startswith("transformers") else prepare(load(path))
        result = step(model)
        grads = result.pop("grads")
        scale = {n: float(g.abs().max()) for n, g in expected.items()}
        result["installed"] = chunked.installed(model) is not None
        result["refusal"] = getattr(model, "refusal", None)
        result["head_sharded"] = getattr(model, "head_sharded", None)
        result["loss_error"] = abs(result["loss"] - losses[RANK])
        # tensor parallelism trains every rank on one batch, and 5.3 leaves its gradients local shards:
        # its case checks the refusal, not the step
        compared = expected if name != "transformers-tp" else {}
        result["grad_error"] = {n: float((grads[n] - expected[n]).abs().max()) for n in compared}
        result["grad_scale"] = scale
        # a gradient 0.1% off (a wrong divisor, a dropped chunk would be far more): the bound must fail it
        result["wrong_error"] = {n: float((expected[n] * 1.001 - expected[n]).abs().max()) for n in expected}
        payload["cases"][name] = result
    (out / f"rank{RANK}.json").write_text(json.dumps(payload, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    # results written: skip finalization, where gloo's threads may still hold FSDP2's async work
    # (see the core suite's distributed_cases.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
