"""Packs under transformers' own distributed loading, for real: ``torchrun --nproc_per_node 2`` (gloo, CPU).

Each test starts one torchrun for a group of cases (``distributed_cases.py``) and
asserts what both ranks wrote.  The first-party packs come from the wheels ``make
venv`` installs into ``<venv>/first-party-packs``, as ``pip install`` would give them;
a forward-only subclass pack is installed inline.  Tiny grouped-query checkpoints:
llama 4 heads / 2 kv heads, qwen2_moe 4 / 2 with 4 experts, qwen3 4 / 2, and a llama whose
intermediate size (75) does not halve.

What exists where: ``tp_plan="auto"`` and ``DistributedConfig(enable_expert_parallel=True)``
since 5.3 (the oldest supported release); ``DistributedConfig(fsdp_size=...,
ep_size=...)`` in 5.25 (``distributed_cases.modes``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
from computed_once import computed_once
from distributed_cases import modes

from hfpatch_core.errors import PackError, PackWarning
from hfpatch_core.testing import install_pack, tiny_checkpoint
from packs import PackSpec

HERE = Path(__file__).parent
PACKS_SITE = Path(sys.prefix) / "first-party-packs"
ATOL = 1e-5

SUBCLASS_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class ForwardOnlyMLP(LlamaMLP):
    def forward(self, x):
        return super().forward(x)

@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", ForwardOnlyMLP)] if context.model_type == "llama" else []
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("distributed")
    return {
        "llama": str(tiny_checkpoint("llama", root / "llama")),
        "qwen2_moe": str(tiny_checkpoint("qwen2_moe", root / "qwen2_moe")),
        "qwen3": str(tiny_checkpoint("qwen3", root / "qwen3")),
        "llama_uneven": str(tiny_checkpoint("llama", root / "llama_uneven", intermediate_size=75)),
        "mistral": str(tiny_checkpoint("mistral", root / "mistral")),
        "qwen2": str(tiny_checkpoint("qwen2", root / "qwen2")),
        "qwen3_moe": str(tiny_checkpoint("qwen3_moe", root / "qwen3_moe")),
        # two groups of two experts, one group kept: the group limit decides which experts can win
        "deepseek_v3": str(tiny_checkpoint("deepseek_v3", root / "deepseek_v3", n_group=2, topk_group=1)),
    }


def torchrun(
    group: str, checkpoints: dict[str, str], out: Path, site: Path, *, launcher: list[str], env: dict[str, str]
) -> list[dict[str, Any]]:
    """Run ``distributed_cases.py GROUP`` on 2 ranks; each rank's results."""
    assert (PACKS_SITE / "hfpatch_pack_fused_dense").is_dir(), f"no first-party packs in {PACKS_SITE}: run make venv"
    out.mkdir()
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(PACKS_SITE), str(HERE)]),
        "USE_HUB_KERNELS": "0",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    command = [
        *launcher,
        "--standalone",  # a free port of its own: tests may run in parallel
        "--nproc_per_node",
        "2",
        str(HERE / "distributed_cases.py"),
        group,
        str(out),
        json.dumps(checkpoints),
    ]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["rank"] for rank in ranks] == [0, 1]
    return ranks


#: A pack that knows nothing of distribution: its MLP builds its own parameters and declares no plan.
UNDECLARED_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class OwnInitMLP(LlamaMLP):
    def __init__(self, config):
        super().__init__(config)

