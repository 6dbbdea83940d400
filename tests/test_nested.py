from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

import hfpatch_core
from conftest import tiny_llama_config
from hfpatch_core import WeightLayoutError, plan_of
from hfpatch_core._compat import class_keys_supported
from packs import MLP_PACK, PackSpec, fused_qkv_pack

SPY = """
from hfpatch_core import hookimpl
seen = []
@hookimpl
def provide_patches(context):
    seen.append(context)
    return []
"""


@pytest.fixture(scope="module")
def llava_checkpoint(tmp_path_factory):
    """A tiny composite model: a CLIP vision tower and a llama text model, built from a config."""
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    config = LlavaConfig(vision_config=vision, text_config=tiny_llama_config(), image_token_index=127)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llava")
    LlavaForConditionalGeneration(config).save_pretrained(path)
    return path


def text_logits(model) -> torch.Tensor:
    ids = torch.randint(0, 127, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_sub_model_sees_its_own_context_with_the_outer_one_as_parent(install, llava_checkpoint) -> None:
    install(PackSpec("spy", SPY))
    hfpatch_core.enable()
    AutoModelForImageTextToText.from_pretrained(llava_checkpoint)
    import hfpatch_test_pack_spy as spy

    seen = [
        (context.model_type, context.model_class_name, getattr(context.parent, "model_type", None))
        for context in spy.seen
    ]
    assert seen[0] == ("llava", "LlavaForConditionalGeneration", None)
    assert ("llama", "LlamaModel", "llava") in seen and ("clip_vision_model", "CLIPVisionModel", "llava") in seen
    text = next(context for context in spy.seen if context.model_type == "llama")
    assert text.root is spy.seen[0] and text.config.num_hidden_layers == 2


def test_a_llama_pack_applies_to_the_text_model_of_a_composite_load(install, llava_checkpoint, snapshot) -> None:
    vanilla = AutoModelForImageTextToText.from_pretrained(llava_checkpoint)
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    model = AutoModelForImageTextToText.from_pretrained(llava_checkpoint)
    assert type(model.model.language_model.layers[0].mlp).__name__ == "PackMLP"
    plan = plan_of(model)
    assert not plan.entries and [inner.context.model_type for inner in plan.nested if inner.entries] == ["llama"]
    assert "inside, LlamaModel: LlamaMLP <- PackMLP [mlp==1.0.0]" in plan.summary()
    torch.testing.assert_close(text_logits(model), text_logits(vanilla), rtol=0, atol=1e-5)
    snapshot.assert_unchanged()


def test_sub_model_converters_keep_their_scoping(install, llava_checkpoint, tmp_path, snapshot) -> None:
    vanilla = AutoModelForImageTextToText.from_pretrained(llava_checkpoint)
    install(PackSpec("qkv", fused_qkv_pack()))
    hfpatch_core.enable()
    if not class_keys_supported():
        # transformers 5.3 applies the root model type's conversions only: the text model's
        # converter cannot run, and hfpatch says so instead of leaving random weights
        missing = r"language_model\.layers\.0\.self_attn\.qkv_proj\.weight \(checkpoint key: [^)]*\): missing"
        with pytest.raises(WeightLayoutError, match=missing):
            AutoModelForImageTextToText.from_pretrained(llava_checkpoint)
        snapshot.assert_unchanged()
        return
    model = AutoModelForImageTextToText.from_pretrained(llava_checkpoint)
    assert type(model.model.language_model.layers[0].self_attn).__name__ == "FusedQKVAttention"
    torch.testing.assert_close(text_logits(model), text_logits(vanilla), rtol=0, atol=1e-5)
    snapshot.assert_unchanged()
    model.save_pretrained(tmp_path / "saved")
    hfpatch_core.disable()
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(text_logits(reloaded), text_logits(vanilla), rtol=0, atol=1e-5)


TORCH_STATE_SPY = """
import torch
from hfpatch_core import hookimpl
seen = []
@hookimpl
def provide_patches(context):
    seen.append((
        context.model_type,
        str(torch.empty(0).device),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
    ))
    return []
"""


def test_hooks_see_a_plain_torch_state_whatever_the_load_runs_under(install, llava_checkpoint) -> None:
    # a nested load runs under transformers' meta device and the load's dtype, apply() under
    # no_grad, a user's load often under inference_mode: a hook that probes modules must see none of it
    install(PackSpec("torchspy", TORCH_STATE_SPY))
    import hfpatch_test_pack_torchspy as spy

    with torch.inference_mode(), hfpatch_core.enabled(packs="torchspy"):
        model = AutoModelForImageTextToText.from_pretrained(llava_checkpoint, dtype=torch.bfloat16)
    vanilla = LlavaForConditionalGeneration.from_pretrained(llava_checkpoint)
    hfpatch_core.apply(vanilla, packs="torchspy")
    types = {model_type for model_type, *_ in spy.seen}
    assert {"llava", "llama", "clip_vision_model"} <= types
    assert {tuple(state) for _, *state in spy.seen} == {("cpu", torch.float32, True, False)}
    assert torch.get_default_dtype() == torch.float32 and model.dtype == torch.bfloat16


OUTER_NORM = """
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from hfpatch_core import Patch, hookimpl

class OuterRMSNorm(LlamaRMSNorm):
    pass

@hookimpl
def provide_patches(context):
    # claimed in the composite's own load only: the class is built by its text model's load
    if context.model_type == "llava":
        return [Patch("LlamaRMSNorm", OuterRMSNorm)]
    return []
"""


def test_a_class_claimed_outside_but_built_by_a_nested_load_is_in_the_plan(install, llava_checkpoint) -> None:
    """issue 38.5: the replacement is made inside the text model's load, from the outer load's
    registration; the outer plan says so (verify compares every replaced module with the plans)."""
    install(PackSpec("outer", OUTER_NORM))
    hfpatch_core.enable()
    model = AutoModelForImageTextToText.from_pretrained(llava_checkpoint)
    assert type(model.model.language_model.norm).__name__ == "OuterRMSNorm"
    plan = plan_of(model)
    assert plan.replaced["LlamaRMSNorm"].patch.replacement.__name__ == "OuterRMSNorm"
    assert "LlamaRMSNorm <- OuterRMSNorm [outer==1.0.0]" in plan.summary()


def test_nested_loads_names_the_sub_models_a_composite_loads_on_their_own() -> None:
    from transformers import PreTrainedModel

    from hfpatch_core.authoring import build_on_meta, nested_loads

    before = PreTrainedModel.__dict__["_from_config"]
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    model = build_on_meta(
        LlavaForConditionalGeneration, LlavaConfig(vision_config=vision, text_config=tiny_llama_config())
    )
    found = {type(module).__name__: path for path, module in nested_loads(model).items()}
    assert sorted(found) == ["CLIPVisionModel", "LlamaModel"]
    # the projector is built by its class, in the composite's own load
    assert all(not path.endswith("multi_modal_projector") for path in found.values())
    # a model without sub-models has none, and the recorder is gone after the build
    assert nested_loads(build_on_meta(type(model.get_submodule(found["LlamaModel"])), tiny_llama_config())) == {}
    assert PreTrainedModel.__dict__["_from_config"] is before
