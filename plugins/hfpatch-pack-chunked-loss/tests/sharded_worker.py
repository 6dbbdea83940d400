"""A rank of ``test_distributed.py``'s sharded cases, run by ``torchrun --nproc_per_node 2`` (gloo, CPU).

``python -m torch.distributed.run --standalone --nproc_per_node 2 sharded_worker.py CHECKPOINT OUT``:
each rank trains one step on its own batch of the checkpoint loaded as one process, then sharded by
FSDP2 by hand (``fully_shard`` on each decoder layer, then on the model), vanilla and with the pack
installed before or after the sharding, and writes ``OUT/rankN.json``: per case the loss, its
distance from the single-process reference, the gradients' distance (the whole gradient, gathered
from the shards), and the most bytes of vocabulary-sized tensors (logits) alive during the step.

Tensor parallelism (``tp_plan="auto"``) trains every rank on one batch (rank 0's): its cases compare
with the single-process step on that batch, vanilla's and the pack's (installed by hand after the load,
and planned by ``HF_PATCH_PACKS=chunked-loss``, here ``hfpatch_core.enabled(packs="chunked-loss")``),
then two steps of an optimizer.  5.3 keeps each rank's rows of a sharded weight as a plain tensor, and
their gradients too: each is compared with its block of the reference's.
"""

from __future__ import annotations

