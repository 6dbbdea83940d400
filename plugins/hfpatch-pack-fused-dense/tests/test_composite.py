"""Composite models: each sub-model's load claims the classes of its own modeling module.

A composite model (an image-text model) builds its text and vision models in loads of
their own (``AutoModel.from_config(config.text_config)``).  Where transformers converts a
sub-model's weights with that sub-model's own list, scoped to its prefix (5.25), the pack
claims each sub-model's classes in that sub-model's load, with converters relative to it,
in the sub-model's model type's list (or its class's, where transformers keeps one by
class name); the outer load claims the outer modeling module's classes.  Where transformers
reads the root model type's list only (5.3), a composite model is refused with the reason.
"""

from __future__ import annotations

import hfpatch_pack_fused_dense
import pytest
from hfpatch_pack_fused_dense import SCOPED_SUB_MODELS, converter_key, refusals

from conftest import CASES, PACK
from hfpatch_core import LoadContext, Patch, Refusal
from hfpatch_core.testing import assert_pack_equivalent, tiny_checkpoint, tiny_config

scoped = pytest.mark.skipif(
    not SCOPED_SUB_MODELS, reason="this transformers release reads the root model type's conversion list only"
)


@scoped
@pytest.mark.parametrize(
    ("model_type", "replaced"),
    [
        # the text model (gemma3_text) and the vision tower (SiglipVisionModel: a list kept by class name)
        ("gemma3", ["Gemma3Attention", "Gemma3MLP", "SiglipAttention"]),
        # a qwen2 text model inside another family's composite
        ("got_ocr2", ["Qwen2Attention", "Qwen2MLP"]),
        # a llama and a CLIP tower: both sub-models' converters read self_attn.q_proj.weight, with other
        # sizes (transformers collects a load's converters by pattern: issue 40, the llama's reached CLIP)
        ("llava", ["CLIPAttention", "LlamaAttention", "LlamaMLP"]),
        # every class in the outer modeling module, converted through the list transformers keeps for
        # the composite class (Qwen2_5_VLForConditionalGeneration), not its model type's
        ("qwen2_5_vl", ["Qwen2MLP", "Qwen2_5_VLAttention", "Qwen2_5_VLMLP"]),
    ],
)
def test_a_composite_model_is_exact_in_every_sub_model(model_type: str, replaced: list[str]) -> None:
    checkpoint = tiny_checkpoint(model_type)
    report = assert_pack_equivalent(PACK, checkpoint, expected_replacements=replaced, apply_path=True)
    assert report.round_trip and report.generation_match and report.apply_path
    assert report.max_abs_diff is not None and report.max_abs_diff <= 1e-5


@scoped
def test_a_sub_model_claims_its_own_classes_in_its_own_list() -> None:
    """A nested load (the text model of a composite) claims its classes with converters relative to
    it, keyed by its model type; a sub-model whose class has its own list in transformers is keyed
    by that class name, which transformers looks up first."""
    config = CASES["llama"].config
    parent = LoadContext(model_type="llava", model_class_name="LlavaForConditionalGeneration")
    nested = LoadContext(model_type="llama", model_class_name="LlamaModel", config=config, parent=parent)
    patches = hfpatch_pack_fused_dense.provide_patches(nested)
    assert sorted(p.target for p in patches) == ["LlamaAttention", "LlamaMLP"]
    converters = hfpatch_pack_fused_dense.provide_converters(nested)
    assert {c.key for c in converters} == {"llama"} == {converter_key(nested)}
    patterns = {pattern for c in converters for t in c.transforms for pattern in t.source_patterns}
    assert "self_attn.q_proj.weight" in patterns and "mlp.gate_proj.weight" in patterns
    vision = LoadContext("siglip_vision_model", "SiglipVisionModel", tiny_config("gemma3").vision_config, parent=parent)
    assert converter_key(vision) == "SiglipVisionModel"


