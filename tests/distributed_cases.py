"""Cases run under ``torchrun --nproc_per_node 2`` (gloo, CPU) by ``test_distributed.py``.

``python -m torch.distributed.run --nproc_per_node 2 distributed_cases.py GROUP OUT LLAMA QWEN_MOE``
runs every case of GROUP on each rank and writes ``OUT/rank<N>.json``: case name ->
what that rank saw (the largest logit difference from a single-process vanilla load,
the classes the load replaced, the warnings, the error).  One process group for all the
cases of a group: starting torchrun costs more than a tiny model's load.

Groups:

* ``load``: transformers' own sharded loads (``tp_plan="auto"``, ``DistributedConfig``
  with ``fsdp_size`` / ``ep_size``), vanilla and with packs;
* ``train``: started by ``hfpatch run -- torchrun``, so hfpatch is enabled by the
  start-up hook with ``HF_PATCH_PACKS``; DDP training steps and FSDP2 applied after a
  normal load.

A case that raises is recorded (type and message), never fatal: every rank runs every
case, so a rank never waits in a collective that the other skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM

import hfpatch_core
from hfpatch_core.errors import HfPatchError, PackWarning
from hfpatch_core.plan import plan_of

RANK = int(os.environ.get("RANK", "0"))
IDS = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(0))


def has_field(name: str) -> bool:
    """Whether the installed ``DistributedConfig`` has field ``name`` (5.3: no sizes, ``enable_expert_parallel``)."""
    from transformers.distributed import DistributedConfig

    return name in getattr(DistributedConfig, "__dataclass_fields__", {})


def sharding(mode: str) -> dict[str, Any]:
    """The ``from_pretrained`` arguments of a sharded load, as the installed release spells them."""
    from transformers.distributed import DistributedConfig

    if mode == "tp":
        return {"tp_plan": "auto"}
    if mode == "fsdp":
        return {"distributed_config": DistributedConfig(fsdp_size=2)}
    if mode == "ep" and has_field("ep_size"):
        return {"distributed_config": DistributedConfig(ep_size=2, tp_plan={})}
    if mode == "ep":
        return {"distributed_config": DistributedConfig(enable_expert_parallel=True)}
    if mode == "tp+ep":  # attention tensor-parallel, experts expert-parallel, on the same 2 ranks
        return {"distributed_config": DistributedConfig(tp_size=2, ep_size=2)}
    raise ValueError(mode)


def modes() -> list[str]:
    """The sharded loads the installed transformers has and can load a vanilla model with.

    5.3's ``DistributedConfig(enable_expert_parallel=True)`` exists but fails on a vanilla
    qwen2_moe in transformers' own loader (``KeyError: 'model.layers.*.self_attn.k_proj'``):
    expert parallelism is tested where ``DistributedConfig`` has ``ep_size`` (5.25).  The
    strict-mode case still runs it on 5.3: the refusal comes before the loader reads a weight.
    """
    return ["tp", *(["ep"] if has_field("ep_size") else []), *(["fsdp"] if has_field("fsdp_size") else [])]


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        output = model(input_ids=IDS).logits
    local = getattr(output, "full_tensor", None)
    return (local() if local is not None else output).float()


def greedy(model: Any) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=4, do_sample=False)
    return [list(map(int, row)) for row in out[:, IDS.shape[1] :]]


@dataclasses.dataclass
class Result:
    """What one rank saw in one case."""

    error: str | None = None
    max_diff: float | None = None
    greedy_equal: bool | None = None
    replaced: dict[str, str] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def run_case(body: Callable[[Result], None]) -> Result:
    result = Result()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PackWarning)
        try:
            body(result)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, HfPatchError):
                result.extra["traceback"] = traceback.format_exc()[-2000:]
    result.warnings = [str(w.message) for w in caught if issubclass(w.category, PackWarning)]
    return result


def replaced_of(model: Any) -> dict[str, str]:
    plan = plan_of(model)
    return {claim.target: claim.patch.replacement.__name__ for claim in plan.entries} if plan else {}


# --- load ------------------------------------------------------------------------------


def load_group(checkpoints: dict[str, str]) -> dict[str, Result]:
    reference: dict[str, tuple[torch.Tensor, list[list[int]]]] = {}
    for name, path in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # hfpatch is not enabled yet
        reference[name] = (logits(model), greedy(model))
    results: dict[str, Result] = {}

    def sharded(
        name: str,
        mode: str,
        packs: str,
        *,
        strict: bool = False,
        check: Callable[..., None] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        def body(result: Result) -> None:
            with hfpatch_core.enabled(packs=packs, strict=strict), counted_all_gathers(result):
                model = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=dtype, **sharding(mode))
            result.replaced = replaced_of(model)
            found = logits(model)
            expected, tokens = reference[name]
            result.max_diff = float((found - expected).abs().max())
            result.greedy_equal = greedy(model) == tokens
            if check is not None:
                check(model, result)

        return body

    cases: list[tuple[str, Callable[[Result], None]]] = []
    for mode in modes():
        fused = fsdp_cut if mode == "fsdp" else local_rows
        if mode != "ep":
            cases.append((f"llama/{mode}/vanilla", sharded("llama", mode, "none")))
            cases.append((f"llama/{mode}/subclass", sharded("llama", mode, "subclass")))
            cases.append((f"llama/{mode}/fused-dense", sharded("llama", mode, "fused-dense", check=fused)))
        cases.append((f"qwen2_moe/{mode}/vanilla", sharded("qwen2_moe", mode, "none", check=local_rows)))
        if mode != "ep":  # under expert parallelism: expert_parallel_cases
            cases.append((f"qwen2_moe/{mode}/qwen-moe", sharded("qwen2_moe", mode, "qwen-moe", check=fused)))
        if mode == "tp":  # per-head q/k norms (qwen3), and on a MoE the attention and the shared expert's MLP
            cases.append(("qwen3/tp/fused-dense", sharded("qwen3", mode, "fused-dense", check=local_rows)))
            cases.append(("qwen2_moe/tp/fused-dense", sharded("qwen2_moe", mode, "fused-dense", check=local_rows)))
        if mode != "fsdp":
            cases.append((f"qwen2_moe/{mode}/moe-replay", sharded("qwen2_moe", mode, "moe-replay", check=replays)))
    if "fsdp" in modes():
        cases.extend(fsdp_cases(sharded))
    cases.extend(expert_parallel_cases(sharded))
    cases.extend(more_families_cases(sharded))
    if "ep" in modes():  # a sigmoid + correction-bias, group-limited router beyond qwen2_moe's softmax
        check = replays_as_one_process
        cases.append(("deepseek_v3/ep/moe-replay", sharded("deepseek_v3", "ep", "moe-replay", check=check)))
    for name, body in cases:
        results[name] = run_case(body)
        dist.barrier()
    return results


@contextlib.contextmanager
def counted_all_gathers(result: Result) -> Iterator[None]:
    """Count the ``all_gather_into_tensor`` calls of a load (``extra["load_all_gathers"]``), calling through.

    Under FSDP2 a fused tensor is cut from the whole parts in the memory-mapped checkpoint
    (no gather); parts read as copies (a cast to another dtype) are gathered instead."""
    original = dist.all_gather_into_tensor
    calls = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_gather_into_tensor = counting
    try:
        yield
    finally:
        dist.all_gather_into_tensor = original
        result.extra["load_all_gathers"] = len(calls)


def local_rows(model: Any, result: Result) -> None:
    """The rows this rank holds of each projection of layer 0 (its shard, under tensor parallelism),
    and what ``save_pretrained`` does (a sharded model with converted weights refuses, on every rank)."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        try:
            model.save_pretrained(directory)
            result.extra["save"] = "saved"
        except HfPatchError as exc:
            result.extra["save"] = f"{type(exc).__name__}: {exc}"
    layer = model.model.layers[0]
    for name, parameter in layer.named_parameters():
        if name.endswith("proj.weight") and ".experts." not in name:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            result.extra[f"rows:{name}"] = int(local.shape[0])