import json
import logging
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
    """The most bytes of tensors with a vocabulary-sized dimension (the whole vocabulary, or under tensor
    parallelism a rank's rows of it) and no hidden-sized one alive at once."""

    def __init__(self, vocab: int, hidden: int, local: int | None = None) -> None:
        super().__init__()
        self.vocab, self.hidden = {vocab, local or vocab}, hidden
        self.live: dict[int, tuple[weakref.ref[Any], int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (
                type(tensor) is torch.Tensor  # a DTensor's local tensor is counted as it is made
                and any(size in tensor.shape for size in self.vocab)
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


def reference_one(path: str, steps: int = 0) -> tuple[float, dict[str, torch.Tensor], list[float]]:
    """One process, vanilla, rank 0's batch (tensor parallelism's): the loss, the gradient, and the losses of
    ``steps`` optimizer steps after it."""
    model = load(path)
    ids, labels = batch(0, model.config.vocab_size)
    with torch.no_grad():
        items = float(model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(ITEMS)).loss)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return float(loss), grads, [items, *train(model, steps)]


def items_and_bad_label(model: Any) -> tuple[float, str | None]:
    """The loss of rank 0's batch divided by ``ITEMS`` (Trainer's ``num_items_in_batch``), and the error a
    label outside the vocabulary raises (on every rank alike: no rank may wait in a collective)."""
    ids, labels = batch(0, model.config.vocab_size)
    items = float(model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(ITEMS)).loss)
    wrong = labels.clone()
    wrong[1, 5] = model.config.vocab_size + 3
    try:
        model(input_ids=ids, labels=wrong)
    except IndexError as exc:
        return items, str(exc)
    return items, None


def train(model: Any, steps: int) -> list[float]:
    """The losses of ``steps`` SGD steps on rank 0's batch (after a first backward already run)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, labels = batch(0, model.config.vocab_size)
    losses = []
    for _ in range(steps):
        optimizer.step()
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(float(loss))
    return losses


def shard(model: Any) -> None:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def step(model: Any, rank: int = RANK, split: bool = False) -> dict[str, Any]:
    """One training step on ``rank``'s batch; ``split``: the head's rows are split over the ranks (tensor
    parallelism), whose logits tensors are a rank's rows wide."""
    config = model.config
    ids, labels = batch(rank, config.vocab_size)
    weight = model.lm_head.weight
    local = int((weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]) if split else None
    with LiveLogits(config.vocab_size, config.hidden_size, local) as mode:
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


def installed_then_head_own_unit(model: Any) -> Any:
    """Installed, then sharded with the head a unit of its own (as a wrapping policy may shard it): the
    step finds the head still sharded when the decoder has returned, and runs vanilla's."""
    chunked.install(model, chunk=CHUNK)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    return model


class Warnings(logging.Handler):
    """The messages of the warnings logged on the ``hfpatch`` logger while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def transformers_fsdp(path: str, install: bool) -> Any:
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=2)
    )
    model.train()
    if install:
        chunked.install(model, chunk=CHUNK)
    return model


def transformers_tp(path: str, how: str, head_rows: bool = False) -> Any:
    """A ``tp_plan="auto"`` load: vanilla, the pack installed by hand after it, or planned by the selection.

    ``head_rows``: the model's plan with the head's rule given explicitly (5.3's ``post_init`` drops the
    class's own ``{"lm_head": "colwise_gather_output"}``, so its "auto" keeps the head whole; given in the
    plan, 5.3 splits its rows too, as plain tensors, and 5.25 as "auto" does)."""
    import hfpatch_core

    plan: Any = "auto"
    if head_rows:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        layers = {f"model.{name}": style for name, style in (config.base_model_tp_plan or {}).items()}
        plan = {**layers, "lm_head": "colwise_gather_output"}

    # planned with a budget of a few tokens' logits per rank, which the step's peak is checked against
    os.environ[chunked.BUDGET_ENV] = str(TP_BUDGET) if how == "planned" else ""
    try:
        with hfpatch_core.enabled(packs="chunked-loss" if how == "planned" else "none"):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan=plan)
    finally:
        del os.environ[chunked.BUDGET_ENV]
    model.train()
    if how == "installed":
        try:
            chunked.install(model, chunk=CHUNK)
        except chunked.ChunkedLossRefused as exc:
            model.refusal = str(exc)
    return model


def tp_sharded_head(path: str, placement: str) -> Any:
    """A head a user shards otherwise after a TP load (columns, or rows over a 2-D mesh): refused."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    model.train()
    head = model.lm_head
    # 5.3's tensor parallelism keeps a plain tensor of each rank's rows: no DTensor placement to change
    model.sharded_by_hand = {"refusal": None, "dtensor": type(head.weight).__name__ == "DTensor"}
    if not model.sharded_by_hand["dtensor"]:
        return model
    whole = head.weight.full_tensor().detach()
    if placement == "columns":
        mesh, placements = head.weight.device_mesh, [Shard(1)]
    else:
        mesh, placements = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")), [Shard(0), Shard(0)]
    head.weight = torch.nn.Parameter(distribute_tensor(whole, mesh, placements))
    try:
        chunked.install(model, chunk=CHUNK)
    except chunked.ChunkedLossRefused as exc:
        model.sharded_by_hand["refusal"] = str(exc)
    return model


def local_block(full: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The block of ``full`` a rank holds as ``local`` (5.3's plain shards: ceil(n / world) a rank)."""
    for dim, (whole, held) in enumerate(zip(full.shape, local.shape, strict=True)):
        if whole != held:
            block = -(-whole // world)
            return full.narrow(dim, rank * block, held)
    return full


CASES: dict[str, Callable[[Any], Any]] = {
    "vanilla": vanilla_sharded,
    "installed-then-sharded": installed_then_sharded,
    "sharded-then-installed": sharded_then_installed,
    "head-own-unit": head_own_unit,
    "installed-then-head-own-unit": installed_then_head_own_unit,
    "transformers-fsdp-vanilla": lambda path: transformers_fsdp(path, False),
    "transformers-fsdp": lambda path: transformers_fsdp(path, True),
}

TP_CASES: dict[str, Callable[[Any], Any]] = {
    "tp-vanilla": lambda path: transformers_tp(path, "vanilla"),
    "tp-installed": lambda path: transformers_tp(path, "installed"),
    "tp-planned": lambda path: transformers_tp(path, "planned"),
    "tp-rows-vanilla": lambda path: transformers_tp(path, "vanilla", head_rows=True),
    "tp-rows-installed": lambda path: transformers_tp(path, "installed", head_rows=True),
    "tp-head-columns": lambda path: tp_sharded_head(path, "columns"),
    "tp-head-2d-mesh": lambda path: tp_sharded_head(path, "2d"),
}
TP_BUDGET = 10 * 2**10  # bytes: 6 tokens of a rank's 256 rows of float32 logits, with the last position's
TP_STEPS = 2
ITEMS = 7  # a num_items_in_batch other than the batch's count of labels (21)  # optimizer steps after the compared one


def tp_case(model: Any, loss: float, expected: dict[str, torch.Tensor], steps: int) -> dict[str, Any]:
    """A tensor-parallel model's step on rank 0's batch against the one-process one, then ``steps`` SGD steps."""
    world = dist.get_world_size()
    result = step(model, rank=0, split=True)
    grads = result.pop("grads")
    result["grad_error"] = {
        n: float((g - local_block(expected[n], g, RANK, world)).abs().max()) for n, g in grads.items()
    }
    result["grad_scale"] = {n: float(g.abs().max()) for n, g in expected.items()}
    result["wrong_error"] = {n: float((expected[n] * 1.001 - expected[n]).abs().max()) for n in expected}
    result["loss_error"] = abs(result["loss"] - loss)
    result["installed"] = chunked.installed(model) is not None
    result["refusal"] = getattr(model, "refusal", None)
    result["head_type"] = type(model.lm_head.weight).__name__
    result["head_rows"] = int(getattr(model.lm_head.weight, "_local_tensor", model.lm_head.weight).shape[0])
    result["items_loss"], result["bad_label_error"] = items_and_bad_label(model)
    result["steps"] = train(model, steps)
    return result


def kernel_cases() -> dict[str, dict[str, float]]:
    """The vocabulary-parallel loss itself on rows split unevenly (515 = 258 + 257), with each transform and
    dtype: its loss and gradients (hidden states; this rank's rows of the head) and vanilla's one-process
    ones (``cross_entropy`` over the whole head's transformed logits, autograd in the dtype), each measured
    against float64's."""
    from hfpatch_pack_chunked_loss.loss import HeadTransform
    from hfpatch_pack_chunked_loss.vocab_parallel import RowSplit, causal_lm_loss

    world = dist.get_world_size()
    split = RowSplit(dist.group.WORLD, RANK, world)
    vocab, hidden_size = 515, 32
    block = -(-vocab // world)
    rows = slice(RANK * block, min(vocab, (RANK + 1) * block))
    generator = torch.Generator().manual_seed(7)
    hidden64 = torch.randn(2, 9, hidden_size, generator=generator, dtype=torch.float64)
    weight64 = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64) / 4
    labels = torch.randint(0, vocab, (2, 9), generator=generator)
    labels[0, 2] = -100
    labels[1, 1] = block + 1  # one label in each rank's rows at least
    labels[1, 3] = 3
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, transform in {
            "plain": HeadTransform(),
            "scale": HeadTransform(scale=0.25),
            "softcap": HeadTransform(softcap=3.0),
        }.items():
            computed = {}
            for side in ("float64", "vanilla", "ours"):
                kind = torch.float64 if side == "float64" else dtype
                hidden = hidden64.to(kind).requires_grad_(True)
                weight = weight64.to(kind).requires_grad_(True)
                if side == "ours":
                    local = weight[rows]
                    loss = causal_lm_loss(hidden, _Rows(local), labels, transform, split=split, chunk=4)
                    grad_hidden, grad_rows = torch.autograd.grad(loss, [hidden, local])
                else:
                    logits = transform(torch.nn.functional.linear(hidden, weight)).float()
                    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), shifted.reshape(-1))
                    grad_hidden, grad_weight = torch.autograd.grad(loss, [hidden, weight])
                    grad_rows = grad_weight[rows]
                computed[side] = [loss.double(), grad_hidden.double(), grad_rows.double()]
            for index, part in enumerate(("loss", "hidden", "head")):
                reference = computed["float64"][index]
                results[f"{dtype}-{name}-{part}"] = {
                    "ours": float((computed["ours"][index] - reference).abs().max()),
                    "vanilla": float((computed["vanilla"][index] - reference).abs().max()),
                    "scale": float(reference.abs().max()),
                    # the loss is float32 on both sides (ForCausalLMLoss upcasts the logits); gradients the dtype's
                    "eps": torch.finfo(torch.float32 if part == "loss" else dtype).eps,
                }
    return results


class _Rows:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.bias = weight, None


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
        said = Warnings()
        logging.getLogger("hfpatch").addHandler(said)
        try:
            result = step(model)
            ids, labels = batch(RANK, model.config.vocab_size)
            model(input_ids=ids, labels=labels)  # a second training forward of the same kind: said once
        finally:
            logging.getLogger("hfpatch").removeHandler(said)
        result["warnings"] = said.messages
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
    payload["kernel"] = kernel_cases()
    tp_loss, tp_expected, tp_losses = reference_one(path, TP_STEPS)
    payload["tp_reference_loss"] = tp_loss
    payload["tp_reference_items_loss"], *payload["tp_reference_steps"] = tp_losses
    for name, prepare in TP_CASES.items():
        torch.manual_seed(0)
        model = prepare(path)
        if name.startswith("tp-head-"):
            payload["cases"][name] = {"installed": chunked.installed(model) is not None, **model.sharded_by_hand}
        else:
            payload["cases"][name] = tp_case(model, tp_loss, tp_expected, TP_STEPS)
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
