"""Checking a pack under transformers' own sharded loads: ``torchrun`` with 2 ranks (gloo, CPU).

``verify_distributed(pack, checkpoint, ["tp", "fsdp", "ep"])`` starts one torchrun on this
machine (``launcher``); on each rank this module's ``main`` loads the checkpoint once on one process
(vanilla: the reference), then for each parallelism sharded as transformers does
(``tp_plan="auto"``, ``DistributedConfig(fsdp_size=2)``, ``DistributedConfig(ep_size=2,
tp_plan={})``), first without packs and then with the pack, and compares the logits and
greedy generation with the reference.  ``hfpatch verify --distributed tp,fsdp,ep`` prints
the result per pack, model type and parallelism.

Outcomes: ``applied`` (the pack replaced classes, results equal), ``refused`` (hfpatch
refused the pack's classes for that parallelism, see ``hfpatch_core._pipeline.parallel``, or
the pack refused on the plan everything it offered, such as a model step that does not run on
sharded weights; the model loaded vanilla, results equal), ``unavailable`` (the installed transformers has no
such load, or loads this model that way not even without packs), ``failed`` (an error, or
results that differ).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from .launcher import TorchrunFailed, rank_environment, run_rank, start_rank, torchrun, write_rank

#: The parallelisms ``verify_distributed`` knows, in the order it runs them.
MODES = ("tp", "fsdp", "ep")

#: The tolerance of the logits (float32) against the single-process reference.
ATOL = 1e-5


@dataclasses.dataclass(frozen=True)
class ModeReport:
    """One pack on one checkpoint under one parallelism, as every rank saw it.

    Attributes:
        pack: the pack's name.
        model_type: the checkpoint's model type (or its directory).
        mode: ``"tp"``, ``"fsdp"`` or ``"ep"``.
        outcome: ``"applied"``, ``"refused"``, ``"unavailable"`` or ``"failed"``.
        max_abs_diff: the largest logit difference from the reference, over the ranks.
        generation_match: greedy generation equal to the reference on every rank.
        replaced: target -> replacement class name, as the load's plan says.
        detail: the refusal, the reason it is unavailable, or the failure.
        experts: per rank, the experts each module cut for expert parallelism holds there (module
            path -> the numbers of its numbered children), as loaded with the pack; empty where no
            module was cut (the experts are whole, or sharded inside their parameters).
    """

    pack: str
    model_type: str
    mode: str
    outcome: str
    max_abs_diff: float | None = None
    generation_match: bool | None = None
    replaced: dict[str, str] = dataclasses.field(default_factory=dict)
    detail: str = ""
    experts: tuple[dict[str, list[int]], ...] = ()

    @property
    def ok(self) -> bool:
        """Not ``failed``: the pack works, or is refused cleanly, or there is nothing to check."""
        return self.outcome != "failed"

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values."""
        return {**dataclasses.asdict(self), "ok": self.ok}


def sharding_arguments(mode: str) -> dict[str, Any] | None:
    """The ``from_pretrained`` arguments of a sharded load on 2 ranks, or ``None`` where the
    installed transformers has no such load (5.3 has ``tp_plan`` only, among these)."""
    from transformers.distributed import DistributedConfig

    fields = getattr(DistributedConfig, "__dataclass_fields__", {})
    if mode == "tp":
        return {"tp_plan": "auto"}
    if mode == "fsdp" and "fsdp_size" in fields:
        return {"distributed_config": DistributedConfig(fsdp_size=2)}
    if mode == "ep" and "ep_size" in fields:
        return {"distributed_config": DistributedConfig(ep_size=2, tp_plan={})}
    return None


def verify_distributed(
    pack: str, checkpoint: str | os.PathLike[str], modes: Sequence[str], *, model_type: str = "", timeout: float = 600
) -> list[ModeReport]:
    """Run ``pack`` on ``checkpoint`` under each of ``modes`` on 2 ranks of this machine.

    Args:
        pack: the pack's name (installed, visible on ``sys.path``).
        checkpoint: a checkpoint directory.
        modes: some of ``MODES``.
        model_type: how reports name the checkpoint (default: its directory).
        timeout: seconds before the torchrun is stopped.

    Returns:
        One report per mode, in ``modes`` order.

    Raises:
        ValueError: a mode is not one of ``MODES``.
    """
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise ValueError(f"unknown parallelism {unknown[0]!r}: choose among {', '.join(MODES)}")
    name = model_type or str(checkpoint)
    try:
        seen = torchrun(
            __name__, [pack, str(checkpoint), ",".join(modes)], environment=rank_environment(), timeout=timeout
        )
    except TorchrunFailed as failed:
        return [ModeReport(pack, name, mode, "failed", detail=str(failed)) for mode in modes]
    return [_combine(pack, name, mode, [rank[mode] for rank in seen]) for mode in modes]


