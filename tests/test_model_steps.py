"""Model steps (``provide_model_steps``): a pack's change to the loaded model itself, planned,
resolved, installed after the load (and by ``apply``), recorded, and uninstalled by ``revert``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import HFPATCH, run
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import hfpatch_core
from hfpatch_core import (
    ApplyError,
    InvalidPatchError,
    LockError,
    ModelStep,
    PackError,
    PackWarning,
    PatchConflictError,
    Refused,
    plan_of,
)
from hfpatch_core.settings import strict_for
from hfpatch_core.testing.zoo import verdict_of
from packs import MLP_PACK, PackSpec

#: Marks the model it is installed on (an instance attribute, nothing global); refuses a model
#: whose config says ``refuse_steps``.
STEP_PACK = """
    from hfpatch_core import ModelStep, Refusal, hookimpl

    def install(model):
        if getattr(model.config, "refuse_steps", False):
            return Refusal("{target}", "this model asked to be refused")
        model.stepped = "{name}"
        return None

    def uninstall(model):
        del model.stepped

    @hookimpl
    def provide_model_steps(context):
        if context.model_type != "llama":
            return []
        return [ModelStep("{target}", install, uninstall, priority={priority})]
"""


def step_pack(name: str, *, target: str = "marker", priority: int = 0) -> PackSpec:
    return PackSpec(name, STEP_PACK.format(name=name, target=target, priority=priority))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("", print, print), "non-empty name"),
        (("loss", None, print), "install must be a callable"),
        (("loss", print, 3), "uninstall must be a callable"),
    ],
)
def test_a_model_step_is_validated(arguments: tuple[object, ...], message: str) -> None:
    with pytest.raises(InvalidPatchError, match=message):
        ModelStep(*arguments)  # type: ignore[arg-type]


def test_a_load_installs_the_step_on_its_model_only(install, llama_checkpoint: Path) -> None:
    install(step_pack("stepper"))
    with hfpatch_core.enabled(packs="stepper"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    plan = plan_of(model)
    assert plan is not None
    assert [(claim.pack, claim.target) for claim in plan.steps] == [("stepper", "marker")]
    assert plan.installed_steps == plan.steps
    assert model.stepped == "stepper"
    assert "step marker [stepper==1.0.0]" in plan.summary()
    # the scope ends: nothing of the step is on the class or on a later load
    later = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert not hasattr(later, "stepped")
    assert not hasattr(LlamaForCausalLM, "stepped")
    hfpatch_core.revert(model)
    assert not hasattr(model, "stepped")
    assert plan_of(model).steps == () and plan_of(model).packs == plan.packs


def test_a_strict_load_makes_what_its_steps_do_later_strict(install, llama_checkpoint: Path, monkeypatch) -> None:
    # a step (chunked-loss's) that finds at a training step that another library computes it asks
    # strict_for(model): the load's mode, though the plan touches no weight, or the environment now
    monkeypatch.delenv("HF_PATCH_STRICT", raising=False)
    install(step_pack("stepper"), PackSpec("mlp", MLP_PACK))
    with hfpatch_core.enabled(packs="stepper", strict=True):
        strict = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    with hfpatch_core.enabled(packs="stepper"):
        lenient = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    # apply() on a loaded model (as after a trainer wrapped it) holds no strict mode of its own: its save
    # guard's strictness is the guard's, not what the model's steps do later
    applied = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    hfpatch_core.apply(applied, packs="stepper,mlp")
    assert not plan_of(strict).touches_weights and plan_of(strict).steps
    assert plan_of(applied).touches_weights and plan_of(applied).steps
    assert strict_for(strict) and not strict_for(lenient) and not strict_for(applied)
    monkeypatch.setenv("HF_PATCH_STRICT", "1")
    assert strict_for(lenient) and strict_for(applied)


def test_the_fingerprint_names_the_steps(install, llama_checkpoint: Path) -> None:
    install(step_pack("stepper"), PackSpec("mlp", MLP_PACK))
    with hfpatch_core.enabled(packs="mlp"):
        without = plan_of(AutoModelForCausalLM.from_pretrained(llama_checkpoint))
    with hfpatch_core.enabled(packs="mlp,stepper"):
        with_step = plan_of(AutoModelForCausalLM.from_pretrained(llama_checkpoint))
    assert without is not None and with_step is not None
    assert without.fingerprint != with_step.fingerprint


def test_a_step_refused_at_install_is_on_the_plan_with_its_reason(install, llama_checkpoint: Path) -> None:
    install(step_pack("stepper"))
    with hfpatch_core.enabled(packs="stepper"):
        config = AutoConfig.from_pretrained(llama_checkpoint)
        config.refuse_steps = True
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, config=config)
    plan = plan_of(model)
    assert plan is not None
    assert Refused("stepper", "1.0.0", "marker", "this model asked to be refused") in plan.refused
    assert plan.installed_steps == ()
    assert not hasattr(model, "stepped")
    assert "marker refused by stepper: this model asked to be refused" in plan.summary()


def test_two_packs_on_one_target_resolve_by_priority(install, llama_checkpoint: Path) -> None:
    install(step_pack("first"), step_pack("second", priority=1))
    with hfpatch_core.enabled(packs="first,second"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    plan = plan_of(model)
    assert plan is not None
    assert model.stepped == "second"
    assert [claim.pack for claim in plan.steps] == ["second"]
    [(lost, reason)] = plan.lost_steps
    assert lost.pack == "first" and "priority 0 < 1" in reason


def test_two_packs_tied_on_one_target_are_a_conflict(install, llama_checkpoint: Path) -> None:
    install(step_pack("first"), step_pack("second"))
    with hfpatch_core.enabled(packs="first,second"), pytest.raises(PatchConflictError, match="'marker'") as error:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    # the remedy is a selection checked to settle the tie, as for patches
    assert "HF_PATCH_PACKS=first,second@+1" in str(error.value) or "HF_PATCH_PACKS=first@+1,second" in str(
        error.value
    ), str(error.value)
    with hfpatch_core.enabled(packs="first,second@+1"):
        assert AutoModelForCausalLM.from_pretrained(llama_checkpoint).stepped == "second"


def test_apply_installs_the_steps_and_revert_uninstalls_them(install, llama_checkpoint: Path) -> None:
    install(step_pack("stepper"), PackSpec("mlp", MLP_PACK))
    for packs in ("stepper", "stepper,mlp"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
        plan = hfpatch_core.apply(model, packs=packs)
        assert model.stepped == "stepper"
        assert [claim.target for claim in plan.installed_steps] == ["marker"]
        assert plan_of(model) is plan
        hfpatch_core.revert(model)
        assert not hasattr(model, "stepped")
        assert plan_of(model) is None
        assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


@pytest.mark.release_independent
def test_explain_lock_and_provenance_record_the_step(install, llama_checkpoint: Path, tmp_path: Path) -> None:
    site = install(step_pack("stepper"))
    shown = run(HFPATCH, "explain", str(llama_checkpoint), site=site, env={"HF_PATCH_PACKS": "stepper"})
    assert shown.returncode == 0, shown.stderr
    assert "Model steps, installed on the loaded model" in shown.stdout
    assert "marker: hfpatch_test_pack_stepper.install [stepper 1.0.0]" in shown.stdout
    data = json.loads(
        run(HFPATCH, "explain", str(llama_checkpoint), "--json", site=site, env={"HF_PATCH_PACKS": "stepper"}).stdout
    )
    assert [(step["pack"], step["target"]) for step in data["steps"]] == [("stepper", "marker")]
    lock = tmp_path / "hfpatch.lock"
    written = run(
        HFPATCH, "lock", "--model", str(llama_checkpoint), "-o", str(lock), site=site, env={"HF_PATCH_PACKS": "stepper"}
    )
    assert written.returncode == 0, written.stderr
    assert json.loads(lock.read_text())["plans"]["llama"]["steps"] == [
        "marker -> hfpatch_test_pack_stepper.install [stepper==1.0.0, priority 0]"
    ]
    with hfpatch_core.enabled(packs="stepper", lock=lock):
        assert AutoModelForCausalLM.from_pretrained(llama_checkpoint).stepped == "stepper"
    # a lock without the step (written before the pack offered it) refuses the load, naming the steps
    written_json = json.loads(lock.read_text())
    del written_json["plans"]["llama"]["steps"]
    lock.write_text(json.dumps(written_json))
    with pytest.raises(LockError, match="model steps"), hfpatch_core.enabled(packs="stepper", lock=lock):
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)


def test_a_saved_patched_model_records_its_steps(install, llama_checkpoint: Path, tmp_path: Path) -> None:
    # a model with steps alone saves vanilla's weights as vanilla does (no save guard, no record)
    install(step_pack("stepper"), PackSpec("mlp", MLP_PACK))
    with hfpatch_core.enabled(packs="stepper,mlp"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    model.save_pretrained(tmp_path / "saved")
    recorded = json.loads((tmp_path / "saved" / "hfpatch_provenance.json").read_text())
    assert recorded["steps"] == {"marker": "hfpatch_test_pack_stepper.install [stepper]"}


#: A step that makes the training loss wrong by one part in a thousand (what verify must catch).
SKEWED_STEP_PACK = """
    import functools
    from hfpatch_core import ModelStep, hookimpl

    def install(model):
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            if out.loss is not None and model.training:
                out.loss = out.loss * {factor}
            return out

        model.forward = forward

    def uninstall(model):
        del model.forward

    @hookimpl
    def provide_model_steps(context):
        return [ModelStep("causal-lm-loss", install, uninstall)] if context.model_type == "llama" else []
