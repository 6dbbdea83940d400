"""Every weight-changing first-party pack under DeepSpeed ZeRO-3, for real: ``Trainer`` on 2 CPU ranks (gloo).

One ``torchrun --nproc_per_node 2`` per group of packs (``hfpatch_core.testing.deepspeed``):
dense (llama: ``fused-dense``) and MoE (mixtral: ``linear-experts``, ``moe-replay``; qwen2_moe:
``qwen-moe``, ``moe-replay``).  Each case loads the tiny checkpoint with its pack, trains 2 steps
with a ZeRO-3 config, saves with ``Trainer.save_model`` and reloads the checkpoint with vanilla
transformers.  Against a single-process vanilla run of the same steps (the reference), in the
same test: the losses within ``loss_bound`` (what ZeRO-3 does to vanilla's own losses, measured
in the run), the reloaded weights equal to the trained ones (gathered), nothing warned.  Both
load paths: ``zero.Init`` (``from_pretrained`` while the ZeRO-3 ``TrainingArguments`` exist) and
``initialize`` (a plain load, partitioned by ``deepspeed.initialize``).

DeepSpeed comes with ``make venv`` and ``make venv-oldest`` (``constraints*.txt``), which also
build its ``shm_comm`` op once per venv into ``<venv>/torch-extensions``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from computed_once import computed_once

from hfpatch_core.testing import install_pack, tiny_checkpoint
from hfpatch_core.testing.deepspeed import (
    EXTENSIONS_DIR,
    LOSS_FLOOR,
    Zero3Case,
    Zero3Result,
    loss_bound,
    reference_training,
    zero3_training,
)

PACKS_SITE = Path(sys.prefix) / "first-party-packs"

#: A pack that is wrong by a little: its MLP's output 1% too large.  It must fail the bound.
SCALED_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class ScaledMLP(LlamaMLP):
    def forward(self, x):
        return super().forward(x) * 1.01

@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", ScaledMLP)] if context.model_type == "llama" else []
"""


def _site(tmp: Path) -> Path:
    site = tmp / "site"
    path = list(sys.path)
    install_pack(site, "scaled", SCALED_PACK, requires=("transformers>=5.3,<6",))
    sys.path[:] = path  # for the torchrun's ranks (their PYTHONPATH), not for this process
    return site


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("zero3")
    return {name: str(tiny_checkpoint(name, root / name)) for name in ("llama", "mixtral", "qwen2_moe")}


@pytest.fixture(scope="module")
def dense(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Zero3Result]:
    assert (PACKS_SITE / "hfpatch_pack_fused_dense").is_dir(), f"no first-party packs in {PACKS_SITE}: run make venv"
    llama = checkpoints["llama"]
    cases = [
        Zero3Case("llama/vanilla", llama, "none"),
        Zero3Case("llama/fused-dense", llama, "fused-dense"),
        Zero3Case("llama/fused-dense/initialize", llama, "fused-dense", init="initialize"),
        Zero3Case("llama/scaled", llama, "scaled", save=False),
    ]
    return computed_once(
        tmp_path_factory,
        "zero3-dense",
        lambda: zero3_training(cases, extra_path=[_site(tmp_path_factory.mktemp("dense")), PACKS_SITE]),
    )


#: The MoE cases train with SGD.  AdamW's first update is the learning rate times the gradient's sign,
#: so a gradient that rounds to the other side of zero (the experts' outputs summed in another order,
#: as every MoE pack sums them) moves its weight by twice the learning rate: on transformers 5.3 that
#: put linear-experts' second loss 1.2e-5 from vanilla's, on one process as under ZeRO-3.  SGD's update
#: is linear in the gradient, so the bound measures what ZeRO-3 does, and a lost or scaled gradient
#: still moves the second loss by far more than it.
MOE_OPTIM = "sgd"


