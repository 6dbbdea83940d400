"""What differs between the transformers releases hfpatch supports, held to each.

A test here runs on every release: it checks the behaviour where the release has it, and
on the others what those releases do instead (see ``hfpatch_core._compat``).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from transformers import monkey_patching
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

import hfpatch_core
from hfpatch_core import _compat, plan_of
from hfpatch_core._runtime import application
from hfpatch_core._runtime.application import apply_mapping, attribute_names
from hfpatch_core.errors import ConverterConflictError
from packs import MLP_PACK, PackSpec

VISION = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel


class Probe(nn.Module):
    pass


class Replacement(Probe):
    pass


class _Unlisted(types.ModuleType):
    def __dir__(self) -> list[str]:
        raise RuntimeError("this module cannot list its names")


def _alias_module(name: str) -> types.ModuleType:
    """A module like transformers 5.6-5.17's legacy aliases (``..._fast``): its ``__dir__`` and
    ``__getattr__`` import the target, here one that needs a package that is not installed."""
    module = types.ModuleType(name)

    def _import(*_: object) -> object:
        raise ModuleNotFoundError("No module named 'torchvision'")

    module.__getattr__ = _import  # type: ignore[method-assign]
    module.__dir__ = _import  # type: ignore[method-assign]
    module.Probe = Probe  # type: ignore[attr-defined]
    return module


def test_listing_a_module_imports_nothing_and_never_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    alias = _alias_module("transformers.hfpatch_alias_probe")
    unlisted = _Unlisted("transformers.hfpatch_unlisted_probe")
    unlisted.Probe = Probe  # type: ignore[attr-defined]
    for module in (alias, unlisted):
        monkeypatch.setitem(sys.modules, module.__name__, module)
        assert "Probe" in attribute_names(module)
    with apply_mapping({"Probe": Replacement}) as replaced:
        assert alias.Probe is Replacement and unlisted.Probe is Replacement
        assert {(module.__name__, name) for module, name, _ in replaced} >= {
            (alias.__name__, "Probe"),
            (unlisted.__name__, "Probe"),
        }
    assert alias.Probe is Probe and unlisted.Probe is Probe
    assert application.attribute_names(alias) == list(vars(alias))


def test_a_name_that_fails_to_resolve_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            raise RuntimeError(f"Failed to import {name}")  # transformers' wrapping of an import error

    module = Failing("transformers.hfpatch_failing_probe")
    module.__all__ = ["Probe"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(Failing, "__dir__", lambda self: ["Probe"])
    with apply_mapping({"Probe": Replacement}) as replaced:
        assert all(owner is not module for owner, _, _ in replaced)


# --- fusion_config: transformers' own patches for one load -----------------------------

VISION_CONFIG = dict(
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

PATCH_EMBED_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed, VisionMlp

class PackPatchEmbed(PatchEmbed):
    pass

class PackVisionMlp(VisionMlp):
    pass

@hookimpl
def provide_patches(context):
    return [Patch("PatchEmbed", PackPatchEmbed, overwrite=OVERWRITE), Patch("VisionMlp", PackVisionMlp)]
"""

CONVERTING_PACK = """
from hfpatch_core import Converter, Patch, hookimpl
from transformers.core_model_loading import WeightRenaming
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp

class PackVisionMlp(VisionMlp):
    pass

@hookimpl
def provide_patches(context):
    return [Patch("VisionMlp", PackVisionMlp)]

@hookimpl
def provide_converters(context):
    same = WeightRenaming(r"patch_embed\\.proj\\.weight", "patch_embed.proj.weight")
    return [Converter(context.model_type, [same])]
"""


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen2-vl-vision")
    VISION(Qwen2VLVisionConfig(**VISION_CONFIG)).save_pretrained(path)
    return path


def _vision_output(model: nn.Module) -> torch.Tensor:
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = model(pixels, grid_thw=torch.tensor([[1, 4, 4]]))
    return getattr(output, "last_hidden_state", output)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_fusion_ranks_as_a_direct_registration(install, vision_checkpoint: Path, overwrite: bool) -> None:
    """A pack's claim on a class a ``fusion_config`` fuses wins only with ``overwrite=True``;
    the pack's other patches apply either way, and nothing is left registered."""
    expected = _vision_output(VISION.from_pretrained(vision_checkpoint))
    install(PackSpec("vision", PATCH_EMBED_PACK.replace("OVERWRITE", str(overwrite))))
    hfpatch_core.enable(strict=True)
    kind = _compat.fusion_patches()
    if kind is None:  # 5.3: no fusion_config; the pack alone
        model = VISION.from_pretrained(vision_checkpoint)
        assert type(model.patch_embed).__name__ == "PackPatchEmbed"
        return
    before = monkey_patching.get_patch_mapping()
    if kind == "registered" and overwrite:
        # 5.24 registers the fused layout's conversion for good: the pack's unfused class
        # cannot load it, and the load says which weights
        with pytest.raises(Exception, match="patch_embed"):
            VISION.from_pretrained(vision_checkpoint, fusion_config={"patch_embeddings": True})
        monkey_patching.clear_patch_mapping()
        return
    model = VISION.from_pretrained(vision_checkpoint, fusion_config={"patch_embeddings": True})
    plan = plan_of(model)
    assert plan is not None
    assert type(model.blocks[0].mlp).__name__ == "PackVisionMlp"
    if overwrite:
        assert type(model.patch_embed).__name__ == "PackPatchEmbed"
        assert plan.replaced["PatchEmbed"].pack == "vision"
    else:
        assert type(model.patch_embed).__name__ == "FusedPatchEmbed"
        assert "PatchEmbed" not in plan.replaced
        (lost,) = [lost for lost in plan.lost if lost.claim.target == "PatchEmbed"]
        assert "register_patch_mapping" in lost.reason and "overwrite=True" in lost.reason
    torch.testing.assert_close(_vision_output(model), expected, atol=1e-5, rtol=0)
    after = monkey_patching.get_patch_mapping()
    if kind == "scoped":
        assert after == before == {}  # 5.25 registers nothing
    else:
        assert set(after) == {"PatchEmbed"}  # 5.24 keeps its own registration, not ours
        monkey_patching.clear_patch_mapping()