"""


@pytest.mark.parametrize(("factor", "verdict"), [("1.0", "exact"), ("1.001", "failed")])
def test_verify_checks_a_steps_training_loss_against_vanilla(
    install, llama_checkpoint: Path, tmp_path: Path, factor: str, verdict: str
) -> None:
    install(PackSpec("skewed", SKEWED_STEP_PACK.format(factor=factor)))
    row = verdict_of("skewed", "llama", tmp_path, checkpoint=llama_checkpoint, generate_tokens=2)
    assert row.verdict == verdict, row.detail
    assert row.report.steps == ["causal-lm-loss [skewed]"]
    if verdict == "exact":
        assert row.detail == "model step causal-lm-loss [skewed]"
        assert row.report.apply_path is True
    else:
        assert "training loss" in row.detail


#: A step that scales the head's gradient (the loss right): what verify must catch in the gradients.
SKEWED_GRADIENT_PACK = """
    from hfpatch_core import ModelStep, hookimpl

    HOOKS = {{}}

    def install(model):
        HOOKS[id(model)] = model.lm_head.weight.register_hook(lambda grad: grad * {factor})

    def uninstall(model):
        HOOKS.pop(id(model)).remove()

    @hookimpl
    def provide_model_steps(context):
        return [ModelStep("causal-lm-loss", install, uninstall)] if context.model_type == "llama" else []
