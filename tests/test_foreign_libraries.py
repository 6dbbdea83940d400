"""Other libraries' patches for real, beside a selected pack (issue 52.1): Liger-Kernel's
``apply_liger_kernel_to_llama`` (classes swapped into ``modeling_llama``) and transformers' own
``KernelConfig`` fusion (``register_kernel_replacements_and_fusions``: registry entries made with
``overwrite=True``).  Neither may win silently: the summary and ``hfpatch explain`` name the class,
what replaced it and how; a selected pack it keeps from applying gets a warning naming both (an
error in strict mode); a lock refuses a load whose foreign patches it does not hold."""

from __future__ import annotations

import json
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM, monkey_patching
from transformers.models.llama import modeling_llama

import hfpatch_core
from conftest import tiny_llama_config
from hfpatch_core import ForeignPatchError, LockError, PackWarning, plan_of
from hfpatch_core.cli import main
from packs import PackSpec

LIGER_MLP = "liger_kernel.transformers.swiglu.LigerSwiGLUMLP"
LIGER_NORM = "liger_kernel.transformers.rms_norm.LigerRMSNorm"


def classes_of(model: nn.Module) -> dict[str, str]:
    layer = model.model.layers[0]
    return {name: type(module).__name__ for name, module in layer.named_children()}


def foreign_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    messages = [str(w.message) for w in caught if issubclass(w.category, PackWarning)]
    return [message for message in messages if "does not replace" in message]


def test_liger_keeps_fused_dense_from_its_mlp_and_says_so(first_party, liger, llama_checkpoint) -> None:
    liger()
    hfpatch_core.enable(packs="fused-dense")
    with pytest.warns(PackWarning) as caught:
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    (message,) = foreign_warnings(caught)
    assert message.startswith("pack 'fused-dense' does not replace LlamaMLP for this load: ") and LIGER_MLP in message
    assert classes_of(model) == {
        "self_attn": "FusedQKVLlamaAttention",  # what the pack could still fuse
        "mlp": "LigerSwiGLUMLP",
        "input_layernorm": "LigerRMSNorm",
        "post_attention_layernorm": "LigerRMSNorm",
    }
    plan = plan_of(model)
    assert [(f.name, f.replacement, f.source, f.displaced) for f in plan.foreign] == [
        ("LlamaMLP", LIGER_MLP, "module", "fused-dense"),
        ("LlamaRMSNorm", LIGER_NORM, "module", None),
    ]
    assert (
        f"; outside hfpatch: LlamaMLP <- {LIGER_MLP} [module], LlamaRMSNorm <- {LIGER_NORM} [module] (plan "
        in plan.summary()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackWarning)  # said once per session
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)


def test_liger_under_strict_mode_raises_before_the_model_is_built(first_party, liger, llama_checkpoint) -> None:
    liger()
    hfpatch_core.enable(packs="fused-dense", strict=True)
    expected = rf"pack 'fused-dense' does not replace LlamaMLP .*{LIGER_MLP}"
    with pytest.raises(ForeignPatchError, match=expected) as raised:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert (raised.value.packs, raised.value.target) == (("fused-dense",), "LlamaMLP")
    assert monkey_patching.get_patch_mapping() == {}
    assert f"{modeling_llama.LlamaMLP.__module__}.{modeling_llama.LlamaMLP.__qualname__}" == LIGER_MLP


#: A hub kernel as a local kernel repository holds it: transformers' fusion builds ``Fused<Parent>``
#: around ``kernel_cls(*children)`` and registers it for the parent class.
KERNEL_LAYERS = """
import torch.nn as nn


class FusedProjection(nn.Module):
    def __init__(self, *parts):
        super().__init__()
        self.parts = nn.ModuleList(parts)


class FusedProjectionLayout(FusedProjection):
    pass
"""

KERNEL_METADATA = {
    "id": "fused-projection",
    "name": "fused-projection",
    "version": 1,
    "license": "Apache-2.0",
    "backend": {"type": "cpu"},
    "python-depends": [],
}

#: LlamaAttention's q/k/v and LlamaMLP's gate/up, each fused into one kernel (KernelConfig's tuple keys).
FUSIONS = {
    "LlamaAttention": tuple((name, f"model.layers.*.self_attn.{name}_proj") for name in ("q", "k", "v")),
    "LlamaMLP": (("gate", "model.layers.*.mlp.gate_proj"), ("up", "model.layers.*.mlp.up_proj")),
}


