from __future__ import annotations

import importlib.util

import torch
from transformers import conversion_mapping, monkey_patching
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

import hfpatch_core
from hfpatch_core import _compat, plan_of
from packs import PackSpec

VISION_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp

class PackVisionMlp(VisionMlp):
    pass

@hookimpl
def provide_patches(context):
    return [Patch("VisionMlp", PackVisionMlp)]
"""

VISION = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel


def test_registrations_transformers_makes_during_a_load_stay_and_ours_go(install, tmp_path) -> None:
    """A fusion_config load registers transformers' own patch and conversion for good (5.24;
    5.25 registers nothing); hfpatch removes only its own entries."""
    config = Qwen2VLVisionConfig(
        depth=1,
        embed_dim=32,
        hidden_size=32,
        num_heads=2,
        mlp_ratio=2,
        patch_size=4,
        temporal_patch_size=2,
        in_channels=3,
        spatial_merge_size=2,
    )
    torch.manual_seed(0)
    VISION(config).save_pretrained(tmp_path)
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        expected = VISION.from_pretrained(tmp_path)(pixels, grid_thw=grid)
    expected = getattr(expected, "last_hidden_state", expected)
    install(PackSpec("vision", VISION_PACK))
    hfpatch_core.enable()
    if importlib.util.find_spec("transformers.fusion_mapping") is None:
        # transformers 5.3 has no fusion_config: the pack alone, then nothing left
        model = VISION.from_pretrained(tmp_path)
        assert type(model.blocks[0].mlp).__name__ == "PackVisionMlp"
        assert monkey_patching.get_patch_mapping() == {}
        return
    model_type = VISION.config_class.model_type
    assert conversion_mapping.get_checkpoint_conversion_mapping(model_type) is None
    model = VISION.from_pretrained(tmp_path, fusion_config={"patch_embeddings": True})
    assert type(model.blocks[0].mlp).__name__ == "PackVisionMlp"
    assert plan_of(model).replaced["VisionMlp"].pack == "vision"
    assert type(model.patch_embed).__name__ == "FusedPatchEmbed"  # transformers' fusion, in the same load
    left = monkey_patching.get_patch_mapping()
    assert "VisionMlp" not in left  # ours is gone
    if _compat.fusion_patches() == "scoped":  # 5.25 applies the fusion for the load only
        assert left == {}
        assert conversion_mapping.get_checkpoint_conversion_mapping(model_type) is None
    else:
        assert left["PatchEmbed"].__name__ == "FusedPatchEmbed"  # transformers' own registration stays
        assert conversion_mapping.get_checkpoint_conversion_mapping(model_type) is not None  # and its conversion
    with torch.no_grad():
        output = model(pixels, grid_thw=grid)
    torch.testing.assert_close(getattr(output, "last_hidden_state", output), expected, atol=1e-5, rtol=0)
    monkey_patching.clear_patch_mapping()
