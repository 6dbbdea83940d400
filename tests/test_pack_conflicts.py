"""Packs as a user installs them together: the first-party packs and the docs' example packs.

The first-party packs come from the wheels ``make venv`` installs into
``<venv>/first-party-packs`` (as ``pip install`` gives them); the example packs are the
sources of ``docs/examples/fused-mlp`` and ``docs/examples/rival-mlp``, installed as real
distributions.  ``fused-dense`` and ``fused-mlp`` both fuse llama's gate and up
projections, with converters for the same checkpoint tensors; with every pack enabled
(``HF_PATCH_PACKS`` unset) they tie on ``LlamaMLP``.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hfpatch_core
from hfpatch_core import PatchConflictError, plan_of
from hfpatch_core._pipeline.conflicts import find_conflicts
from hfpatch_core._pipeline.selection import current_selection
from hfpatch_core._runtime.snapshot import HOOK_GUARD
from hfpatch_core._session.session import new_session
from hfpatch_core.cli import main
from hfpatch_core.cli.explain import explain
from hfpatch_core.conversion import describe_transform
from hfpatch_core.testing import install_pack, load_model, safetensors_of, tiny_checkpoint

PACKS_SITE = Path(sys.prefix) / "first-party-packs"
EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"
#: the class each pack replaces LlamaMLP with
FUSED = {"fused-dense": "FusedGateUpLlamaMLP", "fused-mlp": "FusedGateUpMLP"}


@pytest.fixture
def everything(tmp_path: Path) -> Iterator[None]:
    """The first-party packs and the docs' example packs installed (``conftest._isolation`` restores sys.path)."""
    assert (PACKS_SITE / "hfpatch_pack_fused_dense").is_dir(), f"no first-party packs in {PACKS_SITE}: run make venv"
    before = set(sys.modules)
    sys.path.insert(0, str(PACKS_SITE))
    for name in ("fused-mlp", "rival-mlp"):
        source = (EXAMPLES / name / f"hfpatch_pack_{name.replace('-', '_')}.py").read_text(encoding="utf-8")
        install_pack(tmp_path / "examples", name, source)
    importlib.invalidate_caches()
    yield
    for module in set(sys.modules) - before:
        if module.startswith("hfpatch_pack_"):
            del sys.modules[module]


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits


#: fused-dense claims at priority -1 (packs written for one family win), fused-mlp at 0: the
#: selections below raise one of them above the other, or (``all``) leave fused-mlp ahead.
SELECTIONS = {
    "all": "fused-mlp",
    "all,fused-dense@+2": "fused-dense",
    "fused-dense@+2,fused-mlp": "fused-dense",
    "fused-mlp@+1,fused-dense": "fused-mlp",
}


def _winner(packs: str) -> tuple[str, str]:
    winner = SELECTIONS[packs]
    return winner, next(pack for pack in FUSED if pack != winner)


# --- issue 27 item 2: two packs fusing the same tensors ----------------------------------


@pytest.mark.parametrize("packs", list(SELECTIONS))
def test_two_packs_fusing_the_same_tensors_load_exactly_whichever_wins(
    everything, llama_checkpoint, tmp_path, packs
) -> None:
    winner, _ = _winner(packs)
    # float64: the fused matmul's rounding is far below what the comparison allows on any CPU
    vanilla = load_model(llama_checkpoint, dtype=torch.float64)
    model, info = load_model(llama_checkpoint, packs, dtype=torch.float64, output_loading_info=True)
    assert {kind: info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(kind)} == {}
    assert {type(layer.mlp).__name__ for layer in model.model.layers} == {FUSED[winner]}
    gate_up = [
        entry.origin
        for entry in plan_of(model).conversions.lists["llama"]
        if "mlp.gate_proj.weight" in describe_transform(entry.transform)
    ]
    assert gate_up == [winner]
    torch.testing.assert_close(logits(model), logits(vanilla), rtol=0, atol=1e-12)
    model.save_pretrained(tmp_path / "saved")
    written, original = safetensors_of(tmp_path / "saved"), safetensors_of(llama_checkpoint)
    assert written.keys() == original.keys()
    assert [key for key in original if not torch.equal(written[key], original[key].to(torch.float64))] == []


@pytest.mark.parametrize("packs", ["fused-dense@+2,fused-mlp", "fused-mlp@+1,fused-dense"])
def test_explain_and_check_say_what_the_load_does(everything, llama_checkpoint, capsys, packs) -> None:
    winner, loser = _winner(packs)
    conversions = explain(str(llama_checkpoint), new_session(packs)).plan.conversions
    gate_up = [
        entry.origin
        for entry in conversions.lists["llama"]
        if "mlp.gate_proj.weight" in describe_transform(entry.transform)
    ]
    assert gate_up == [winner]
    not_applied = {claim.pack: reason for claim, reason in conversions.lost if "mlp.gate_proj" in claim.describe()}
    reasons = {  # fused-dense ties its converter to its patch (patch_targets); fused-mlp to the pack's patches
        "fused-dense": "its patch 'LlamaMLP' is not applied: priority -1 < 1 of pack 'fused-mlp' ('LlamaMLP' -> "
        "FusedGateUpMLP)",
        "fused-mlp": "no patch of pack 'fused-mlp' is applied",
    }
    assert not_applied == {loser: reasons[loser]}
    assert main(["check", "--model-type", "llama", *packs.split(",")]) == 0
    out = capsys.readouterr().out
    assert "ok    together: fused-dense, fused-mlp" in out and "not applied" not in out


# --- issue 27 item 3: conflicts out of the box --------------------------------------------


