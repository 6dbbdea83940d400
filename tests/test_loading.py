from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, monkey_patching
from transformers.models.llama import modeling_llama

import hfpatch_core
from conftest import tiny_llama_config
from hfpatch_core import PackError, PackWarning, PatchConflictError, plan_of
from packs import MLP_PACK, NORM_PATTERN_PACK, PackSpec, mlp_pack


def mlp_class(model) -> str:
    return type(model.model.layers[0].mlp).__name__


def norm_class(model) -> str:
    return type(model.model.norm).__name__


def logits(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def test_every_load_path_is_patched_and_leaves_nothing_behind(install, llama_checkpoint, snapshot) -> None:
    install(PackSpec("mlp", MLP_PACK), PackSpec("norm", NORM_PATTERN_PACK))
    vanilla = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    hfpatch_core.enable()
    config = AutoConfig.from_pretrained(llama_checkpoint)
    loads = {
        "auto from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(llama_checkpoint),
        "class from_pretrained": lambda: LlamaForCausalLM.from_pretrained(llama_checkpoint),
        "auto from_config": lambda: AutoModelForCausalLM.from_config(config),
        "class _from_config": lambda: LlamaForCausalLM._from_config(config),
    }
    for how, load in loads.items():
        model = load()
        assert (mlp_class(model), norm_class(model)) == ("PackMLP", "PackNorm"), how
        snapshot.assert_unchanged()
    patched = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    torch.testing.assert_close(logits(patched), logits(vanilla), rtol=0, atol=1e-5)
    hfpatch_core.disable()
    assert mlp_class(AutoModelForCausalLM.from_pretrained(llama_checkpoint)) == "LlamaMLP"
    snapshot.assert_unchanged()


def test_the_model_exposes_its_plan_and_logs_it(install, llama_checkpoint, caplog) -> None:
    install(PackSpec("mlp", MLP_PACK, version="1.2.3"), PackSpec("norm", NORM_PATTERN_PACK))
    hfpatch_core.enable()
    with caplog.at_level(logging.INFO, logger="hfpatch"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    plan = plan_of(model)
    assert plan is not None and plan.context.model_type == "llama"
    assert plan.context.model_class_name == "LlamaForCausalLM"
    assert {("mlp", "1.2.3"), ("norm", "1.0.0")} <= set(plan.packs)
    assert plan.replaced["LlamaMLP"].pack == "mlp" and plan.replaced["LlamaRMSNorm"].pack == "norm"
    assert [record.getMessage() for record in caplog.records] == [plan.summary()]
    assert "LlamaMLP <- PackMLP [mlp==1.2.3]" in plan.summary() and plan.fingerprint in plan.summary()
    assert plan_of(AutoModelForCausalLM.from_pretrained(llama_checkpoint)).fingerprint == plan.fingerprint
    hfpatch_core.enable("mlp")
    assert plan_of(AutoModelForCausalLM.from_pretrained(llama_checkpoint)).fingerprint != plan.fingerprint


def test_a_target_no_class_of_transformers_has_is_the_packs_failure(install, llama_checkpoint, caplog) -> None:
    install(PackSpec("ghost", mlp_pack("GhostMLP", target="LlamaNonexistentClass")), PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    with caplog.at_level(logging.INFO, logger="hfpatch"), pytest.warns(PackWarning) as caught:
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert [str(w.message) for w in caught] == [
        "pack 'ghost': patch target 'LlamaNonexistentClass' matches no module class of the installed transformers "
        "(transformers.models, or any loaded transformers module); the pack is skipped, it would replace nothing. "
        "Check the class name (renamed in this release?)."
    ]
    plan = plan_of(model)
    assert dict(plan.packs) == {"mlp": "1.0.0"} and mlp_class(model) == "PackMLP"
    assert "Ghost" not in caplog.text and "LlamaNonexistentClass" not in plan.summary()
    hfpatch_core.enable("ghost", strict=True)
    with pytest.raises(PackError, match="'LlamaNonexistentClass' matches no module class"):
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)


def test_a_catch_all_pattern_names_its_pack_and_pattern_when_the_load_fails(
    install, llama_checkpoint, snapshot
) -> None:
    install(PackSpec("everything", mlp_pack("AnyMLP", target=".*")))
    hfpatch_core.enable("everything")
    with pytest.raises(PackError) as raised:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    error = raised.value
    assert error.pack == "everything" and error.stage == "load"
    assert str(error).startswith(
        "pack 'everything': pattern '.*' (-> hfpatch_test_pack_everything.AnyMLP) matches LlamaForCausalLM, "
        "the model class itself"
    )
    assert error.__cause__ is not None  # what transformers raised (which depends on the modules loaded)
    hfpatch_core.disable()
    snapshot.assert_unchanged()


def test_the_summary_names_only_the_classes_replaced() -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP

    from hfpatch_core import Claim, LoadContext, Patch
    from hfpatch_core._pipeline.resolution import resolve

    claims = [
        Claim("p", "1.0", Patch(target, LlamaMLP), 0, index) for index, target in enumerate(["LlamaMLP", "MistralMLP"])
    ]
    context = LoadContext("llama", "LlamaForCausalLM")
    plan = resolve(claims, context=context, class_names=["LlamaMLP", "LlamaRMSNorm"])
    assert plan.summary().startswith("hfpatch: LlamaForCausalLM: LlamaMLP <- LlamaMLP [p==1.0] (plan ")
    plan = resolve(claims[1:], context=context, class_names=["LlamaMLP", "LlamaRMSNorm"])
    assert len(plan.entries) == 1 and not plan.replaced
    assert plan.summary().startswith("hfpatch: LlamaForCausalLM: no patch applied (plan ")


def test_priority_decides_and_the_env_can_override_it(install, llama_checkpoint, monkeypatch) -> None:
    install(
        PackSpec("low", mlp_pack("LowMLP", priority=1)),
        PackSpec("high", mlp_pack("HighMLP", priority=2)),
    )
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert mlp_class(model) == "HighMLP"
    lost = plan_of(model).lost
    assert [(item.claim.pack, item.winner.pack) for item in lost] == [("low", "high")]
    monkeypatch.setenv("HF_PATCH_PACKS", "all,low@+5")
    hfpatch_core.enable()
    assert mlp_class(AutoModelForCausalLM.from_pretrained(llama_checkpoint)) == "LowMLP"


def test_a_tie_raises_before_anything_is_registered(install, llama_checkpoint, snapshot) -> None:
    install(PackSpec("alpha", mlp_pack("AlphaMLP")), PackSpec("beta", mlp_pack("BetaMLP")))
    hfpatch_core.enable()
    with pytest.raises(PatchConflictError, match="packs 'alpha' and 'beta' both replace 'LlamaMLP'"):
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    snapshot.assert_unchanged()
    hfpatch_core.enable("alpha,beta@+1")
    assert mlp_class(AutoModelForCausalLM.from_pretrained(llama_checkpoint)) == "BetaMLP"


def test_direct_registration_stays_unless_a_claim_overwrites(install, llama_checkpoint, hfpatch_isolation) -> None:
    hfpatch_isolation.allow_changes()  # the user's registration stays after the test's loads, as it should

    class UserMLP(modeling_llama.LlamaMLP):
        pass

    monkey_patching.register_patch_mapping({"LlamaMLP": UserMLP})
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    # the user's entry keeps the selected pack out, and the load says so (issue 52.1)
    with pytest.warns(PackWarning, match=r"pack 'mlp' does not replace LlamaMLP for this load.*no pack made it"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert mlp_class(model) == "UserMLP"
    assert "already registered with register_patch_mapping" in plan_of(model).lost[0].reason
    install(PackSpec("forcing", mlp_pack("ForcingMLP", overwrite=True, priority=1)))
    hfpatch_core.enable()
    # overwrite=True wins over the user's entry, and the load says so (a foreign replacement, test_foreign)
    with pytest.warns(PackWarning, match=r"pack 'forcing' replaces LlamaMLP .*no pack made it"):
        assert mlp_class(AutoModelForCausalLM.from_pretrained(llama_checkpoint)) == "ForcingMLP"
    assert monkey_patching.get_patch_mapping() == {"LlamaMLP": UserMLP}  # the user's entry came back


def test_a_load_that_raises_leaves_everything_as_before(install, llama_checkpoint, snapshot) -> None:
    install(PackSpec("norm", NORM_PATTERN_PACK), PackSpec("broken", mlp_pack("BrokenMLP", init_raises=True)))
    hfpatch_core.enable()
    expected = (
        r"pack 'broken': hfpatch_test_pack_broken.BrokenMLP \(replacing 'LlamaMLP'\) raised RuntimeError: "
        r"replacement init failed while building LlamaForCausalLM; the load was undone"
    )
    with pytest.raises(PackError, match=expected) as caught:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert caught.value.pack == "broken" and isinstance(caught.value.__cause__, RuntimeError)
    snapshot.assert_unchanged()
    with pytest.raises(PackError, match="replacement init failed"):
        LlamaForCausalLM._from_config(tiny_llama_config())
    snapshot.assert_unchanged()
    assert modeling_llama.LlamaRMSNorm.__name__ == "LlamaRMSNorm"


BAD_PACKS = {
    "import error": (
        "raise ImportError('no such kernel')\n",
        "failed to import 'hfpatch_test_pack_bad': ImportError: no such kernel",
    ),
    "hook raises": (
        "from hfpatch_core import hookimpl\n@hookimpl\ndef provide_patches(context):\n    raise KeyError('oops')\n",
        r"provide_patches\(\) raised KeyError: 'oops'",
    ),
    "returns None": (
        "from hfpatch_core import hookimpl\n@hookimpl\ndef provide_patches(context):\n    pass\n",
        r"provide_patches\(\) returned None; return an empty list",
    ),
    "returns a dict": (
        "from hfpatch_core import hookimpl\nimport torch\n@hookimpl\ndef provide_patches(context):\n"
        "    return {'LlamaMLP': torch.nn.Identity}\n",
        r"returned dict .* return a list of Patch or Refusal objects",
    ),
    "returns a class": (
        "from hfpatch_core import hookimpl\nimport torch\n@hookimpl\ndef provide_patches(context):\n"
        "    return [torch.nn.Identity]\n",
        r"returned type <class 'torch.nn.modules.linear.Identity'> among its results; every item must be a Patch",
    ),
    "builds a bad patch": (
        "from hfpatch_core import hookimpl, Patch\nimport torch\n@hookimpl\ndef provide_patches(context):\n"
        "    return [Patch('LlamaMLP', torch.nn.Identity())]\n",
        r"pack 'bad': provide_patches\(\) built an invalid value: Patch\('LlamaMLP'\): .* got an instance of Identity",
    ),
    "bad regex": (
        "from hfpatch_core import hookimpl, Patch\nimport torch\n@hookimpl\ndef provide_patches(context):\n"
        "    return [Patch('(Llama', torch.nn.Identity)]\n",
        r"pack 'bad': .*'\(Llama' is not a valid regular expression",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PACKS))
def test_a_failing_pack_warns_once_and_the_others_still_apply(case, install, llama_checkpoint, snapshot) -> None:
    source, message = BAD_PACKS[case]
    install(PackSpec("bad", source), PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    with pytest.warns(PackWarning, match=message) as caught:
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert len([w for w in caught if issubclass(w.category, PackWarning)]) == 1
    active = {name for name, _ in plan_of(model).packs}
    assert mlp_class(model) == "PackMLP" and "mlp" in active and "bad" not in active
    snapshot.assert_unchanged()


@pytest.mark.parametrize("case", sorted(BAD_PACKS))
def test_strict_mode_raises_before_anything_is_registered(
    case, install, llama_checkpoint, snapshot, monkeypatch
) -> None:
    source, message = BAD_PACKS[case]
    install(PackSpec("bad", source), PackSpec("mlp", MLP_PACK))
    monkeypatch.setenv("HF_PATCH_STRICT", "1")
    hfpatch_core.enable()
    seen: list[object] = []
    original = monkey_patching.register_patch_mapping
    monkeypatch.setattr(monkey_patching, "register_patch_mapping", lambda *a, **k: seen.append(a) or original(*a, **k))
    with pytest.raises(PackError, match=message) as caught:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert caught.value.pack == "bad" and seen == []
    snapshot.assert_unchanged()


def test_strict_env_must_be_a_boolean(monkeypatch) -> None:
    monkeypatch.setenv("HF_PATCH_STRICT", "maybe")
    with pytest.raises(ValueError, match="HF_PATCH_STRICT='maybe' is not a boolean"):
        hfpatch_core.enable()


def test_context_reaches_the_hook(install, llama_checkpoint) -> None:
    source = """
from hfpatch_core import hookimpl
seen = []
@hookimpl
def provide_patches(context):
    seen.append(context)
    return []
"""
    install(PackSpec("spy", source))
    hfpatch_core.enable()
    LlamaForCausalLM.from_pretrained(llama_checkpoint)
    AutoModelForCausalLM.from_config(tiny_llama_config(num_hidden_layers=1))
    import hfpatch_test_pack_spy as spy

    first, second = spy.seen
    assert (first.model_type, first.model_class_name, first.config.num_hidden_layers) == (
        "llama",
        "LlamaForCausalLM",
        2,
    )
    assert second.config.num_hidden_layers == 1 and first.parent is None
    assert first.transformers_version == __import__("transformers").__version__


def test_the_hook_sees_the_config_the_model_is_built_with(install, llama_checkpoint) -> None:
    # Config keyword arguments and loader options are applied before the packs are asked,
    # and the context holds the model's own config object (transformers read config.json once).
    source = """
from hfpatch_core import hookimpl
seen = []
@hookimpl
def provide_patches(context):
    seen.append(context.config)
    return []
"""
    install(PackSpec("spy", source))
    hfpatch_core.enable()
    model = LlamaForCausalLM.from_pretrained(
        llama_checkpoint, num_hidden_layers=1, attn_implementation="eager", dtype=torch.bfloat16
    )
    built = AutoModelForCausalLM.from_config(tiny_llama_config(), attn_implementation="sdpa")
    import hfpatch_test_pack_spy as spy

    loaded, configured = spy.seen
    assert loaded is model.config and configured is built.config
    assert (loaded.num_hidden_layers, len(model.model.layers)) == (1, 1)
    assert (loaded._attn_implementation, loaded.dtype) == ("eager", torch.bfloat16)
    assert configured._attn_implementation == "sdpa"


def test_patched_applies_packs_to_manual_construction(install, snapshot) -> None:
    install(PackSpec("mlp", MLP_PACK))
    config = tiny_llama_config()
    with hfpatch_core.patched(config, model_class=LlamaForCausalLM) as plan:
        model = LlamaForCausalLM(config)
    assert mlp_class(model) == "PackMLP" and plan.replaced["LlamaMLP"].pack == "mlp"
    assert mlp_class(LlamaForCausalLM(config)) == "LlamaMLP"
    with hfpatch_core.patched("llama") as plan:
        assert plan.context.model_class_name == "LlamaForCausalLM"  # what hfpatch check and a causal LM load say
        assert mlp_class(LlamaForCausalLM(config)) == "PackMLP"
    snapshot.assert_unchanged()


def test_no_selected_pack_means_plain_transformers(install, llama_checkpoint, monkeypatch) -> None:
    install(PackSpec("mlp", MLP_PACK))
    monkeypatch.setenv("HF_PATCH_PACKS", "none")
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert mlp_class(model) == "LlamaMLP" and plan_of(model) is None


def test_a_loader_that_skips_apply_patches_loads_vanilla_and_says_so(
    install, llama_checkpoint, monkeypatch, caplog
) -> None:
    # A from_pretrained that builds its model without transformers' apply_patches (as a
    # remote-code or third-party loader may) never asks for a plan: nothing is applied,
    # and the log says so instead of attaching a plan the model does not have.
    import contextlib

    from transformers import modeling_utils

    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    monkeypatch.setattr(modeling_utils, "apply_patches", contextlib.nullcontext)
    with caplog.at_level(logging.WARNING, logger="hfpatch"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert mlp_class(model) == "LlamaMLP" and plan_of(model) is None
    assert "LlamaForCausalLM was built without transformers' apply_patches; no pack applied" in caplog.text
    assert monkey_patching.get_patch_mapping() == {}
    monkeypatch.undo()  # before disable(), which puts transformers' own apply_patches back
    hfpatch_core.disable()
    assert modeling_utils.apply_patches is monkey_patching.apply_patches