@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", OwnInitMLP)] if context.model_type == "llama" else []
"""


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    path = list(sys.path)
    install_pack(site, "subclass", SUBCLASS_PACK, requires=("transformers>=5.3,<6",))
    install_pack(site, "undeclared", UNDECLARED_PACK, requires=("transformers>=5.3,<6",))
    sys.path[:] = path  # for the torchrun workers (their PYTHONPATH), not for the tests that follow here
    return site


@pytest.fixture(scope="module")
def loads(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("load")
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    return computed_once(
        tmp_path_factory,
        "distributed-load",
        lambda: torchrun("load", checkpoints, tmp / "out", _site(tmp), launcher=launcher, env={}),
    )


def cases(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [rank["cases"][name] for rank in ranks]


def cases_in(ranks: list[dict[str, Any]], name: str, mode: str) -> list[dict[str, Any]]:
    """Both ranks' results of case ``name``, a load sharded by ``mode``; where the installed
    transformers has no such load (5.3: no fsdp_size, no ep_size), the test is skipped, visibly,
    having checked that the case did not run."""
    if mode not in modes():
        assert name not in ranks[0]["cases"]
        skip_without(mode, name)
    return cases(ranks, name)


def skip_without(mode: str, name: str) -> None:
    import transformers

    field = {"fsdp": "fsdp_size", "ep": "ep_size"}.get(mode, mode)
    pytest.skip(
        f"transformers {transformers.__version__} has no {mode} load (DistributedConfig has no {field}): "
        f"case {name} did not run, so there is nothing to assert"
    )


def assert_equal_to_vanilla(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank}: {result['error']}\n{result['extra'].get('traceback', '')}"
        assert result["max_diff"] is not None and result["max_diff"] <= ATOL, (rank, result["max_diff"])
        assert result["greedy_equal"], rank


def test_every_case_ran_on_both_ranks(loads: list[dict[str, Any]]) -> None:
    expected = {*(FSDP_CASES if "fsdp" in modes() else ())}
    expert_parallel = {"qwen2_moe/ep/qwen-moe", "qwen2_moe/ep/fused-dense", "qwen2_moe/tp+ep/qwen-moe"}
    expected |= expert_parallel if "ep" in modes() else {"qwen2_moe/ep/qwen-moe/strict"}
    expected |= {"mistral/tp/fused-dense", "qwen2/tp/fused-dense"}
    expected |= {"mistral/fsdp/fused-dense", "qwen2/fsdp/fused-dense"} if "fsdp" in modes() else set()
    expected |= {f"qwen3_moe/{mode}/qwen-moe" for mode in modes()}
    expected |= {"deepseek_v3/ep/moe-replay"} if "ep" in modes() else set()
    for mode in modes():
        expected |= {f"qwen2_moe/{mode}/vanilla", f"qwen2_moe/{mode}/qwen-moe"}
        if mode != "ep":
            expected |= {f"llama/{mode}/{packs}" for packs in ("vanilla", "subclass", "fused-dense")}
        if mode != "fsdp":
            expected.add(f"qwen2_moe/{mode}/moe-replay")
        if mode == "tp":
            expected |= {"qwen2_moe/tp/fused-dense", "qwen3/tp/fused-dense"}
    assert [set(rank["cases"]) for rank in loads] == [expected, expected]


@pytest.mark.parametrize("case", ["llama/{mode}/vanilla", "qwen2_moe/{mode}/vanilla"])
def test_vanilla_sharded_loads_equal_a_single_process(loads: list[dict[str, Any]], case: str) -> None:
    for mode in modes():
        if case.startswith("llama") and mode == "ep":
            continue  # a dense model has no expert plan
        results = cases(loads, case.format(mode=mode))
        assert_equal_to_vanilla(results)
        assert [result["replaced"] for result in results] == [{}, {}]


def test_a_subclass_that_keeps_the_parameters_applies_under_every_sharding(loads: list[dict[str, Any]]) -> None:
    for mode in (mode for mode in modes() if mode != "ep"):
        results = cases(loads, f"llama/{mode}/subclass")
        assert_equal_to_vanilla(results)
        assert [result["replaced"] for result in results] == [{"LlamaMLP": "ForwardOnlyMLP"}] * 2
        assert [result["warnings"] for result in results] == [[], []]


def test_moe_replay_applies_under_tp_and_ep_and_replays_per_rank(loads: list[dict[str, Any]]) -> None:
    for mode in (mode for mode in modes() if mode != "fsdp"):
        results = cases(loads, f"qwen2_moe/{mode}/moe-replay")
        assert_equal_to_vanilla(results)
        router = {"Qwen2MoeTopKRouter": "ReplayableQwen2MoeTopKRouter"}
        assert [result["replaced"] for result in results] == [router, router]
        for result in results:
            assert result["extra"]["routed_layers"] == 2 and result["extra"]["routes_agree"]
            assert result["extra"]["replay_diff"] <= ATOL


def test_moe_replay_replays_a_group_limited_router_under_expert_parallelism_as_one_process(
    loads: list[dict[str, Any]],
) -> None:
    results = cases_in(loads, "deepseek_v3/ep/moe-replay", "ep")
    assert_equal_to_vanilla(results)
    router = {"DeepseekV3TopkRouter": "ReplayableDeepseekV3TopkRouter"}
    assert [result["replaced"] for result in results] == [router, router]
    for result in results:
        extra = result["extra"]
        assert extra["routed_layers"] == 2 and extra["routes_agree"]
        assert extra["num_experts"] == 2, "each rank holds 2 of the 4 experts"
        assert extra["live_differs"], "the moved routers still route as recorded: the replay proves nothing"
        assert extra["replayed_as_recorded"]
        assert extra["single_replay_diff"] <= ATOL


@pytest.mark.parametrize(
    ("case", "mode", "classes"),
    [
        ("llama/fsdp/undeclared", "fsdp", ("OwnInitMLP", "LlamaMLP")),
    ],
)
def test_a_layout_changing_pack_without_a_plan_is_refused_and_the_model_loads_vanilla(
    loads: list[dict[str, Any]], case: str, mode: str, classes: tuple[str, ...]
) -> None:
    pack = case.split("/")[-1]
    results = cases_in(loads, case, mode)
    assert_equal_to_vanilla(results)  # no shape error in forward, no converter size error
    assert [result["replaced"] for result in results] == [{}, {}]
    warnings = [result["warnings"] for result in results]
    assert warnings[0] == warnings[1] and len(warnings[0]) == 1, warnings
    message = warnings[0][0]
    assert f"pack {pack!r}" in message and "Refused before any weight was read" in message
    assert all(name in message for name in classes), message
    assert f"hfpatch_{mode}_plan" in message


@pytest.mark.parametrize(
    ("case", "mode"), [("llama/fsdp/undeclared/strict", "fsdp"), ("qwen2_moe/ep/qwen-moe/strict", "ep")]
)
def test_strict_mode_raises_the_refusal_on_both_ranks(loads: list[dict[str, Any]], case: str, mode: str) -> None:
    # 5.3 has no fsdp_size; 5.25 applies qwen-moe under expert parallelism (test_qwen_moe_...), and
    # 5.3's expert parallelism, where transformers cannot place its experts, still refuses it
    if mode == "ep" and "ep" in modes():
        assert case not in loads[0]["cases"]
        pytest.skip(f"this transformers has expert parallelism: qwen-moe applies under it, case {case} did not run")
    results = cases_in(loads, case, mode) if mode != "ep" else cases(loads, case)
    errors = [result["error"] for result in results]
    assert errors[0] == errors[1] and errors[0] is not None and errors[0].startswith("PackError: "), errors
    assert "Refused before any weight was read" in errors[0]
    if mode == "ep":
        assert "PerExpertExperts" in errors[0] and "uses hfpatch's 'local_experts'" in errors[0], errors[0]


def test_fused_dense_shards_a_qwen3_attention_with_per_head_norms(loads: list[dict[str, Any]]) -> None:
    results = cases(loads, "qwen3/tp/fused-dense")
    assert_equal_to_vanilla(results)
    fused = {"Qwen3Attention": "FusedQKVQwen3Attention", "Qwen3MLP": "FusedGateUpQwen3MLP"}
    assert [result["replaced"] for result in results] == [fused, fused]
    assert [result["extra"]["rows:self_attn.qkv_proj.weight"] for result in results] == [64, 64]


#: Rows of layer 0's fused projections on each rank: (q 64, k 32, v 32) and (gate, up 128 each), halved by TP.
SHARDED_ROWS = {
    "llama": {
        "rows:self_attn.qkv_proj.weight": 64,
        "rows:mlp.gate_up_proj.weight": 128,
        "rows:mlp.down_proj.weight": 64,
    },
    "qwen2_moe": {"rows:self_attn.qkv_proj.weight": 64},
}


@pytest.mark.parametrize(
    ("case", "classes"),
    [
        ("llama/tp/fused-dense", {"LlamaAttention": "FusedQKVLlamaAttention", "LlamaMLP": "FusedGateUpLlamaMLP"}),
        (
            "qwen2_moe/tp/qwen-moe",
            {"Qwen2MoeAttention": "Qwen2MoeFusedQKVAttention", "Qwen2MoeExperts": "PerExpertExperts"},
        ),
    ],
)
def test_fused_packs_shard_their_own_heads_under_tensor_parallelism(
    loads: list[dict[str, Any]], case: str, classes: dict[str, str]
) -> None:
    results = cases(loads, case)
    assert_equal_to_vanilla(results)  # grouped-query: each rank its own heads of q, k and v
    assert [result["replaced"] for result in results] == [classes, classes]
    assert [result["warnings"] for result in results] == [[], []]
    for result in results:
        rows = {key: value for key, value in result["extra"].items() if key in SHARDED_ROWS[case.split("/")[0]]}
        assert rows == SHARDED_ROWS[case.split("/")[0]]
        # gathered, a rank-wise fused tensor is not the fused layout: saving refuses rather than corrupt
        assert result["extra"]["save"].startswith("WeightLayoutError: refusing to save"), result["extra"]["save"]
    if case.startswith("qwen2_moe"):  # vanilla shards q/k/v alike: 32 + 16 + 16 rows
        vanilla = cases(loads, "qwen2_moe/tp/vanilla")[0]["extra"]
        assert [vanilla[f"rows:self_attn.{p}_proj.weight"] for p in "qkv"] == [32, 16, 16]


def test_a_declared_plan_shards_only_modules_the_model_plan_shards(loads: list[dict[str, Any]]) -> None:
    """qwen2_moe's plan shards the attention but leaves the shared expert whole: so does fused-dense."""
    results = cases(loads, "qwen2_moe/tp/fused-dense")
    assert_equal_to_vanilla(results)
    fused = {"Qwen2MoeAttention": "FusedQKVQwen2MoeAttention", "Qwen2MoeMLP": "FusedGateUpQwen2MoeMLP"}
    assert [result["replaced"] for result in results] == [fused, fused]
    for result in results:
        assert result["extra"]["rows:self_attn.qkv_proj.weight"] == 64  # half of 64 + 32 + 32
        assert result["extra"]["rows:mlp.shared_expert.gate_up_proj.weight"] == 128  # whole: 2 x 64