def _fused_class(parent: type, children: list[str], kernel: type) -> type:
    """transformers' ``make_parent_class_for_kernel_fusion``, for releases without it (5.3)."""
    original_init = parent.__init__

    def patched_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        setattr(self, children[0], kernel(*(getattr(self, name) for name in children)))
        for name in children[1:]:
            setattr(self, name, nn.Identity())

    return type(f"Fused{parent.__name__}", (parent,), {"__init__": patched_init})


def register_kernel_fusions(directory: Path) -> dict[str, str]:
    """Register FUSIONS as a ``KernelConfig`` load does (transformers' own function, with a local
    kernel repository); where the release has none, ``register_patch_mapping(..., overwrite=True)``
    with the classes it would build.  Returns the replacement of each class, qualified."""
    try:
        from transformers.integrations.hub_kernels import register_kernel_replacements_and_fusions
        from transformers.utils.kernel_config import KernelConfig
    except ImportError:
        register_kernel_replacements_and_fusions = None
    if register_kernel_replacements_and_fusions is None or not _kernels_available():
        namespace: dict[str, object] = {}
        exec(compile(KERNEL_LAYERS, "kernel_layers", "exec"), namespace)
        kernel = namespace["FusedProjectionLayout"]
        children = {name: [pattern.rsplit(".", 1)[1] for _, pattern in fusion] for name, fusion in FUSIONS.items()}
        mapping = {name: _fused_class(getattr(modeling_llama, name), children[name], kernel) for name in FUSIONS}
        monkey_patching.register_patch_mapping(mapping, overwrite=True)
    else:
        repository = directory / "fused-projection"
        repository.mkdir()
        (repository / "metadata.json").write_text(json.dumps(KERNEL_METADATA))
        (repository / "__init__.py").write_text("from . import layers\n")
        (repository / "layers.py").write_text(KERNEL_LAYERS)
        kernel_config = KernelConfig(
            {fusion: f"{repository}:FusedProjection" for fusion in FUSIONS.values()}, use_local_kernel=True
        )
        register_kernel_replacements_and_fusions(LlamaForCausalLM, tiny_llama_config(), kernel_config)
    registry = monkey_patching.get_patch_mapping()
    assert sorted(registry) == sorted(FUSIONS)
    return {name: f"{value.__module__}.{value.__qualname__}" for name, value in registry.items()}


def _kernels_available() -> bool:
    from transformers.utils import is_kernels_available

    return is_kernels_available()


@pytest.fixture
def kernel_fusions(tmp_path: Path) -> Iterator[Callable[[], dict[str, str]]]:
    """``kernel_fusions()`` registers FUSIONS; they are unregistered after the test."""
    yield lambda: register_kernel_fusions(tmp_path)
    registered = [name for name in FUSIONS if name in monkey_patching.get_patch_mapping()]
    if registered:
        monkey_patching.unregister_patch_mapping(registered)


@pytest.mark.parametrize("registered", ["before enable()", "after enable()"])
def test_kernel_fusions_keep_fused_dense_from_both_classes_and_say_so(
    first_party, kernel_fusions, llama_checkpoint, registered
) -> None:
    if registered == "before enable()":
        replacements = kernel_fusions()
        hfpatch_core.enable(packs="fused-dense")
    else:
        hfpatch_core.enable(packs="fused-dense")
        replacements = kernel_fusions()
    with pytest.warns(PackWarning) as caught:
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    messages = foreign_warnings(caught)
    assert len(messages) == 2, messages
    for name, message in zip(sorted(FUSIONS), messages, strict=True):
        assert message.startswith(f"pack 'fused-dense' does not replace {name} for this load: ")
        assert f"maps {name!r} to {replacements[name]} (no pack made it)" in message
    assert classes_of(model)["self_attn"] == "FusedLlamaAttention" and classes_of(model)["mlp"] == "FusedLlamaMLP"
    plan = plan_of(model)
    assert [(f.name, f.source, f.displaced) for f in plan.foreign] == [
        ("LlamaAttention", "registry", "fused-dense"),
        ("LlamaMLP", "registry", "fused-dense"),
    ]
    outside = ", ".join(f"{name} <- {replacements[name]} [registry]" for name in sorted(FUSIONS))
    assert f"hfpatch: LlamaForCausalLM: no patch applied; outside hfpatch: {outside} (plan " in plan.summary()