def test_a_conflict_names_every_claimant_and_a_selection_the_resolver_checked(everything, llama_checkpoint) -> None:
    # out of the box fused-mlp (0) is ahead of fused-dense and rival-mlp (-1); raised by 1, fused-dense ties it
    hfpatch_core.enable("all,fused-dense@+1")
    with pytest.raises(PatchConflictError) as caught:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    error = caught.value
    message = str(error)
    assert error.target == "LlamaMLP" and error.packs == ("fused-dense", "fused-mlp")
    assert (
        "every claimant of 'LlamaMLP': "
        "fused-dense: hfpatch_pack_fused_dense.modules.FusedGateUpLlamaMLP, priority 0; "
        "fused-mlp: hfpatch_test_pack_fused_mlp.FusedGateUpMLP, priority 0; "
        "rival-mlp: hfpatch_test_pack_rival_mlp.RivalMLP, priority -1)"
    ) in message
    # the pack with fewer claims on the load is raised: it moves fewer ties on other model types
    assert error.selection == "all,fused-dense@+1,fused-mlp@+1"
    assert f"HF_PATCH_PACKS={error.selection} (raises 'fused-mlp' by 1) settles every conflict of llama" in message
    hfpatch_core.disable()
    model = load_model(llama_checkpoint, error.selection)
    assert type(model.model.layers[0].mlp).__name__ == "FusedGateUpMLP"


def test_a_suggested_selection_settles_the_conflicts_of_the_model_type_it_names(everything, tmp_path) -> None:
    checkpoint = tiny_checkpoint("qwen2_moe", tmp_path / "qwen2_moe")
    # what the user was told before: it settles llama and makes qwen2_moe's attention tie
    with pytest.raises(PatchConflictError) as caught:
        load_model(checkpoint, "all,fused-dense@+1")
    error = caught.value
    assert error.target == "Qwen2MoeAttention" and error.packs == ("fused-dense", "qwen-moe")
    assert error.selection is not None and f"HF_PATCH_PACKS={error.selection} (" in str(error)
    load_model(checkpoint, error.selection)  # strict: a conflict or a pack failure raises


def test_list_finds_the_conflicts_of_every_model_type_and_one_selection_settling_all(
    everything, llama_checkpoint, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("HF_PATCH_PACKS", "all,fused-dense@+1")
    conflicts = find_conflicts(current_selection(), guard=HOOK_GUARD)
    found = {(conflict.model_type, conflict.target, conflict.packs) for conflict in conflicts.conflicts}
    assert found == {
        ("llama", "LlamaMLP", ("fused-dense", "fused-mlp")),
        ("qwen2_moe", "Qwen2MoeAttention", ("fused-dense", "qwen-moe")),
        ("qwen3_moe", "Qwen3MoeAttention", ("fused-dense", "qwen-moe")),
    }
    assert {"llama", "qwen2_moe", "qwen3_moe"} <= set(conflicts.model_types)
    settling = conflicts.selection
    assert settling is not None
    # the selection list names loads both model types (and llama's is exact, as above)
    load_model(tiny_checkpoint("qwen2_moe", tmp_path / "qwen2_moe"), settling)
    load_model(llama_checkpoint, settling)

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    statuses = {line.split()[0]: line for line in out.splitlines() if "enabled" in line}
    assert "conflicts with" in statuses["fused-dense"] and "qwen2_moe" in statuses["fused-dense"]
    assert "conflicts with fused-dense on qwen2_moe; fused-dense on qwen3_moe" in statuses["qwen-moe"]
    assert "conflicts with fused-dense on llama" in statuses["fused-mlp"]
    assert f"HF_PATCH_PACKS={settling} settles every one" in out
    monkeypatch.setenv("HF_PATCH_PACKS", settling)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "conflicts with" not in out and "\nNo conflict on " in out


# --- issue 46 point 4: a structural pack's conflicts ----------------------------------------

#: a class pack claiming llama's norm, which the structural rms-norm example claims too (same priority)
LLAMA_NORM = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaRMSNorm


class OwnLlamaRMSNorm(LlamaRMSNorm):
    pass


@hookimpl
def provide_patches(context):
    return [Patch("LlamaRMSNorm", OwnLlamaRMSNorm)] if context.model_type == "llama" else []
"""


def test_list_shows_the_conflicts_of_a_structural_pack(llama_checkpoint, tmp_path, monkeypatch, capsys) -> None:
    """The rms-norm example declares no model type and answers nothing without a config: list asks it
    with a config of each model type another pack targets, and shows the tie every llama load raises."""
    source = (EXAMPLES / "rms-norm" / "hfpatch_pack_rms_norm.py").read_text(encoding="utf-8")
    install_pack(tmp_path / "site", "rms-norm", source, module="hfpatch_pack_rms_norm")
    install_pack(tmp_path / "site", "llama-norm", LLAMA_NORM)
    importlib.invalidate_caches()
    monkeypatch.setenv("HF_PATCH_PACKS", "rms-norm,llama-norm")
    with pytest.raises(PatchConflictError) as caught:
        load_model(llama_checkpoint, "rms-norm,llama-norm")
    assert caught.value.target == "LlamaRMSNorm" and caught.value.packs == ("llama-norm", "rms-norm")
    hfpatch_core.disable()

    assert main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["conflicts_checked_on"] == ["llama"]
    rows = {row["name"]: row for row in listed["packs"]}
    assert rows["rms-norm"]["conflicts"] == [{"model_type": "llama", "target": "LlamaRMSNorm", "with": ["llama-norm"]}]
    assert rows["llama-norm"]["conflicts"] == [{"model_type": "llama", "target": "LlamaRMSNorm", "with": ["rms-norm"]}]
    settling = listed["settled_by"]["HF_PATCH_PACKS"]
    load_model(llama_checkpoint, settling)  # strict: what list says settles it loads

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "llama: " in out and f"HF_PATCH_PACKS={settling} settles every one" in out