#: The FSDP2 cases beyond those of every mode (``distributed_cases.fsdp_cases``).
FSDP_CASES = (
    "qwen3/fsdp/fused-dense",
    "llama/fsdp/fused-dense/float64",
    "llama_uneven/fsdp/fused-dense",
    "llama/fsdp/undeclared",
    "llama/fsdp/undeclared/strict",
)


@pytest.mark.parametrize(
    ("case", "classes", "rows", "gathers"),
    [
        (
            "llama/fsdp/fused-dense",
            {"LlamaAttention": "FusedQKVLlamaAttention", "LlamaMLP": "FusedGateUpLlamaMLP"},
            {"self_attn.qkv_proj.weight": 64, "mlp.gate_up_proj.weight": 128},
            0,  # each rank cuts its rows from the whole parts in the memory-mapped checkpoint
        ),
        (  # cast on read, each share is a copy of its rows alone: the shares of every part are gathered
            "llama/fsdp/fused-dense/float64",
            {"LlamaAttention": "FusedQKVLlamaAttention", "LlamaMLP": "FusedGateUpLlamaMLP"},
            {"self_attn.qkv_proj.weight": 64, "mlp.gate_up_proj.weight": 128},
            2 * 5,  # 2 layers, q, k, v, gate and up
        ),
        (
            "qwen3/fsdp/fused-dense",
            {"Qwen3Attention": "FusedQKVQwen3Attention", "Qwen3MLP": "FusedGateUpQwen3MLP"},
            {"self_attn.qkv_proj.weight": 64, "mlp.gate_up_proj.weight": 128},
            0,
        ),
        (  # gate and up of 75 rows: shares of 38 and 37, the fused 150 cut in 75 and 75
            "llama_uneven/fsdp/fused-dense",
            {"LlamaAttention": "FusedQKVLlamaAttention", "LlamaMLP": "FusedGateUpLlamaMLP"},
            {"self_attn.qkv_proj.weight": 64, "mlp.gate_up_proj.weight": 75},
            0,
        ),
        (
            "qwen2_moe/fsdp/qwen-moe",
            {"Qwen2MoeExperts": "PerExpertExperts", "Qwen2MoeAttention": "Qwen2MoeFusedQKVAttention"},
            {"self_attn.qkv_proj.weight": 64},
            0,
        ),
    ],
)
def test_fused_packs_load_under_fsdp2_as_cuts_of_the_fused_tensor_and_save_the_original_layout(
    loads: list[dict[str, Any]], case: str, classes: dict[str, str], rows: dict[str, int], gathers: int
) -> None:
    results = cases_in(loads, case, "fsdp")
    assert_equal_to_vanilla(results)
    assert [result["replaced"] for result in results] == [classes, classes]
    assert [result["warnings"] for result in results] == [[], []]
    for result in results:
        extra = result["extra"]
        # half of the fused rows each, and each rank's the contiguous cut FSDP2 gathers (rank 0: all of q)
        assert {name: extra[f"rows:{name}"] for name in rows} == rows
        assert all(extra[f"cut:{name}"] for name in rows), extra
        # saved gathered: the original q/k/v (gate/up) tensors, which plain transformers reloads to equal logits
        assert extra["saved_fused"] == [] and extra["saved_q_proj"], extra
        assert extra["reloaded_diff"] <= ATOL
        assert extra["load_all_gathers"] == gathers