def fsdp_cases(sharded: Callable[..., Callable[[Result], None]]) -> list[tuple[str, Callable[[Result], None]]]:
    """FSDP2 beyond the per-mode cases: qwen3's per-head norms, an MLP whose gate and up do not halve
    (intermediate size 75: shares of 38 and 37 rows), a load cast to float64 (each share read as a copy, so
    gathered), and a pack that declares no plan."""
    return [
        ("qwen3/fsdp/fused-dense", sharded("qwen3", "fsdp", "fused-dense", check=fsdp_cut)),
        (
            "llama/fsdp/fused-dense/float64",
            sharded("llama", "fsdp", "fused-dense", check=fsdp_cut, dtype=torch.float64),
        ),
        ("llama_uneven/fsdp/fused-dense", sharded("llama_uneven", "fsdp", "fused-dense", check=fsdp_cut)),
        ("llama/fsdp/undeclared", sharded("llama", "fsdp", "undeclared")),
        ("llama/fsdp/undeclared/strict", sharded("llama", "fsdp", "undeclared", strict=True)),
    ]


def fsdp_cut(model: Any, result: Result) -> None:
    """Under FSDP2: whether this rank holds its contiguous cut of each fused tensor of layer 0 (rank 0 of
    two: all of q), and what ``save_pretrained`` wrote: the original layout, which reloads vanilla."""
    from safetensors.torch import load_file

    path = model.config._name_or_path
    checkpoint = load_file(f"{path}/model.safetensors")
    layer = model.model.layers[0]
    fusions = {"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")}
    for name, parts in fusions.items():
        try:
            local = layer.get_parameter(name).to_local()
        except AttributeError:  # qwen-moe fuses the attention only
            continue
        prefix = f"model.layers.0.{name.split('.')[0]}"
        whole = torch.cat([checkpoint[f"{prefix}.{part}_proj.weight"] for part in parts]).to(local.dtype)
        offset = RANK * -(-whole.shape[0] // dist.get_world_size())
        result.extra[f"rows:{name}"] = int(local.shape[0])
        result.extra[f"cut:{name}"] = bool(torch.equal(local, whole[offset : offset + local.shape[0]]))
    shared: list[Any] = [tempfile.mkdtemp(prefix="hfpatch-fsdp-save-") if RANK == 0 else None]
    dist.broadcast_object_list(shared)  # one directory: rank 0 writes what every rank gathers
    directory = shared[0]
    model.save_pretrained(directory)
    dist.barrier()
    saved = load_file(f"{directory}/model.safetensors")
    result.extra["saved_fused"] = sorted(key for key in saved if "qkv_proj" in key or "gate_up_proj" in key)
    result.extra["saved_q_proj"] = "model.layers.0.self_attn.q_proj.weight" in saved
    with hfpatch_core.enabled(packs="none"):
        reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    result.extra["reloaded_diff"] = float((logits(reloaded) - logits(original)).abs().max())
    dist.barrier()
    if RANK == 0:
        shutil.rmtree(directory, ignore_errors=True)


def replays(model: Any, result: Result) -> None:
    """Routes recorded on this rank replay to the same logits (moe-replay's promise, per rank)."""
    from hfpatch_pack_moe_replay import record_routing, replay_routing

    with torch.no_grad(), record_routing(model) as recording:
        live = logits(model)
    routing = recording.routing
    with torch.no_grad(), replay_routing(model, routing):
        replayed = logits(model)
    # the routes as every rank recorded them: the router is replicated, so all ranks agree
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [layer.tolist() for layer in routing.layers])
    result.extra["replay_diff"] = float((replayed - live).abs().max())
    result.extra["routes_agree"] = all(other == gathered[0] for other in gathered)
    result.extra["routed_layers"] = len(routing.layers)


