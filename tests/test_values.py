from __future__ import annotations

import dataclasses

import pluggy
import pytest
import torch.nn as nn
from transformers.core_model_loading import WeightRenaming
from transformers.models.llama.modeling_llama import LlamaMLP

import hfpatch_core
from hfpatch_core import Converter, InvalidPatchError, LoadContext, Patch, hookspecs


class MyMLP(LlamaMLP):
    pass


def test_patch_keeps_its_arguments_and_is_frozen() -> None:
    patch = Patch("LlamaMLP", MyMLP, priority=3, overwrite=True)
    assert (patch.target, patch.replacement, patch.priority, patch.overwrite) == ("LlamaMLP", MyMLP, 3, True)
    assert not patch.is_pattern and Patch(".*MLP$", MyMLP).is_pattern
    with pytest.raises(dataclasses.FrozenInstanceError):
        patch.priority = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        Patch("LlamaMLP", MyMLP, 3)  # type: ignore[misc]  # priority is keyword-only


@pytest.mark.parametrize(
    ("target", "replacement", "expected"),
    [
        ("(", MyMLP, r"'\(' is not a valid regular expression .*escape a literal name with re.escape"),
        ("", MyMLP, "non-empty class name or regular expression"),
        (None, MyMLP, "non-empty class name"),
        ("LlamaMLP", dict, r"class builtins.dict does not derive from torch.nn.Module; subclass"),
        ("LlamaMLP", "MyMLP", "got an instance of str"),
        (
            "LlamaMLP",
            nn.Identity(),
            r"got an instance of Identity; pass the class itself: Patch\('LlamaMLP', Identity\)",
        ),
    ],
)
def test_patch_rejects_bad_input_naming_target_and_fix(target: object, replacement: object, expected: str) -> None:
    with pytest.raises(InvalidPatchError, match=expected):
        Patch(target, replacement)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), [("priority", "1"), ("priority", True), ("overwrite", 1)])
def test_patch_rejects_badly_typed_options(field: str, value: object) -> None:
    with pytest.raises(InvalidPatchError, match=field):
        Patch("LlamaMLP", MyMLP, **{field: value})  # type: ignore[arg-type]


def test_converter_validates_transforms() -> None:
    renaming = WeightRenaming("mlp.fc", "mlp.proj")
    converter = Converter("llama", [renaming], replaces="experts")
    assert converter.transforms == (renaming,) and converter.replaces == ("experts",)
    with pytest.raises(InvalidPatchError, match="is not a transformers WeightTransform"):
        Converter("llama", ["mlp.fc"])
    with pytest.raises(InvalidPatchError, match="model_type or model class name"):
        Converter("", [renaming])
    assert Converter("llama", [renaming], patch_targets="LlamaMLP").patch_targets == ("LlamaMLP",)
    with pytest.raises(InvalidPatchError, match=r"patch_targets must be targets of the pack's patches.*got 3"):
        Converter("llama", [renaming], patch_targets=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidPatchError, match=r"replaces must be source patterns .*got \['a', ''\]"):
        Converter("llama", [renaming], replaces=["a", ""])


def test_load_context_is_frozen_and_knows_its_root() -> None:
    outer = LoadContext(model_type="llava", model_class_name="LlavaForConditionalGeneration")
    inner = LoadContext(model_type="llama", model_class_name="LlamaModel", parent=outer)
    assert inner.root is outer and outer.root is outer
    assert inner.transformers_version == __import__("transformers").__version__
    with pytest.raises(dataclasses.FrozenInstanceError):
        inner.model_type = "x"  # type: ignore[misc]
    with pytest.raises(TypeError, match="model_class_name"):
        LoadContext(model_type="llama", model_class_name="")
    hash(inner)  # usable as a key although configs are not hashable


def test_markers_are_created_once_and_exported() -> None:
    assert hfpatch_core.hookimpl is hookspecs.hookimpl
    assert isinstance(hfpatch_core.hookimpl, pluggy.HookimplMarker)
    assert hookspecs.hookimpl.project_name == hookspecs.hookspec.project_name == "hfpatch"
    manager = pluggy.PluginManager("hfpatch")
    manager.add_hookspecs(hookspecs)
    for name in ("provide_patches", "provide_converters"):
        spec = getattr(manager.hook, name).spec
        assert spec is not None and spec.argnames == ("context",)
        doc = spec.function.__doc__ or ""
        assert "Called" in doc and "Args:" in doc and "Returns:" in doc


def test_the_save_guard_reads_a_packed_weight_as_the_weight_of_a_quantized_model() -> None:
    # compressed-tensors' integer schemes write X.weight as X.weight_packed (+ scale, shape)
    from hfpatch_core._runtime.layout import layout_differences

    written = {"a.weight_packed": (2,), "a.weight_scale": (1,), "b.weight": (4,)}
    expected = {"a.weight": (4,), "b.weight": (4,), "c.weight": (4,)}
    assert layout_differences(written, expected, quantized=True) == [
        "c.weight: vanilla transformers expects it, it would not be written"
    ]
    unquantized = layout_differences(written, expected, quantized=False)
    assert "a.weight: vanilla transformers expects it, it would not be written" in unquantized
