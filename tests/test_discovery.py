from __future__ import annotations

import sys
import warnings

import pytest

import hfpatch_core
from hfpatch_core import DuplicatePackError, PackError, PackWarning, SelectionError, discover
from packs import MLP_PACK, PackSpec


def test_metadata_is_read_without_importing(install) -> None:
    install(
        PackSpec("mlp", MLP_PACK, version="2.1.0", summary="Faster MLPs", requires=("transformers>=5.3,<6", "torch")),
        PackSpec("exploding", "raise RuntimeError('imported!')\n", requires=()),
    )
    discovery = discover()
    mlp, exploding = discovery.packs["mlp"], discovery.packs["exploding"]
    assert (mlp.distribution, mlp.version, mlp.summary, mlp.transformers_range) == (
        "hfpatch-pack-mlp",
        "2.1.0",
        "Faster MLPs",
        "<6,>=5.3",
    )
    assert exploding.transformers_range == ""
    assert "hfpatch_test_pack_exploding" not in sys.modules
    assert "hfpatch_test_pack_mlp" not in sys.modules


def test_transformers_range_ignores_extras_and_markers(install) -> None:
    install(
        PackSpec(
            "marked",
            MLP_PACK,
            requires=('transformers>=9; extra == "future"', 'transformers<6; python_version >= "3"'),
        )
    )
    assert discover().packs["marked"].transformers_range == "<6"


def test_pack_that_is_not_selected_is_never_imported(install, llama_checkpoint) -> None:
    install(PackSpec("mlp", MLP_PACK), PackSpec("exploding", "raise RuntimeError('imported!')\n"))
    hfpatch_core.enable("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = __import__("transformers").AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(model.model.layers[0].mlp).__name__ == "PackMLP"
    assert "hfpatch_test_pack_exploding" not in sys.modules


def test_same_pack_name_from_two_distributions_is_an_error_naming_both(install, llama_checkpoint) -> None:
    install(
        PackSpec("twin", MLP_PACK, distribution="hfpatch-pack-twin", module="hfpatch_test_pack_twin_a"),
        PackSpec("twin", MLP_PACK, distribution="other-twin", version="3.0", module="hfpatch_test_pack_twin_b"),
        PackSpec("mlp", MLP_PACK),
    )
    discovery = discover()
    assert "twin" not in discovery.packs
    message = str(discovery.duplicate_error("twin"))
    assert "hfpatch-pack-twin 1.0.0 (hfpatch_test_pack_twin_a)" in message
    assert "other-twin 3.0 (hfpatch_test_pack_twin_b)" in message and "pip uninstall" in message
    with pytest.raises(DuplicatePackError, match="declared by"):
        hfpatch_core.enable(strict=True)
    with pytest.warns(PackWarning, match="pack name 'twin' is declared by"):
        hfpatch_core.enable()
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(model.model.layers[0].mlp).__name__ == "PackMLP"  # the other pack still applies
    hfpatch_core.enable("all,-twin")  # excluding the ambiguous name silences it


def test_incompatible_pack_is_skipped_with_its_range(install, llama_checkpoint) -> None:
    install(PackSpec("future", MLP_PACK, requires=("transformers>=6",)))
    with pytest.warns(PackWarning, match=r"'future' \(hfpatch-pack-future 1.0.0\) supports transformers>=6 but"):
        selection = hfpatch_core.enable()
    assert "future" not in selection.packs
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    with pytest.raises(PackError, match="supports transformers>=6"):
        hfpatch_core.enable(strict=True)


def test_env_variable_and_enable_argument_choose_alike(install, monkeypatch) -> None:
    install(PackSpec("alpha", MLP_PACK), PackSpec("beta", MLP_PACK))
    monkeypatch.setenv("HF_PATCH_PACKS", " -beta ")
    chosen = set(hfpatch_core.enable().packs)
    assert "alpha" in chosen and "beta" not in chosen
    assert set(hfpatch_core.enable(["all", "-beta"]).packs) == chosen
    monkeypatch.setenv("HF_PATCH_PACKS", "beta , alpha")
    assert set(hfpatch_core.enable().packs) == {"alpha", "beta"}
    monkeypatch.setenv("HF_PATCH_PACKS", "alpah")
    with pytest.raises(SelectionError, match="did you mean 'alpha'"):
        hfpatch_core.enable()
    monkeypatch.setenv("HF_PATCH_PACKS", "none")
    assert not hfpatch_core.enable().packs