def replays_as_one_process(model: Any, result: Result) -> None:
    """Routes recorded under expert parallelism, replayed after the routers moved: on this rank the
    replay takes the recorded routes (the live routers no longer would), and its logits are those of
    one process replaying the same routes on the same moved routers."""
    from hfpatch_pack_moe_replay import record_routing, replay_routing, routers_of

    with hfpatch_core.enabled(packs="moe-replay"):
        single = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, dtype=torch.float32)
    with torch.no_grad(), record_routing(model) as recording:
        logits(model)
    routing = recording.routing
    for each in (model, single):  # the same moved routers on every rank and in the single process
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _, router in routers_of(each):
                router.weight.add_(torch.randn(router.weight.shape, generator=generator) * 0.5)
    with torch.no_grad(), record_routing(model) as live:
        logits(model)
    with torch.no_grad(), replay_routing(model, routing), record_routing(model) as replayed:
        found = logits(model)
    with torch.no_grad(), replay_routing(single, routing):
        expected = logits(single)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [layer.tolist() for layer in routing.layers])
    result.extra["routes_agree"] = all(other == gathered[0] for other in gathered)
    result.extra["routed_layers"] = len(routing.layers)
    result.extra["num_experts"] = int(model.model.layers[0].mlp.experts.num_experts)  # this rank's share
    result.extra["live_differs"] = live.routing != routing
    result.extra["replayed_as_recorded"] = replayed.routing == routing
    result.extra["single_replay_diff"] = float((found - expected).abs().max())