def test_kernel_fusions_under_strict_mode_raise(first_party, kernel_fusions, llama_checkpoint) -> None:
    replacements = kernel_fusions()
    hfpatch_core.enable(packs="fused-dense", strict=True)
    with pytest.raises(ForeignPatchError, match="pack 'fused-dense' does not replace LlamaAttention") as raised:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert raised.value.packs == ("fused-dense",)
    assert {name: f"{v.__module__}.{v.__qualname__}" for name, v in monkey_patching.get_patch_mapping().items()} == (
        replacements
    )


def explained(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str, str]:
    """``hfpatch explain CHECKPOINT`` with fused-dense, in this process: its JSON, table and warnings."""
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as env:
        env.setenv("HF_PATCH_PACKS", "fused-dense")
        warnings.simplefilter("default", PackWarning)  # the command shows each as one line
        assert main(["explain", str(checkpoint), "--json"]) == 0
        captured = capsys.readouterr()
        assert main(["explain", str(checkpoint)]) == 0
        text = capsys.readouterr().out
    return json.loads(captured.out), text, captured.err


def table_rows(text: str) -> dict[str, str]:
    return {line.split()[0]: line for line in text.splitlines() if line.startswith("Llama")}


def test_explain_names_liger_classes(first_party, liger, llama_checkpoint, capsys) -> None:
    liger()
    data, text, err = explained(llama_checkpoint, capsys)
    assert "hfpatch: warning: pack 'fused-dense' does not replace LlamaMLP" in err
    assert [(f["class"], f["replacement"], f["source"], f["displaced"]) for f in data["foreign"]] == [
        ("LlamaMLP", LIGER_MLP, "module", "fused-dense"),
        ("LlamaRMSNorm", LIGER_NORM, "module", None),
    ]
    rows = table_rows(text)
    assert rows["LlamaMLP"].endswith(f"{LIGER_MLP} [outside hfpatch]")
    assert rows["LlamaRMSNorm"].endswith(f"{LIGER_NORM} [outside hfpatch]")
    assert "Classes replaced outside hfpatch" in text and "it is used instead of pack 'fused-dense'" in text


def test_explain_names_kernel_fusions(first_party, kernel_fusions, llama_checkpoint, capsys) -> None:
    replacements = kernel_fusions()
    data, text, err = explained(llama_checkpoint, capsys)
    assert "hfpatch: warning: pack 'fused-dense' does not replace LlamaAttention" in err
    assert [(f["class"], f["replacement"], f["source"], f["displaced"]) for f in data["foreign"]] == [
        (name, replacements[name], "registry", "fused-dense") for name in sorted(FUSIONS)
    ]
    rows = table_rows(text)
    for name in FUSIONS:
        assert rows[name].endswith(f"{replacements[name]} [outside hfpatch]")


ATTENTION_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaAttention


class PackAttention(LlamaAttention):
    pass


@hookimpl
def provide_patches(context):
    return [Patch("LlamaAttention", PackAttention)] if context.model_type == "llama" else []
"""


def test_a_lock_refuses_a_load_whose_foreign_patches_it_does_not_hold(
    install, liger, llama_checkpoint, tmp_path
) -> None:
    install(PackSpec("attention", textwrap.dedent(ATTENTION_PACK)))
    written_plain, written_with_liger = tmp_path / "plain.lock", tmp_path / "liger.lock"
    assert main(["lock", "-o", str(written_plain), "--model-type", "llama"]) == 0
    liger()
    hfpatch_core.enable(lock=written_plain)
    with pytest.raises(LockError, match="classes replaced outside hfpatch are") as raised:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    found = [f"LlamaMLP <- {LIGER_MLP} [module]", f"LlamaRMSNorm <- {LIGER_NORM} [module]"]
    assert f"model type 'llama': the classes replaced outside hfpatch are {found} (locked: none)" in str(raised.value)
    assert "write the lock in the process that applies it" in str(raised.value)
    # written where Liger-Kernel patched, the lock holds its classes, and the load passes
    hfpatch_core.disable()
    assert main(["--no-cache", "lock", "-o", str(written_with_liger), "--model-type", "llama"]) == 0
    locked = json.loads(written_with_liger.read_text())["plans"]["llama"]
    assert locked["foreign"] == found
    assert "foreign" not in json.loads(written_plain.read_text())["plans"]["llama"]  # a lock without stays as it was
    hfpatch_core.enable(lock=written_with_liger)
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert classes_of(model)["self_attn"] == "PackAttention" and classes_of(model)["mlp"] == "LigerSwiGLUMLP"