# --- expert parallelism: qwen-moe's experts cut per rank; fused-dense on a MoE; more families under TP ----


def test_qwen_moe_holds_each_rank_its_experts_under_expert_parallelism(loads: list[dict[str, Any]]) -> None:
    results = cases_in(loads, "qwen2_moe/ep/qwen-moe", "ep")
    assert_equal_to_vanilla(results)
    classes = {"Qwen2MoeAttention": "Qwen2MoeFusedQKVAttention", "Qwen2MoeExperts": "PerExpertExperts"}
    assert [result["replaced"] for result in results] == [classes, classes]
    assert [result["warnings"] for result in results] == [[], []]
    # 4 experts on 2 ranks: each its half, under the checkpoint's expert numbers
    assert [(result["extra"]["experts"], result["extra"]["num_experts"]) for result in results] == [
        (["0", "1"], 2),
        (["2", "3"], 2),
    ]
    for result in results:
        assert result["extra"]["rows:self_attn.qkv_proj.weight"] == 128  # attention whole: 64 + 32 + 32
        assert result["extra"]["save"].startswith("WeightLayoutError: refusing to save"), result["extra"]["save"]
        # training dispatches tokens by all-to-all: loss and gradients as one process
        assert result["extra"]["train_loss_diff"] <= ATOL
        assert result["extra"]["embedding_grad_diff"] <= ATOL
        assert result["extra"]["expert_grad_diff"] <= ATOL


