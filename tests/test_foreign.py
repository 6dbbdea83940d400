"""Classes replaced outside hfpatch (issue 32 item 3): another library's swap in a modeling module
(Liger-Kernel's way), a patch registry entry no pack made, and the registry changed during a load."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator

import pytest
from transformers import AutoModelForCausalLM, monkey_patching
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaMLP

import hfpatch_core
from hfpatch_core import ForeignPatchError, PackWarning, plan_of
from hfpatch_core.cli import main
from packs import MLP_PACK, PackSpec


class ForeignMLP(LlamaMLP):
    """What another library puts in the modeling module (``apply_liger_kernel_to_llama`` assigns
    ``modeling_llama.LlamaMLP = LigerSwiGLUMLP`` the same way)."""


@pytest.fixture
def liger_style_swap() -> Iterator[None]:
    original = modeling_llama.LlamaMLP
    modeling_llama.LlamaMLP = ForeignMLP
    try:
        yield
    finally:
        modeling_llama.LlamaMLP = original


def mlp_classes(model) -> set[str]:
    return {type(layer.mlp).__name__ for layer in model.model.layers}


def test_a_pack_replacing_a_foreign_class_warns_once_naming_both_and_puts_it_back(
    install, llama_checkpoint, liger_style_swap
) -> None:
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    with pytest.warns(PackWarning) as caught:
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    messages = [str(w.message) for w in caught if "outside hfpatch" in str(w.message)]
    assert len(messages) == 1
    assert "pack 'mlp'" in messages[0] and f"{__name__}.ForeignMLP" in messages[0]
    assert mlp_classes(model) == {"PackMLP"}
    (found,) = plan_of(model).foreign
    assert (found.name, found.source, found.overridden_by) == ("LlamaMLP", "module", "mlp")
    assert found.module == "transformers.models.llama.modeling_llama"
    assert modeling_llama.LlamaMLP is ForeignMLP  # the other library's swap is back after the load
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackWarning)  # once: the second load is silent
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)


def test_strict_mode_raises_before_the_model_is_built(install, llama_checkpoint, liger_style_swap) -> None:
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable(strict=True)
    with pytest.raises(ForeignPatchError, match=r"pack 'mlp' replaces LlamaMLP .*ForeignMLP") as raised:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert raised.value.packs == ("mlp",) and raised.value.target == "LlamaMLP"
    assert modeling_llama.LlamaMLP is ForeignMLP


NORM_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaRMSNorm

class PackNorm(LlamaRMSNorm):
    pass

@hookimpl
def provide_patches(context):
    return [Patch("LlamaRMSNorm", PackNorm)] if context.model_type == "llama" else []
"""


def test_a_foreign_class_no_pack_claims_is_listed_and_kept(install, llama_checkpoint, liger_style_swap) -> None:
    install(PackSpec("norm", NORM_PACK))
    hfpatch_core.enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackWarning)
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert mlp_classes(model) == {"ForeignMLP"}
    (found,) = plan_of(model).foreign
    assert found.overridden_by is None and "set outside hfpatch" in found.describe()
    # ranks (or runs) that compare fingerprints see that one swapped a class and the other did not
    without = dataclasses.replace(plan_of(model), foreign=())
    assert without.fingerprint != plan_of(model).fingerprint


def test_a_registry_entry_that_displaces_a_pack_is_listed_and_warned(install, llama_checkpoint) -> None:
    install(PackSpec("mlp", MLP_PACK))
    monkey_patching.register_patch_mapping({"LlamaMLP": ForeignMLP})
    try:
        hfpatch_core.enable()
        with pytest.warns(PackWarning, match=rf"pack 'mlp' does not replace LlamaMLP .*{__name__}.ForeignMLP"):
            model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    finally:
        monkey_patching.unregister_patch_mapping(["LlamaMLP"])
    # the direct registration outranks a pack without overwrite=True: the foreign class is used
    assert mlp_classes(model) == {"ForeignMLP"}
    (found,) = plan_of(model).foreign
    assert (found.name, found.source, found.overridden_by, found.displaced) == ("LlamaMLP", "registry", None, "mlp")
    summary = plan_of(model).summary()
    assert f"no patch applied; outside hfpatch: LlamaMLP <- {__name__}.ForeignMLP [registry] (plan " in summary


def test_a_registry_entry_of_a_transformers_class_is_foreign_too(install, llama_checkpoint) -> None:
    """Only transformers' fusion_config classes are its own: a modeling class registered by other
    code (here Mistral's MLP for Llama's) is another library's patch."""
    from transformers.models.mistral.modeling_mistral import MistralMLP

    install(PackSpec("norm", NORM_PACK))
    monkey_patching.register_patch_mapping({"LlamaMLP": MistralMLP})
    try:
        hfpatch_core.enable()
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    finally:
        monkey_patching.unregister_patch_mapping(["LlamaMLP"])
    (found,) = plan_of(model).foreign
    assert (found.name, found.replacement, found.displaced) == (
        "LlamaMLP",
        "transformers.models.mistral.modeling_mistral.MistralMLP",
        None,  # the pack claims no MLP: listed, not warned
    )


CLEARING_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers import monkey_patching
from transformers.models.llama.modeling_llama import LlamaMLP

class ClearingMLP(LlamaMLP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        monkey_patching.clear_patch_mapping()  # what a library's linearize path does mid-load

@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", ClearingMLP)] if context.model_type == "llama" else []
"""


def test_the_registry_cleared_during_a_load_is_listed_and_warned(install, llama_checkpoint) -> None:
    install(PackSpec("clearing", CLEARING_PACK))
    hfpatch_core.enable()
    with pytest.warns(PackWarning, match=r"entry 'LlamaMLP' of this load was removed while the model was built"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    changed = [found for found in plan_of(model).foreign if found.source == "changed during the load"]
    assert [(found.name, found.replacement) for found in changed] == [("LlamaMLP", "removed")]


def test_explain_lists_foreign_replacements(install, llama_checkpoint, liger_style_swap, capsys) -> None:
    install(PackSpec("mlp", MLP_PACK))
    with warnings.catch_warnings():
        warnings.simplefilter("default", PackWarning)  # the CLI shows it as one line
        assert main(["explain", str(llama_checkpoint), "--json"]) == 0
        captured = capsys.readouterr()
        assert "hfpatch: warning: pack 'mlp' replaces LlamaMLP" in captured.err
        data = json.loads(captured.out)
        assert data["foreign"] == [
            {
                "class": "LlamaMLP",
                "replacement": f"{__name__}.ForeignMLP",
                "source": "module",
                "module": "transformers.models.llama.modeling_llama",
                "overridden_by": "mlp",
                "displaced": None,
            }
        ]
        # the swapped class counts under the name transformers' registry resolves it by
        assert any(row["class"] == "LlamaMLP" and row["replaced_by"] for row in data["classes"])
        assert main(["explain", str(llama_checkpoint)]) == 0
        assert "Classes replaced outside hfpatch" in capsys.readouterr().out
