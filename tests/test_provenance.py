"""Provenance (issue 32 item 2): a checkpoint saved from a patched model records the packs that made it."""

from __future__ import annotations

import json
import logging
import warnings

from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hfpatch_core
from hfpatch_core import plan_of
from hfpatch_core.cli import main
from packs import FUSED_MLP_PACK, MLP_PACK, PackSpec

FILE_NAME = "hfpatch_provenance.json"


def keys(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


def test_a_patched_save_records_its_packs_beside_the_original_layout(install, llama_checkpoint, tmp_path) -> None:
    # issue 44.7: a pack selected for the load that changed nothing in it (qwen-only here) made nothing of the save
    qwen_only = MLP_PACK.replace('context.model_type == "llama"', 'context.model_type == "qwen2_moe"')
    install(PackSpec("fused", FUSED_MLP_PACK), PackSpec("qwen-only", qwen_only))
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    model.save_pretrained(tmp_path / "saved")
    recorded = json.loads((tmp_path / "saved" / FILE_NAME).read_text())
    plan = plan_of(model)
    assert recorded["packs"] == [{"name": "fused", "version": "1.0.0"}]
    assert recorded["fingerprint"] == plan.fingerprint and recorded["model_class"] == "LlamaForCausalLM"
    assert recorded["replaced"] == {"LlamaMLP": "hfpatch_test_pack_fused.FusedGateUpMLP [fused]"}
    assert keys(tmp_path / "saved") == keys(llama_checkpoint)  # the weights in the original layout
    hfpatch_core.disable()
    vanilla = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")  # transformers ignores the file
    assert type(vanilla.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_a_save_without_patches_records_nothing(install, llama_checkpoint, tmp_path) -> None:
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable(packs="none")
    AutoModelForCausalLM.from_pretrained(llama_checkpoint).save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / FILE_NAME).exists()


def test_a_load_with_another_selection_logs_what_differs(install, llama_checkpoint, tmp_path, caplog) -> None:
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    AutoModelForCausalLM.from_pretrained(llama_checkpoint).save_pretrained(tmp_path / "saved")
    with caplog.at_level(logging.WARNING, logger="hfpatch"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert not [r for r in caplog.records if "saved from a model patched otherwise" in r.getMessage()]
    hfpatch_core.enable(packs="none")
    with caplog.at_level(logging.WARNING, logger="hfpatch"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    (message,) = [r.getMessage() for r in caplog.records if "saved from a model patched otherwise" in r.getMessage()]
    assert "pack 'mlp' 1.0.0 made it; it is not selected" in message
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_explain_shows_the_record(install, llama_checkpoint, tmp_path, capsys) -> None:
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    model.save_pretrained(tmp_path / "saved")
    hfpatch_core.disable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["explain", str(tmp_path / "saved"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["provenance"]["packs"] == [{"name": "mlp", "version": "1.0.0"}]
    assert data["provenance"]["fingerprint"] == plan_of(model).fingerprint
    assert main(["explain", str(tmp_path / "saved")]) == 0
    out = capsys.readouterr().out
    assert f"Saved from a model patched by mlp 1.0.0 (plan {plan_of(model).fingerprint}; {FILE_NAME})" in out
    assert "differs now" not in out
    assert main(["explain", str(llama_checkpoint), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["provenance"] is None