@scoped
def test_the_outer_load_claims_only_its_own_modeling_module() -> None:
    """gemma3's outer load claims gemma3's classes; siglip's attention is left to the vision tower's load."""
    config = tiny_config("gemma3")
    outer = LoadContext("gemma3", "Gemma3ForConditionalGeneration", config)
    claimed = {p.target for p in hfpatch_pack_fused_dense.provide_patches(outer) if not isinstance(p, Refusal)}
    assert claimed == {"Gemma3Attention", "Gemma3MLP"}
    assert refusals(config, "Gemma3ForConditionalGeneration") == {}


@pytest.mark.skipif(SCOPED_SUB_MODELS, reason="this transformers release converts each sub-model with its own list")
def test_a_composite_model_is_refused_where_one_list_serves_the_whole_model() -> None:
    config = tiny_config("gemma3")
    outer = LoadContext("gemma3", "Gemma3ForConditionalGeneration", config)
    offered = hfpatch_pack_fused_dense.provide_patches(outer)
    assert offered and all(isinstance(p, Refusal) and "a composite model" in p.reason for p in offered)
    config = CASES["llama"].config
    parent = LoadContext(model_type="llava", model_class_name="LlavaForConditionalGeneration")
    nested = LoadContext(model_type="llama", model_class_name="LlamaModel", config=config, parent=parent)
    assert hfpatch_pack_fused_dense.provide_patches(nested) == []
    assert hfpatch_pack_fused_dense.provide_converters(nested) == []


@scoped
def test_a_sub_model_whose_parts_the_outer_list_builds_is_refused(tmp_path) -> None:
    """kimi_k25's own conversion list splits its vision tower's ``wqkv`` into q_proj and k_proj, unscoped:
    the vision tower's load refuses its attention with that reason (its load failed: the parts never
    reached the fused converter), and the text model's MLP is still fused, exact."""
    from hfpatch_core.testing.zoo import verdict_of

    row = verdict_of(PACK, "kimi_k25", tmp_path, generate_tokens=4)
    assert row.verdict == "exact", row
    assert "Kimi_K25VisionAttention: transformers' own conversion for 'kimi_k25' builds q_proj" in row.detail


@scoped
def test_a_module_whose_parts_its_own_class_list_builds_is_refused(tmp_path) -> None:
    """unlimited_ocr's vision encoder is a sub-module (no load of its own) whose class has its own
    conversion list, which splits the checkpoint's fused ``qkv_proj`` into q_proj, k_proj and v_proj:
    its attention is refused with that reason (fused, its parts never reached the pack's converter and
    the load failed), and the text model's attention and MLP are still fused, exact."""
    from hfpatch_core.testing.zoo import verdict_of

    row = verdict_of(PACK, "unlimited_ocr", tmp_path, generate_tokens=4)
    assert row.verdict == "exact", row
    assert row.detail.startswith("UnlimitedOcrTextAttention <- FusedQKVUnlimitedOcrTextAttention"), row.detail
    reason = refusals(tiny_config("unlimited_ocr"), "UnlimitedOcrForConditionalGeneration")["UnlimitedOcrAttention"]
    assert "transformers' own conversion for 'UnlimitedOcrVisionEncoder'" in reason and "builds q_proj" in reason


def test_a_config_with_a_text_encoder_and_a_decoder_is_answered() -> None:
    # musicgen's config has a text encoder and a decoder: get_text_config() raises "Multiple valid
    # text configs" there (hfpatch check of the pack exited 1 on it); the pack reads the decoder's
    from transformers import EncodecConfig, MusicgenConfig, MusicgenDecoderConfig, T5Config

    config = MusicgenConfig(text_encoder=T5Config(), audio_encoder=EncodecConfig(), decoder=MusicgenDecoderConfig())
    context = LoadContext("musicgen", "MusicgenForConditionalGeneration", config)
    answer = hfpatch_pack_fused_dense.provide_patches(context)
    assert all(isinstance(item, Patch | Refusal) for item in answer), answer
    assert isinstance(hfpatch_pack_fused_dense.provide_converters(context), list)