def test_qwen_moe_under_tensor_and_expert_parallelism_together(loads: list[dict[str, Any]]) -> None:
    """DistributedConfig(tp_size=2, ep_size=2): the fused attention tensor-parallel, the experts cut per rank."""
    results = cases_in(loads, "qwen2_moe/tp+ep/qwen-moe", "ep")
    assert_equal_to_vanilla(results)
    assert [result["warnings"] for result in results] == [[], []]
    held = [(result["extra"]["experts"], result["extra"]["rows:self_attn.qkv_proj.weight"]) for result in results]
    assert held == [(["0", "1"], 64), (["2", "3"], 64)]  # each rank half the heads of q, k and v, half the experts


def test_fused_dense_keeps_a_moe_attention_and_shared_expert_whole_under_expert_parallelism(
    loads: list[dict[str, Any]],
) -> None:
    results = cases_in(loads, "qwen2_moe/ep/fused-dense", "ep")
    assert_equal_to_vanilla(results)
    fused = {"Qwen2MoeAttention": "FusedQKVQwen2MoeAttention", "Qwen2MoeMLP": "FusedGateUpQwen2MoeMLP"}
    assert [result["replaced"] for result in results] == [fused, fused]
    assert [result["warnings"] for result in results] == [[], []]
    for result in results:
        assert result["extra"]["rows:self_attn.qkv_proj.weight"] == 128
        assert result["extra"]["rows:mlp.shared_expert.gate_up_proj.weight"] == 128


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_fused_dense_shards_mistral_and_qwen2_under_tensor_parallelism(
    loads: list[dict[str, Any]], family: str
) -> None:
    results = cases(loads, f"{family}/tp/fused-dense")
    assert_equal_to_vanilla(results)
    name = {"mistral": "Mistral", "qwen2": "Qwen2"}[family]
    fused = {f"{name}Attention": f"FusedQKV{name}Attention", f"{name}MLP": f"FusedGateUp{name}MLP"}
    assert [result["replaced"] for result in results] == [fused, fused]
    for result in results:
        rows = {key: value for key, value in result["extra"].items() if key in SHARDED_ROWS["llama"]}
        assert rows == SHARDED_ROWS["llama"]  # the same sizes as the llama: each rank its heads and rows


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_fused_dense_loads_mistral_and_qwen2_under_fsdp2_as_cuts_of_the_fused_tensor(
    loads: list[dict[str, Any]], family: str
) -> None:
    case = f"{family}/fsdp/fused-dense"
    results = cases_in(loads, case, "fsdp")
    assert_equal_to_vanilla(results)
    name = {"mistral": "Mistral", "qwen2": "Qwen2"}[family]
    fused = {f"{name}Attention": f"FusedQKV{name}Attention", f"{name}MLP": f"FusedGateUp{name}MLP"}
    assert [result["replaced"] for result in results] == [fused, fused]
    for result in results:
        extra = result["extra"]
        assert extra["rows:self_attn.qkv_proj.weight"] == 64 and extra["rows:mlp.gate_up_proj.weight"] == 128
        assert extra["cut:self_attn.qkv_proj.weight"] and extra["cut:mlp.gate_up_proj.weight"], extra
        assert extra["saved_fused"] == [] and extra["saved_q_proj"] and extra["reloaded_diff"] <= ATOL, extra