def _combine(pack: str, name: str, mode: str, ranks: list[dict[str, Any]]) -> ModeReport:
    diffs = [rank["max_abs_diff"] for rank in ranks if rank["max_abs_diff"] is not None]
    matches = [rank["generation_match"] for rank in ranks if rank["generation_match"] is not None]
    worst = max(diffs) if diffs else None
    outcomes = [rank["outcome"] for rank in ranks]
    outcome, detail = outcomes[0], ranks[0]["detail"]
    if len(set(outcomes)) > 1:
        outcome = "failed"
        detail = "the ranks disagree: " + ", ".join(f"rank {i} {found}" for i, found in enumerate(outcomes))
    elif outcome in ("applied", "refused") and ((worst or 0.0) > ATOL or not all(matches)):
        outcome, detail = "failed", f"results differ from one process (max abs diff {worst:.2e})"
    held = tuple(rank.get("experts", {}) for rank in ranks)
    return ModeReport(
        pack, name, mode, outcome, worst, all(matches) if matches else None, ranks[0]["replaced"], detail, held
    )


# --- one rank ------------------------------------------------------------------------------


def _run_mode(pack: str, checkpoint: str, mode: str, reference: tuple[Any, list[list[int]]]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    import hfpatch_core
    from hfpatch_core.errors import PackWarning

    result: dict[str, Any] = {"outcome": "failed", "max_abs_diff": None, "generation_match": None}
    result.update(replaced={}, detail="")
    arguments = sharding_arguments(mode)
    if arguments is None:
        return {**result, "outcome": "unavailable", "detail": "the installed transformers has no such load"}
    try:
        with hfpatch_core.enabled(packs="none"):
            AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **arguments)
    except Exception as exc:
        return {**result, "outcome": "unavailable", "detail": f"vanilla: {type(exc).__name__}: {exc}"[:500]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PackWarning)
        try:
            with hfpatch_core.enabled(packs=pack):
                model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **arguments)
            logits, tokens = _outputs(model)
        except Exception as exc:
            return {**result, "detail": f"{type(exc).__name__}: {exc}"[:2000]}
    plan = hfpatch_core.plan_of(model)
    result["replaced"] = {claim.target: claim.patch.replacement.__name__ for claim in plan.entries} if plan else {}
    result["experts"] = _held_experts(model)
    result["max_abs_diff"] = float((logits - reference[0]).abs().max())
    result["generation_match"] = tokens == reference[1]
    refusals = [str(w.message) for w in caught if issubclass(w.category, PackWarning)]
    refused = [message for message in refusals if "Refused before any weight was read" in message]
    # a pack that refused everything it offered on the plan (a model step refused for the sharded load)
    own = [refusal.describe() for refusal in plan.refused if refusal.pack == pack] if plan else []
    if not refused and own and plan is not None and not (plan.entries or plan.installed_steps):
        refused = own
    result["outcome"] = "refused" if refused else "applied"
    result["detail"] = "\n".join(refused or refusals)
    return result


def _held_experts(model: Any) -> dict[str, list[int]]:
    """Per module cut for expert parallelism (marked ``_is_expert_parallel``, as transformers marks the
    experts it shards), the numbers of the children it holds on this rank; modules without numbered
    children (3-D experts, sharded inside their parameters) are not listed."""
    held = {}
    for name, module in model.named_modules():
        if getattr(module, "_is_expert_parallel", False) is not True:
            continue
        numbers = [int(child) for child, _ in module.named_children() if child.isdigit()]
        if numbers:
            held[name] = numbers
    return held


def _outputs(model: Any) -> tuple[Any, list[list[int]]]:
    import torch

    ids = torch.randint(
        3, int(model.config.get_text_config().vocab_size), (2, 10), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    full = getattr(logits, "full_tensor", None)
    return (full() if full is not None else logits).float(), [
        list(map(int, row)) for row in generated[:, ids.shape[1] :]
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """One rank of ``verify_distributed``: ``PACK CHECKPOINT MODES OUT`` (``MODES`` comma-separated)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    pack, checkpoint, modes, out = argv if argv is not None else sys.argv[1:]
    start_rank()
    dist.init_process_group("gloo")
    import hfpatch_core

    with hfpatch_core.enabled(packs="none"):  # the reference, also where hfpatch run enabled packs
        reference = _outputs(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32))
    results = {}
    for mode in modes.split(","):
        results[mode] = _run_mode(pack, checkpoint, mode, reference)
        dist.barrier()  # every rank runs every mode, failed or not: none waits alone in a collective
    write_rank(out, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(main)