"""


@pytest.mark.parametrize(("factor", "verdict"), [("1.0", "exact"), ("1.001", "failed")])
def test_verify_checks_a_steps_gradients_against_vanilla(
    install, llama_checkpoint: Path, tmp_path: Path, factor: str, verdict: str
) -> None:
    install(PackSpec("skewed", SKEWED_GRADIENT_PACK.format(factor=factor)))
    row = verdict_of("skewed", "llama", tmp_path, checkpoint=llama_checkpoint, generate_tokens=2)
    assert row.verdict == verdict, row.detail
    if verdict == "failed":
        # one part in a thousand of the head's gradient is above a float32 reordering's 16 ulps of it
        assert "gradients differ from vanilla's by" in row.detail and "(lm_head.weight, whose largest" in row.detail
        assert "training loss" not in row.detail


#: A step whose install raises: a pack failure at the load, the model loaded without it.
RAISING_STEP_PACK = """
    from hfpatch_core import ModelStep, hookimpl

    def install(model):
        raise RuntimeError("no head here")

    @hookimpl
    def provide_model_steps(context):
        return [ModelStep("marker", install, lambda model: None)] if context.model_type == "llama" else []
"""


def test_a_step_that_raises_is_a_pack_failure_and_the_model_stays_loaded(install, llama_checkpoint: Path) -> None:
    install(PackSpec("raising", RAISING_STEP_PACK))
    with hfpatch_core.enabled(packs="raising", strict=False), pytest.warns(PackWarning, match="no head here"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    plan = plan_of(model)
    assert plan is not None and plan.installed_steps == ()
    assert Refused("raising", "1.0.0", "marker", "install raised RuntimeError") in plan.refused
    with hfpatch_core.enabled(packs="raising", strict=True), pytest.raises(PackError, match="no head here"):
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)


def test_apply_refuses_a_model_that_holds_steps(install, llama_checkpoint: Path) -> None:
    install(step_pack("stepper"))
    with hfpatch_core.enabled(packs="stepper"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    with pytest.raises(ApplyError, match="holds model steps already \\(marker of pack 'stepper'\\)"):
        hfpatch_core.apply(model, packs="stepper")
    hfpatch_core.revert(model)
    hfpatch_core.apply(model, packs="stepper")
    assert model.stepped == "stepper"


#: A step on every model that prints from its install, as some models print from their forward.
PRINTING_STEP_PACK = """
    from hfpatch_core import ModelStep, hookimpl

    def install(model):
        print("Warning: a model printed this")

    @hookimpl
    def provide_model_steps(context):
        return [ModelStep("marker", install, lambda model: None)] if context.config is not None else []