def test_qwen_moe_applies_to_qwen3_moe_in_every_mode(loads: list[dict[str, Any]]) -> None:
    classes = {"Qwen3MoeAttention": "Qwen3MoeFusedQKVAttention", "Qwen3MoeExperts": "PerExpertExperts"}
    for mode in modes():
        results = cases(loads, f"qwen3_moe/{mode}/qwen-moe")
        assert_equal_to_vanilla(results)
        assert [result["replaced"] for result in results] == [classes, classes], mode
        assert [result["warnings"] for result in results] == [[], []], mode
        extra = [result["extra"] for result in results]
        if mode == "tp":  # each rank its own heads of q, k and v; the experts whole
            assert [each["rows:self_attn.qkv_proj.weight"] for each in extra] == [64, 64]
        elif mode == "fsdp":  # each rank its contiguous cut; saved as the original layout
            assert all(each["cut:self_attn.qkv_proj.weight"] and each["saved_fused"] == [] for each in extra), extra
        else:  # each rank its half of the experts, under the checkpoint's numbers
            assert [(each["experts"], each["num_experts"]) for each in extra] == [(["0", "1"], 2), (["2", "3"], 2)]


def test_fused_outputs_split_whole_or_by_rank_share() -> None:
    from hfpatch_core.authoring.fusion import local_sizes

    assert local_sizes((64, 32, 32), 128) == (64, 32, 32)
    assert local_sizes((64, 32, 32), 64) == (32, 16, 16)
    with pytest.raises(ValueError, match="no whole share of parts"):
        local_sizes((64, 32, 32), 48)


@pytest.fixture(scope="module")
def training(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("train")
    hfpatch = Path(sys.executable).parent / "hfpatch"
    return computed_once(
        tmp_path_factory,
        "distributed-train",
        lambda: torchrun(
            "train",
            checkpoints,
            tmp / "out",
            _site(tmp),
            launcher=[str(hfpatch), "run", "--", "torchrun"],
            env={"HF_PATCH_PACKS": "fused-dense"},
        ),
    )


def test_ddp_training_under_hfpatch_run_keeps_ranks_alike(training: list[dict[str, Any]]) -> None:
    assert [rank["enabled_by_autorun"] for rank in training] == [True, True]
    results = cases(training, "ddp")
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank}: {result['error']}\n{result['extra'].get('traceback', '')}"
        assert result["replaced"] == {"LlamaAttention": "FusedQKVLlamaAttention", "LlamaMLP": "FusedGateUpLlamaMLP"}
        fingerprints = result["extra"]["fingerprints"]
        assert len(set(fingerprints)) == 1 and fingerprints[0] is not None
        assert result["extra"]["max_param_diff_from_rank0"] == 0.0
        assert result["extra"]["moved"] > 1e-3  # the steps did train


