"""linear-experts under transformers' own sharded loads, for real: one ``torchrun`` (2 ranks, gloo, CPU) per family.

``verify_distributed`` loads each checkpoint on one process (the reference), then sharded
by tensor parallelism (``tp_plan="auto"``), FSDP2 (``DistributedConfig(fsdp_size=2)``) and
expert parallelism (``DistributedConfig(ep_size=2, tp_plan={})``), vanilla and with the
pack, and compares logits and greedy generation.  Two families beyond Qwen whose
checkpoints are per-expert: mixtral (``w1``/``w3``/``w2``; transformers 5.3's plan shards
its experts by tensor parallelism) and deepseek_v3 (shared experts beside the routed ones,
sigmoid group routing, a dense first layer).

What the installed transformers has: 5.3 loads with ``tp_plan`` only among these (the others
are ``unavailable``); 5.25 has all three.  Where the model's plan shards the 3-D experts
(5.3's tensor-parallel plans of both families) the per-expert linears shard the same way;
where it does not they stay whole; under expert parallelism each rank holds its own half
of the experts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hfpatch_pack_linear_experts import discover
from hfpatch_pack_linear_experts.experts import is_declared_experts

from hfpatch_core.testing import tiny_checkpoint
from hfpatch_core.testing.distributed import ATOL, ModeReport, verify_distributed

MODES = ("tp", "fsdp", "ep")
#: every routed experts module of these tiny checkpoints holds this many experts (2 per rank)
EXPERTS = 4


FAMILIES = ("mixtral", "deepseek_v3")


def has_load(mode: str) -> bool:
    """Whether the installed transformers loads sharded by ``mode`` (5.3: ``tp_plan`` only, no
    ``DistributedConfig(fsdp_size=..., ep_size=...)``)."""
    from transformers.distributed import DistributedConfig

    field = {"fsdp": "fsdp_size", "ep": "ep_size"}.get(mode)
    return field is None or field in getattr(DistributedConfig, "__dataclass_fields__", {})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    overrides = {"mixtral": {"num_local_experts": EXPERTS}, "deepseek_v3": {"n_routed_experts": EXPERTS}}
    return {
        family: tiny_checkpoint(family, tmp_path_factory.mktemp(family), **overrides[family]) for family in FAMILIES
    }


@pytest.fixture(scope="module")
def routed(checkpoints: dict[str, Path]) -> dict[str, list[str]]:
    """Per family, the paths of its routed experts modules (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    paths = {}
    for family, checkpoint in checkpoints.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
        paths[family] = sorted(name for name, module in model.named_modules() if is_declared_experts(type(module)))
        assert paths[family], family
    return paths


@pytest.fixture(scope="module", params=FAMILIES)
def reports(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> tuple[str, dict[str, ModeReport]]:
    """One torchrun per family, every parallelism in it."""
    family: str = request.param
    found = verify_distributed("linear-experts", checkpoints[family], list(MODES), model_type=family)
    return family, {report.mode: report for report in found}


def test_every_mode_applies_exactly_or_is_unavailable(reports: tuple[str, dict[str, ModeReport]]) -> None:
    family, by_mode = reports
    for mode in MODES:
        report = by_mode[mode]
        if not has_load(mode):
            # 5.3: no such load; verify says so instead of running it
            assert (report.outcome, report.detail) == ("unavailable", "the installed transformers has no such load")
            continue
        assert report.outcome == "applied", report
        assert report.max_abs_diff is not None and report.max_abs_diff <= ATOL, report
        assert report.generation_match is True, report
        replaced = set(report.replaced.values())
        assert replaced and all(name.startswith("Linear") for name in replaced), (family, mode, report.replaced)


def test_expert_parallel_ranks_hold_only_their_experts(
    reports: tuple[str, dict[str, ModeReport]], routed: dict[str, list[str]]
) -> None:
    family, by_mode = reports
    report = by_mode["ep"]
    if not has_load("ep"):
        pytest.skip("this transformers release has no DistributedConfig(ep_size=...): no expert-parallel load to check")
    assert report.outcome == "applied", report
    first, second = report.experts
    assert sorted(first) == sorted(second) == routed[family], report.experts  # every routed experts module, cut
    for path in first:
        assert first[path] == [0, 1] and second[path] == [2, 3], (path, report.experts)


def test_tensor_and_fsdp_keep_every_expert_on_every_rank(reports: tuple[str, dict[str, ModeReport]]) -> None:
    """Tensor parallelism and FSDP2 cut inside each expert's linears (or not at all), never the experts."""
    _, by_mode = reports
    for mode in ("tp", "fsdp"):
        if by_mode[mode].outcome == "applied":
            assert by_mode[mode].experts == ({}, {}), by_mode[mode]


def test_tensor_parallel_plan_follows_the_models_plan(checkpoints: dict[str, Path]) -> None:
    """The per-expert linears declare colwise gate/up and rowwise down exactly where the model's plan
    shards the 3-D experts (transformers 5.3's mixtral), and nothing (whole experts) where it does not."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoints["mixtral"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shards = any(key.startswith("model.layers.*.mlp.experts.") for key in model._tp_plan)
    (candidate,) = discover(config, "mixtral").candidates
    replacement = candidate.replacement
    if shards:
        assert replacement.hfpatch_tp_plan == {
            "*.w1.weight": "colwise",
            "*.w3.weight": "colwise",
            "*.w2.weight": "rowwise",
        }
    else:
        assert replacement.hfpatch_tp_plan == {}
    assert replacement.hfpatch_fsdp_plan == {}
    assert replacement.hfpatch_ep_plan == ({"*": "local_experts"} if model._ep_plan else {})
    assert replacement.hfpatch_unsharded_reasons == {}


def test_experts_stored_3d_are_refused_where_the_split_cannot_be_cut_per_rank() -> None:
    """gpt_oss stores its experts 3-D (split at load by the pack's converters): the split reads each 3-D
    tensor whole, so where a sharded load gives each rank part of the experts, the class declares no
    plan and says why (hfpatch core then refuses it before any weight is read, quoting the reason)."""
    from conftest import gpt_oss

    config = gpt_oss()
    (candidate,) = discover(config, "gpt_oss").candidates
    assert candidate.stored_3d
    replacement = candidate.replacement
    reasons = replacement.hfpatch_unsharded_reasons
    assert replacement.hfpatch_fsdp_plan is None and "stores the experts 3-D" in reasons["fsdp"]
    # both releases give gpt_oss an expert plan over its 3-D experts: no per-rank cut of the split
    assert replacement.hfpatch_ep_plan is None and "cannot be cut to the rank's experts" in reasons["ep"]
    # no tensor-parallel rule on its experts (both releases): whole on every rank, the split as in one process
    assert replacement.hfpatch_tp_plan == {} and "tp" not in reasons
