"""A third party clearing transformers' patch registry during or between patched loads.

llm-compressor (``load_quantizable_moe`` / ``linearize_moe_model``) calls
``transformers.monkey_patching.clear_patch_mapping()``, which removes every registration
in the process, hfpatch's included.  Whenever that happens, hfpatch's restore must leave
the registry without its own entries and without entries it would have put back (the
third party meant them gone), and the next patched and vanilla loads must behave as
usual.  transformers has no public API that clears its conversion registry
(``conversion_mapping``): only the patch registry is cleared here.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, modeling_utils, monkey_patching
from transformers.models.llama import modeling_llama

import hfpatch_core
from conftest import tiny_llama_config
from hfpatch_core import PackWarning, plan_of
from packs import MLP_PACK, PackSpec, fused_qkv_pack

# A pack whose replacement clears the whole registry while the model is being built,
# as a quantizer that linearises modules itself does from inside a load.
CLEARING_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers import monkey_patching
from transformers.models.llama.modeling_llama import LlamaMLP

class ClearingMLP(LlamaMLP):
    def __init__(self, *args, **kwargs):
        monkey_patching.clear_patch_mapping()
        super().__init__(*args, **kwargs)

@hookimpl
def provide_patches(context):
    if context.model_type == "llama":
        return [Patch("LlamaMLP", ClearingMLP, overwrite=True)]
    return []
"""


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def layer_classes(model: torch.nn.Module) -> set[tuple[str, str]]:
    return {(type(layer.mlp).__name__, type(layer.self_attn).__name__) for layer in model.model.layers}


class UserNorm(modeling_llama.LlamaRMSNorm):
    pass


class UserMLP(modeling_llama.LlamaMLP):
    pass


def assert_vanilla_afterwards(checkpoint, expected: torch.Tensor) -> None:
    hfpatch_core.disable()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert layer_classes(model) == {("LlamaMLP", "LlamaAttention")}
    assert type(model.model.norm) is modeling_llama.LlamaRMSNorm
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-5)
    assert monkey_patching.get_patch_mapping() == {}