# --- expert parallelism (qwen-moe's experts cut per rank, fused-dense on a MoE) ------------


Case = tuple[str, Callable[[Result], None]]


def expert_parallel_cases(sharded: Callable[..., Callable[[Result], None]]) -> list[Case]:
    """qwen-moe and fused-dense under expert parallelism where the installed release has it;
    on 5.3 (``enable_expert_parallel``, on which transformers fails even vanilla) the strict
    qwen-moe load, which hfpatch refuses before the loader reads a weight."""
    if "ep" not in modes():
        return [("qwen2_moe/ep/qwen-moe/strict", sharded("qwen2_moe", "ep", "qwen-moe", strict=True))]
    return [
        ("qwen2_moe/ep/qwen-moe", sharded("qwen2_moe", "ep", "qwen-moe", check=expert_share)),
        ("qwen2_moe/ep/fused-dense", sharded("qwen2_moe", "ep", "fused-dense", check=local_rows)),
        ("qwen2_moe/tp+ep/qwen-moe", sharded("qwen2_moe", "tp+ep", "qwen-moe", check=experts_held)),
    ]


def experts_held(model: Any, result: Result) -> None:
    """The rows of layer 0's projections, what saving does, and the experts this rank holds."""
    local_rows(model, result)
    experts = model.model.layers[0].mlp.experts
    result.extra["experts"] = [name for name, _ in experts.named_children()]
    result.extra["num_experts"] = int(experts.num_experts)


def expert_share(model: Any, result: Result) -> None:
    """The experts this rank holds, what saving does, and one training step against one process.

    With gradients flowing transformers dispatches the tokens to the experts' ranks with
    all-to-all (at inference, each rank runs its experts on the whole batch and the outputs
    are summed): the loss, the embedding's gradient and the gradient of each expert this
    rank holds must equal a single-process vanilla load's.
    """
    experts_held(model, result)
    experts = model.model.layers[0].mlp.experts
    with hfpatch_core.enabled(packs="none"):
        vanilla = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, dtype=torch.float32)
    found, expected = (each(input_ids=IDS, labels=IDS).loss for each in (model, vanilla))
    found.backward()
    expected.backward()
    result.extra["train_loss_diff"] = abs(float(found) - float(expected))
    embedding = model.model.embed_tokens.weight.grad - vanilla.model.embed_tokens.weight.grad
    result.extra["embedding_grad_diff"] = float(embedding.abs().max())
    stacked = vanilla.model.layers[0].mlp.experts.gate_up_proj.grad  # [experts, gate rows then up rows, hidden]
    result.extra["expert_grad_diff"] = max(
        float((torch.cat([expert.gate_proj.weight.grad, expert.up_proj.weight.grad]) - stacked[int(name)]).abs().max())
        for name, expert in experts.named_children()
    )