"""


def test_verify_all_model_types_keeps_stdout_for_its_json(install) -> None:
    site = install(PackSpec("printing", PRINTING_STEP_PACK))
    arguments = ["verify", "printing", "--all-model-types", "--model-type", "llama", "--model-type", "reformer"]
    done = run(HFPATCH, *arguments, "--json", site=site, env={"HF_PATCH_PACKS": "printing"}, timeout=300)
    rows = {row["model_type"]: row for row in json.loads(done.stdout)["rows"]}
    assert "a model printed this" in done.stderr
    assert rows["llama"]["verdict"] == "exact", rows["llama"]["detail"]
    # vanilla reformer cannot take a training step on its tiny checkpoint (axial shapes): the tooling's
    # problem, not the step's
    assert rows["reformer"]["verdict"] == "no checkpoint"
    assert rows["reformer"]["detail"].startswith("vanilla transformers cannot run a training step on it")


def test_list_finds_a_tie_between_model_steps_and_the_selection_settling_it(
    install, llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hfpatch_core._pipeline.conflicts import find_conflicts
    from hfpatch_core._pipeline.selection import current_selection
    from hfpatch_core._runtime.snapshot import HOOK_GUARD

    install(step_pack("first"), step_pack("second"))
    monkeypatch.setenv("HF_PATCH_PACKS", "first,second")
    conflicts = find_conflicts(current_selection(), guard=HOOK_GUARD)
    assert [(c.model_type, c.target, c.packs) for c in conflicts.conflicts] == [
        ("llama", "marker", ("first", "second"))
    ]
    assert conflicts.selection is not None
    with hfpatch_core.enabled(packs=conflicts.selection):
        assert AutoModelForCausalLM.from_pretrained(llama_checkpoint).stepped in ("first", "second")