def test_a_fusion_config_load_with_no_class_to_fuse(install, tmp_path: Path) -> None:
    """The issue's load: a ViT has nothing 5.25's patch-embedding fusion fuses, and the load
    (with hfpatch's stand-in for ``apply_patches``, which 5.25 calls with a mapping) works."""
    from transformers import AutoModel, ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=8, patch_size=4
    )
    ViTModel(config).save_pretrained(tmp_path)
    install(PackSpec("mlp", MLP_PACK))
    hfpatch_core.enable()
    if _compat.fusion_patches() is None:
        model = AutoModel.from_pretrained(tmp_path)
    else:
        model = AutoModel.from_pretrained(tmp_path, fusion_config={"patch_embeddings": True})
    assert type(model).__name__ == "ViTModel" and plan_of(model) is not None
    monkey_patching.clear_patch_mapping()


def test_a_pack_converter_and_a_fusion_on_the_same_tensors(install, vision_checkpoint: Path) -> None:
    install(PackSpec("converting", CONVERTING_PACK))
    hfpatch_core.enable(strict=True)
    kind = _compat.fusion_patches()
    if kind is None:
        model = VISION.from_pretrained(vision_checkpoint)
        assert type(model.blocks[0].mlp).__name__ == "PackVisionMlp"
        return
    if kind == "scoped":
        with pytest.raises(ConverterConflictError, match=r"pack 'converting'.*fusion 'patch_embeddings'"):
            VISION.from_pretrained(vision_checkpoint, fusion_config={"patch_embeddings": True})
        assert monkey_patching.get_patch_mapping() == {}
        return
    # 5.24 registers the fusion's conversion before the load is planned: the pack's
    # converter comes first in the composed list and the fused module misses its weight
    with pytest.raises(Exception, match="patch_embed"):
        VISION.from_pretrained(vision_checkpoint, fusion_config={"patch_embeddings": True})
    monkey_patching.clear_patch_mapping()


# --- hub kernels --------------------------------------------------------------------------


def test_equivalence_compares_the_packs_forward_with_hub_kernels_off(
    install, llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``assert_pack_equivalent`` loads both sides with ``use_kernels=False``: it compares the
    pack's own forward with transformers', whatever ``USE_HUB_KERNELS`` says.  5.25 turns
    hub kernels on by default, and without the ``kernels`` package a default load raises."""
    from transformers import AutoModelForCausalLM

    from hfpatch_core.testing import assert_pack_equivalent

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    install(PackSpec("mlp", MLP_PACK))
    if _compat.hub_kernels_on_by_default() and importlib.util.find_spec("kernels") is None:
        with pytest.raises(Exception, match=r"(?i)kernels"):
            AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    report = assert_pack_equivalent("mlp", llama_checkpoint, generate_tokens=2)
    assert report.ok, report.failures


# --- conversion drift -------------------------------------------------------------------


def test_a_sized_converter_reverses_through_transformers_own_copy() -> None:
    """``WeightTransform`` gained ``__slots__`` (5.6) and ``copy()`` (5.21), which
    ``reverse_transform`` uses to build the saving transform: hfpatch's sized operations
    are ``ConversionOps`` passed to it, not transform subclasses, and keep their sizes."""
    from transformers.core_model_loading import WeightConverter

    from hfpatch_core import SizedConcatenate, SizedSplit

    fuse = WeightConverter(
        source_patterns=["q_proj.weight", "k_proj.weight", "v_proj.weight"],
        target_patterns="qkv_proj.weight",
        operations=[SizedConcatenate(dim=0, sizes=(4, 2, 2))],
    )
    (split,) = fuse.reverse_transform().operations
    assert isinstance(split, SizedSplit) and split.sizes == (4, 2, 2)
    (again,) = fuse.reverse_transform().reverse_transform().operations
    assert isinstance(again, SizedConcatenate) and again.sizes == (4, 2, 2)


def test_conversion_lists_are_registered_by_position() -> None:
    """``register_checkpoint_conversion_mapping``'s first argument was renamed in 5.9:
    hfpatch passes it by position, which every release accepts."""
    import inspect

    from transformers import conversion_mapping

    parameters = list(inspect.signature(conversion_mapping.register_checkpoint_conversion_mapping).parameters.values())
    assert parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert [parameter.name for parameter in parameters[1:3]] == ["mapping", "overwrite"]