def test_fsdp2_after_a_normal_load_trains_the_fused_model_as_vanilla(training: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(cases(training, "fsdp2-after-load")):
        assert result["error"] is None, f"rank {rank}: {result['error']}\n{result['extra'].get('traceback', '')}"
        assert result["replaced"] == {"LlamaAttention": "FusedQKVLlamaAttention", "LlamaMLP": "FusedGateUpLlamaMLP"}
        assert result["max_diff"] <= ATOL, result["extra"]["losses"]


# --- the rule itself, in process: which claims a sharded load refuses --------------------------------

RULE_PACK = """
from hfpatch_core import Converter, Patch, hookimpl
from transformers.core_model_loading import WeightRenaming
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

class OwnInitMLP(LlamaMLP):
    def __init__(self, config):
        super().__init__(config)

class DeclaredMLP(OwnInitMLP):
    hfpatch_tp_plan = {}
    hfpatch_unsharded_reasons = {"fsdp": "its rows are cut at load from a tensor every rank reads whole"}

class RenamedAttention(LlamaAttention):
    pass

class ForwardOnlyNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        return super().forward(hidden_states)

@hookimpl
def provide_patches(context):
    mlp = DeclaredMLP if context.config == "declared" else OwnInitMLP
    return [Patch("LlamaMLP", mlp), Patch("LlamaAttention", RenamedAttention), Patch("LlamaRMSNorm", ForwardOnlyNorm)]

@hookimpl
def provide_converters(context):
    rename = WeightRenaming(source_patterns="self_attn.q_proj", target_patterns="self_attn.query")
    return [Converter("llama", [rename], patch_targets=("LlamaAttention",))]
"""


def _plan(parallel: tuple[str, ...], config: str | None = None):
    from hfpatch_core._session.session import new_session
    from hfpatch_core.context import LoadContext

    context = LoadContext("llama", "LlamaForCausalLM", config=config, parallel=parallel)
    return new_session("rule").plan(context, ("LlamaMLP", "LlamaAttention", "LlamaRMSNorm"))


def test_a_single_process_load_refuses_nothing(install) -> None:
    install(PackSpec("rule", RULE_PACK))
    plan = _plan(())
    assert sorted(plan.mapping) == ["LlamaAttention", "LlamaMLP", "LlamaRMSNorm"]


def test_a_sharded_load_refuses_each_class_whose_parameters_change_without_a_plan(install) -> None:
    install(PackSpec("rule", RULE_PACK))
    with pytest.warns(PackWarning) as caught:
        plan = _plan(("tp",))
    assert list(plan.mapping) == ["LlamaRMSNorm"]  # a forward-only subclass keeps its parameters
    assert not plan.conversions  # the converter tied to the refused attention went with it
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "OwnInitMLP (replacing 'LlamaMLP')" in message and "its __init__ builds its own parameters" in message
    assert "RenamedAttention (replacing 'LlamaAttention')" in message and "it has converters" in message
    assert "hfpatch_tp_plan" in message and "'LlamaMLP', 'LlamaAttention' load as in transformers" in message


def test_a_declared_plan_admits_the_class_for_that_parallelism_only(install) -> None:
    install(PackSpec("rule", RULE_PACK))
    with pytest.warns(PackWarning):
        plan = _plan(("tp",), "declared")
    assert sorted(plan.mapping) == ["LlamaMLP", "LlamaRMSNorm"]
    with pytest.warns(PackWarning, match="declares no plan for fsdp .hfpatch_fsdp_plan.") as caught:
        plan = _plan(("tp", "fsdp"), "declared")
    assert list(plan.mapping) == ["LlamaRMSNorm"]
    # the class's own reason for the parallelism it cannot shard is quoted (hfpatch_unsharded_reasons)
    assert "(it says why: fsdp: its rows are cut at load from a tensor every rank reads whole)" in str(
        caught[0].message
    )


def test_strict_mode_raises_the_refusal(install) -> None:
    from hfpatch_core._session.session import new_session
    from hfpatch_core.context import LoadContext

    install(PackSpec("rule", RULE_PACK))
    context = LoadContext("llama", "LlamaForCausalLM", parallel=("fsdp",))
    with pytest.raises(PackError, match=r"pack 'rule': LlamaForCausalLM is loaded with FSDP2 sharding"):
        new_session("rule", strict=True).plan(context, ("LlamaMLP", "LlamaAttention", "LlamaRMSNorm"))


def test_the_parallelisms_are_read_from_the_loader_arguments(monkeypatch) -> None:
    from transformers.distributed import DistributedConfig

    from hfpatch_core._compat import parallel_modes

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parallel_modes() == ()
    if "ep_size" in DistributedConfig.__dataclass_fields__:  # 5.25: sizes
        assert parallel_modes(DistributedConfig(tp_plan="auto")) == ("tp",)
        assert parallel_modes(DistributedConfig(fsdp_size=2)) == ("fsdp",)
        assert parallel_modes(DistributedConfig(ep_size=2, tp_plan={})) == ("ep",)
        assert parallel_modes(DistributedConfig(tp_size=2, ep_size=2)) == ("tp", "ep")
        monkeypatch.setenv("WORLD_SIZE", "1")
        assert parallel_modes(DistributedConfig(tp_plan="auto")) == ()  # one process: nothing is sharded
    else:  # 5.3: tp_plan, and expert parallelism instead of it
        assert parallel_modes(None, "auto") == ("tp",)
        assert parallel_modes(DistributedConfig(enable_expert_parallel=True), "auto") == ("ep",)
        monkeypatch.setenv("WORLD_SIZE", "1")
        assert parallel_modes(None, "auto") == ()


# --- hfpatch verify --distributed ----------------------------------------------------------------------


def test_verify_distributed_reports_each_parallelism_from_one_torchrun() -> None:
    environment = {**os.environ, "PYTHONPATH": str(PACKS_SITE), "USE_HUB_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    hfpatch = Path(sys.executable).parent / "hfpatch"
    command = [str(hfpatch), "verify", "fused-dense", "--model-type", "llama", "--distributed", "tp,fsdp", "--json"]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(done.stdout)["distributed"]}
    assert list(rows) == ["tp", "fsdp"]
    tp = rows["tp"]
    assert (tp["outcome"], tp["ok"], tp["generation_match"]) == ("applied", True, True)
    assert tp["max_abs_diff"] <= ATOL and tp["replaced"] == {
        "LlamaAttention": "FusedQKVLlamaAttention",
        "LlamaMLP": "FusedGateUpLlamaMLP",
    }
    fsdp = rows["fsdp"]
    if "fsdp" in modes():
        assert (fsdp["outcome"], fsdp["ok"], fsdp["generation_match"]) == ("applied", True, True)
        assert fsdp["max_abs_diff"] <= ATOL and fsdp["replaced"] == tp["replaced"]
    else:
        assert (fsdp["outcome"], fsdp["ok"]) == ("unavailable", True)


def test_verify_distributed_takes_known_parallelisms_only(capsys) -> None:
    from hfpatch_core.cli import main

    assert main(["verify", "--distributed", "tp,dp"]) == 2
    assert "--distributed takes parallelisms among tp,fsdp,ep, got 'tp,dp'" in capsys.readouterr().err


# --- the expert cut itself, in process: which experts a rank keeps ---------------------------------------


def _toy_moe(experts: int, style: str = "ep_dispatch_experts") -> Any:
    """A model shaped as transformers builds one: a layer whose ``experts`` list declares ``local_experts``,
    and the model's expert plan (the 3-D experts' rule, which names nothing in a list, included)."""
    import torch.nn as nn

    class Experts(nn.ModuleList):
        hfpatch_ep_plan: ClassVar[dict[str, str]] = {"*": "local_experts"}

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    for layer in model.layers:
        layer.experts = Experts(nn.Linear(2, 2) for _ in range(experts))
        layer.experts.num_experts = experts
    model._ep_plan = {"layers.*.experts": style, "layers.*.experts.gate_up_proj": "grouped_gemm"}
    model._keys_to_ignore_on_load_unexpected = {"rotary"}
    return model


class _Coordinates:
    """This rank's place on the expert mesh (what ``keep_local_experts`` reads of transformers' mesh)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.ranks = rank, size

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.ranks


def test_local_experts_keeps_this_ranks_share_under_the_global_numbers() -> None:
    from hfpatch_core._compat import expert_mesh_of_loader
    from hfpatch_core._runtime.parallel_plans import keep_local_experts

    model = _toy_moe(4)
    kept = keep_local_experts(model, lambda: _Coordinates(1, 2))
    if not expert_mesh_of_loader():  # 5.3: the style cannot apply, the class was refused before this point
        assert kept == {} and len(model.layers[0].experts) == 4
        return
    assert kept == {"layers.0.experts": (2, 3), "layers.1.experts": (2, 3)}
    for layer in model.layers:
        assert [name for name, _ in layer.experts.named_children()] == ["2", "3"] and layer.experts.num_experts == 2
    assert model._ep_plan == {"layers.*.experts": "ep_dispatch_experts"}  # the 3-D rule named nothing here
    ignored = re.compile("|".join(model._keys_to_ignore_on_load_unexpected))
    assert ignored.search("layers.1.experts.0.weight") and ignored.search("model.layers.0.experts.1.bias")
    assert not ignored.search("layers.1.experts.2.weight") and not ignored.search("layers.1.experts.10.weight")


def test_local_experts_keeps_the_children_that_are_not_experts() -> None:
    """A module holding its activation (or a norm) beside the experts, as linear-experts' drop-ins hold the
    original's ``act_fn``: only the numbered children are experts; the others stay on every rank."""
    import torch.nn as nn

    from hfpatch_core._compat import expert_mesh_of_loader
    from hfpatch_core._runtime.parallel_plans import keep_local_experts

    model = _toy_moe(4)
    for layer in model.layers:
        layer.experts.add_module("act_fn", nn.SiLU())
    kept = keep_local_experts(model, lambda: _Coordinates(0, 2))
    if not expert_mesh_of_loader():
        assert kept == {}
        return
    assert kept == {"layers.0.experts": (0, 1), "layers.1.experts": (0, 1)}
    for layer in model.layers:
        assert [name for name, _ in layer.experts.named_children()] == ["0", "1", "act_fn"]


@pytest.mark.parametrize(
    ("experts", "style", "mesh", "message"),
    [
        (3, "ep_dispatch_experts", _Coordinates(0, 2), "cannot evenly shard 3 experts across 2 expert-parallel ranks"),
        (4, "grouped_gemm", _Coordinates(0, 2), "runs it as 'grouped_gemm', not 'ep_dispatch_experts'"),
        (4, "ep_dispatch_experts", None, "expert-parallel mesh for this load was not found"),
    ],
)
def test_local_experts_refuses_what_it_cannot_cut(experts: int, style: str, mesh: Any, message: str) -> None:
    from hfpatch_core._compat import expert_mesh_of_loader
    from hfpatch_core._runtime.parallel_plans import keep_local_experts

    model = _toy_moe(experts, style)
    if not expert_mesh_of_loader():
        assert keep_local_experts(model, lambda: mesh) == {}
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        keep_local_experts(model, lambda: mesh)