# --- mistral and qwen2 under tensor parallelism ---------------------------------------------


def more_families_cases(sharded: Callable[..., Callable[[Result], None]]) -> list[Case]:
    """fused-dense on the other grouped-query families it covers (mistral: llama's layout with a
    sliding window from the config; qwen2: q/k/v biases), under tensor parallelism and FSDP2;
    qwen-moe on qwen3_moe (per-head q/k norms, 4 experts) in every mode the release has."""
    cases = [
        (f"{family}/tp/fused-dense", sharded(family, "tp", "fused-dense", check=local_rows)) for family in FAMILIES
    ]
    checks = {"tp": local_rows, "fsdp": fsdp_cut, "ep": experts_held}
    if "fsdp" in modes():
        cases += [
            (f"{family}/fsdp/fused-dense", sharded(family, "fsdp", "fused-dense", check=fsdp_cut))
            for family in FAMILIES
        ]
    cases += [
        (f"qwen3_moe/{mode}/qwen-moe", sharded("qwen3_moe", mode, "qwen-moe", check=checks[mode])) for mode in modes()
    ]
    return cases


#: The families fused-dense covers besides llama and qwen3, with grouped-query attention.
FAMILIES = ("mistral", "qwen2")


# --- train (under hfpatch run) -----------------------------------------------------------


def train_group(checkpoints: dict[str, str]) -> dict[str, Result]:
    return {
        "ddp": run_case(lambda result: ddp(checkpoints["llama"], result)),
        "fsdp2-after-load": run_case(lambda result: fsdp2_after_load(checkpoints["llama"], result)),
    }


def ddp(path: str, result: Result) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    plan = plan_of(model)
    result.replaced = replaced_of(model)
    fingerprints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(fingerprints, plan.fingerprint if plan else None)
    result.extra["fingerprints"] = fingerprints
    wrapped = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(100 + RANK))  # each rank its batch
    for _ in range(3):
        optimizer.zero_grad()
        wrapped(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    result.extra["max_param_diff_from_rank0"] = float((flat - first).abs().max())
    result.extra["moved"] = float((flat - torch.cat([p.reshape(-1) for p in _fresh(path).parameters()])).abs().max())


def _fresh(path: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def fsdp2_after_load(path: str, result: Result) -> None:
    """fully_shard on each decoder layer, then the model, as accelerate does: loss equal to vanilla."""
    from torch.distributed.fsdp import fully_shard

    def sharded_loss(model: Any) -> tuple[float, float]:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        first = model(input_ids=IDS, labels=IDS).loss
        first.backward()
        optimizer.step()
        second = model(input_ids=IDS, labels=IDS).loss
        return float(first), float(second)

    patched = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    result.replaced = replaced_of(patched)
    with hfpatch_core.enabled(packs="none"):
        vanilla = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    found, expected = sharded_loss(patched), sharded_loss(vanilla)
    result.extra["losses"] = [found, expected]
    result.max_diff = max(abs(a - b) for a, b in zip(found, expected, strict=True))


def main() -> None:
    group, out = sys.argv[1], Path(sys.argv[2])
    checkpoints = json.loads(sys.argv[3])
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo")
    try:
        results = {"load": load_group, "train": train_group}[group](checkpoints)
    finally:
        dist.barrier()
    payload = {
        "rank": RANK,
        "transformers": transformers.__version__,
        "enabled_by_autorun": hfpatch_core.is_enabled() if group == "train" else None,
        "cases": {name: dataclasses.asdict(result) for name, result in results.items()},
    }
    (out / f"rank{RANK}.json").write_text(json.dumps(payload, indent=1))
    dist.destroy_process_group()
    # The results are written.  Skip the interpreter's finalization: there, gloo's worker threads
    # can still hold the async work of DDP / FSDP2 collectives, whose tensors then need the GIL of
    # a dying interpreter, and the rank aborts ("terminate called without an active exception",
    # SIGABRT) after its work is done (seen twice in CI on the train group; torch's proposed fix,
    # an atexit destroy, was abandoned: pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