@pytest.mark.parametrize("user_entry", ["none", "untouched", "overwritten"])
def test_a_clear_inside_a_patched_load_leaves_no_entry_and_the_next_loads_work(
    install, llama_checkpoint, snapshot, user_entry
) -> None:
    vanilla = logits(AutoModelForCausalLM.from_pretrained(llama_checkpoint))
    install(PackSpec("clearing", CLEARING_PACK), PackSpec("qkv", fused_qkv_pack()), PackSpec("mlp", MLP_PACK))
    # registered after the snapshot: the third party's clear removes it, so the state
    # after the load is the snapshot's
    if user_entry == "untouched":
        monkey_patching.register_patch_mapping({"LlamaRMSNorm": UserNorm})
    elif user_entry == "overwritten":  # the clearing pack's claim overwrites it for the load
        monkey_patching.register_patch_mapping({"LlamaMLP": UserMLP})
    hfpatch_core.enable("clearing,qkv")
    # the clear is seen and said (Plan.foreign, test_foreign); the user's overwritten entry too
    with pytest.warns(PackWarning, match="outside hfpatch|no pack made it"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert {found.source for found in plan_of(model).foreign} >= {"changed during the load"}
    # the replacements were all in place before the first one cleared the registry
    assert layer_classes(model) == {("ClearingMLP", "FusedQKVAttention")}
    if user_entry == "untouched":
        assert type(model.model.norm) is UserNorm
    assert set(plan_of(model).replaced) == {"LlamaMLP", "LlamaAttention"}
    torch.testing.assert_close(logits(model), vanilla, rtol=0, atol=1e-5)  # the fused q/k/v weights loaded
    # neither hfpatch's entries nor the user's entry it had overwritten (the clear removed it)
    assert monkey_patching.get_patch_mapping() == {}
    snapshot.assert_unchanged()
    assert modeling_llama.LlamaMLP.__name__ == "LlamaMLP"
    assert modeling_llama.LlamaAttention.__name__ == "LlamaAttention"

    hfpatch_core.enable("qkv,mlp")
    again = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert layer_classes(again) == {("PackMLP", "FusedQKVAttention")}
    torch.testing.assert_close(logits(again), vanilla, rtol=0, atol=1e-5)
    snapshot.assert_unchanged()
    assert_vanilla_afterwards(llama_checkpoint, vanilla)
    snapshot.assert_unchanged()


def test_a_clear_from_a_transformers_hook_during_a_nested_plan_and_from_config(
    install, llama_checkpoint, snapshot, monkeypatch
) -> None:
    """The clear comes from outside any pack: transformers' ``post_init`` (end of the
    model's construction, inside ``apply_patches``)."""
    vanilla = logits(AutoModelForCausalLM.from_pretrained(llama_checkpoint))
    install(PackSpec("qkv", fused_qkv_pack()), PackSpec("mlp", MLP_PACK))
    post_init = modeling_utils.PreTrainedModel.post_init
    cleared: list[set[str]] = []

    def clearing_post_init(self):
        cleared.append(set(monkey_patching.get_patch_mapping()))
        monkey_patching.clear_patch_mapping()
        return post_init(self)

    monkeypatch.setattr(modeling_utils.PreTrainedModel, "post_init", clearing_post_init)
    hfpatch_core.enable("qkv,mlp")
    for number, load in enumerate(
        (
            lambda: AutoModelForCausalLM.from_pretrained(llama_checkpoint),
            lambda: LlamaForCausalLM._from_config(tiny_llama_config()),
        )
    ):
        # said once per session: the same entries are cleared by every load
        warned = pytest.warns(PackWarning, match="outside hfpatch") if number == 0 else contextlib.nullcontext()
        with warned:
            model = load()
        assert layer_classes(model) == {("PackMLP", "FusedQKVAttention")}
        assert monkey_patching.get_patch_mapping() == {}
        snapshot.assert_unchanged()
    # post_init runs for LlamaModel, then for LlamaForCausalLM: the first clears hfpatch's entries;
    # _from_config builds vanilla's model first (its initial weights, issue 52.4), with no entry of hfpatch's
    patched = [{"LlamaMLP", "LlamaAttention"}, set()]
    assert cleared == [*patched, set(), set(), *patched]
    final = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    torch.testing.assert_close(logits(final), vanilla, atol=1e-5, rtol=0)
    monkeypatch.undo()
    assert_vanilla_afterwards(llama_checkpoint, vanilla)
    snapshot.assert_unchanged()


def test_a_clear_between_patched_loads_changes_nothing_for_hfpatch(install, llama_checkpoint, snapshot) -> None:
    vanilla = logits(AutoModelForCausalLM.from_pretrained(llama_checkpoint))
    install(PackSpec("qkv", fused_qkv_pack()), PackSpec("mlp", MLP_PACK))
    monkey_patching.register_patch_mapping({"LlamaRMSNorm": UserNorm})
    hfpatch_core.enable("qkv,mlp")
    first = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(first.model.norm) is UserNorm
    assert monkey_patching.get_patch_mapping() == {"LlamaRMSNorm": UserNorm}  # only the user's entry
    monkey_patching.clear_patch_mapping()
    second = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert layer_classes(second) == layer_classes(first) == {("PackMLP", "FusedQKVAttention")}
    assert type(second.model.norm) is modeling_llama.LlamaRMSNorm  # the clear removed the user's entry
    # the packs decided alike; the user's norm, foreign to hfpatch, was in the first model only
    assert [f.name for f in plan_of(first).foreign] == ["LlamaRMSNorm"] and plan_of(second).foreign == ()
    assert plan_of(second).fingerprint != plan_of(first).fingerprint
    assert plan_of(second).fingerprint == dataclasses.replace(plan_of(first), foreign=()).fingerprint
    torch.testing.assert_close(logits(second), vanilla, rtol=0, atol=1e-5)
    snapshot.assert_unchanged()
    monkey_patching.clear_patch_mapping()
    assert_vanilla_afterwards(llama_checkpoint, vanilla)
    snapshot.assert_unchanged()


def test_a_clear_then_a_registration_during_the_load_keeps_the_third_partys_entry(
    install, llama_checkpoint, snapshot
) -> None:
    """A third party that clears and registers its own mapping during the load keeps it;
    hfpatch removes only what it registered and finds still there."""
    install(PackSpec("mlp", MLP_PACK))
    post_init = modeling_utils.PreTrainedModel.post_init

    class TheirMLP(modeling_llama.LlamaMLP):
        pass

    def clearing_post_init(self):
        monkey_patching.clear_patch_mapping()
        monkey_patching.register_patch_mapping({"LlamaMLP": TheirMLP, "LlamaRMSNorm": UserNorm})
        return post_init(self)

    hfpatch_core.enable("mlp")
    modeling_utils.PreTrainedModel.post_init = clearing_post_init
    try:
        with pytest.warns(PackWarning, match="entry 'LlamaMLP' of this load became .*TheirMLP"):
            model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    finally:
        modeling_utils.PreTrainedModel.post_init = post_init
    assert layer_classes(model) == {("PackMLP", "LlamaAttention")}
    assert monkey_patching.get_patch_mapping() == {"LlamaMLP": TheirMLP, "LlamaRMSNorm": UserNorm}
    monkey_patching.clear_patch_mapping()
    snapshot.assert_unchanged()