@pytest.fixture(scope="module")
def moe(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Zero3Result]:
    mixtral, qwen2_moe = checkpoints["mixtral"], checkpoints["qwen2_moe"]
    cases = [
        Zero3Case("mixtral/vanilla", mixtral, "none", optim=MOE_OPTIM),
        Zero3Case("mixtral/linear-experts", mixtral, "linear-experts", optim=MOE_OPTIM),
        Zero3Case("mixtral/linear-experts/initialize", mixtral, "linear-experts", init="initialize", optim=MOE_OPTIM),
        Zero3Case("mixtral/moe-replay", mixtral, "moe-replay", optim=MOE_OPTIM),
        Zero3Case("qwen2_moe/vanilla", qwen2_moe, "none", optim=MOE_OPTIM),
        Zero3Case("qwen2_moe/qwen-moe", qwen2_moe, "qwen-moe", optim=MOE_OPTIM),
        Zero3Case("qwen2_moe/qwen-moe/initialize", qwen2_moe, "qwen-moe", init="initialize", optim=MOE_OPTIM),
        Zero3Case("qwen2_moe/moe-replay", qwen2_moe, "moe-replay", optim=MOE_OPTIM),
    ]
    return computed_once(tmp_path_factory, "zero3-moe", lambda: zero3_training(cases, extra_path=[PACKS_SITE]))


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Vanilla on this one process, without DeepSpeed: the same steps on the same batches (and optimizer)."""
    return computed_once(
        tmp_path_factory,
        "zero3-references",
        lambda: {
            name: reference_training(path, "none", optim=None if name == "llama" else MOE_OPTIM)[0]
            for name, path in checkpoints.items()
        },
    )


def test_the_extension_is_built_once_per_venv() -> None:
    # make venv builds shm_comm here; a run that had to build it would take minutes per rank
    assert any(EXTENSIONS_DIR.glob("deepspeed_shm_comm/*.so")), f"run make venv: no shm_comm op in {EXTENSIONS_DIR}"


def _check(result: Zero3Result, reference: list[float], bound: float, *, applied: bool = True) -> None:
    assert not any(result.errors), result.errors
    assert result.ranks_agree, result.losses
    assert len(result.losses) == len(reference) == 2
    assert result.max_loss_diff(reference) <= bound, (result.losses, reference, bound)
    if applied:
        assert result.replaced, "the pack replaced nothing"
    assert not any(result.warnings), result.warnings  # the save's layout check ran (it warned on (0,) shapes)
    assert "model.safetensors" in result.saved, result.saved
    assert result.reload_keys == []
    assert result.reload_diff == 0.0  # the checkpoint holds exactly the trained weights, in the original layout


@pytest.mark.parametrize("name", ["llama/fused-dense", "llama/fused-dense/initialize"])
def test_dense_packs_train_and_save_under_zero3(
    dense: dict[str, Zero3Result], references: dict[str, list[float]], name: str
) -> None:
    reference = references["llama"]
    vanilla = dense["llama/vanilla"]
    _check(vanilla, reference, loss_bound(reference, reference), applied=False)
    _check(dense[name], reference, loss_bound(vanilla.losses, reference))
    assert set(dense[name].replaced.values()) == {"FusedQKVLlamaAttention", "FusedGateUpLlamaMLP"}


MOE_CASES = [
    ("mixtral", "mixtral/linear-experts", {"LinearMixtralExperts"}),
    ("mixtral", "mixtral/linear-experts/initialize", {"LinearMixtralExperts"}),
    ("mixtral", "mixtral/moe-replay", {"ReplayableMixtralTopKRouter"}),
    ("qwen2_moe", "qwen2_moe/qwen-moe", {"PerExpertExperts", "Qwen2MoeFusedQKVAttention"}),
    ("qwen2_moe", "qwen2_moe/qwen-moe/initialize", {"PerExpertExperts", "Qwen2MoeFusedQKVAttention"}),
    ("qwen2_moe", "qwen2_moe/moe-replay", {"ReplayableQwen2MoeTopKRouter"}),
]


@pytest.mark.parametrize(("model", "name", "classes"), MOE_CASES)
def test_moe_packs_train_and_save_under_zero3(
    moe: dict[str, Zero3Result], references: dict[str, list[float]], model: str, name: str, classes: set[str]
) -> None:
    reference = references[model]
    vanilla = moe[f"{model}/vanilla"]
    # vanilla mixtral's save included: transformers' own conversions (its stacked experts) reversed
    _check(vanilla, reference, loss_bound(reference, reference), applied=False)
    _check(moe[name], reference, loss_bound(vanilla.losses, reference))
    assert set(moe[name].replaced.values()) == classes


def test_a_wrong_pack_fails_the_same_bound(dense: dict[str, Zero3Result], references: dict[str, list[float]]) -> None:
    reference = references["llama"]
    scaled = dense["llama/scaled"]
    assert not any(scaled.errors) and scaled.replaced == {"LlamaMLP": "ScaledMLP"}
    bound = loss_bound(dense["llama/vanilla"].losses, reference)
    assert bound < 10 * LOSS_FLOOR  # calibrated: ZeRO-3 itself moves vanilla's losses by next to nothing
    assert scaled.max_loss_diff(reference) > bound


@pytest.mark.parametrize("name", ["llama/fused-dense", "mixtral/linear-experts", "qwen2_moe/qwen-moe"])
def test_a_save_of_partitioned_weights_without_a_state_dict_is_refused(
    dense: dict[str, Zero3Result], moe: dict[str, Zero3Result], name: str
) -> None:
    # model.save_pretrained(path) on every rank: each holds empty placeholders; refused before
    # anything is written, on every rank, with the way to save (no rank waits in a gather alone)
    result = {**dense, **moe}[name]
    for error in result.direct_save:
        assert error is not None and error.startswith("WeightLayoutError: refusing to save"), error
        assert "ZeRO-3 partitioned" in error and "Trainer.save_model" in error
