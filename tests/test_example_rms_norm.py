"""The docs' structural example pack ``rms-norm`` (docs/examples/rms-norm), installed as a real distribution.

It finds the norms it replaces by probing what each module computes; these check that what it
replaces loads exactly (in bfloat16, with the tolerance ``assert_pack_equivalent`` calibrates in
the same run from vanilla against itself), that its replacements are what the loaded model holds,
q/k norms built inside an attention whose ``__init__`` transformers wraps included, and that a
norm it cannot reproduce is refused with the reason.
"""

from __future__ import annotations

import copy
import importlib
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hfpatch_core import plan_of
from hfpatch_core.testing import assert_pack_equivalent, install_pack, load_model, tiny_checkpoint

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "rms-norm"
PACK = "rms-norm"


@pytest.fixture
def pack(tmp_path: Path) -> Iterator[ModuleType]:
    """The example installed (``conftest._isolation`` restores sys.path), and its module."""
    before = set(sys.modules)
    source = (EXAMPLE / "hfpatch_pack_rms_norm.py").read_text(encoding="utf-8")
    install_pack(tmp_path / "site", PACK, source, module="hfpatch_pack_rms_norm")
    importlib.invalidate_caches()
    yield importlib.import_module("hfpatch_pack_rms_norm")
    for module in set(sys.modules) - before:
        if module.startswith("hfpatch_pack_"):
            del sys.modules[module]


def _norm_classes(model: torch.nn.Module) -> set[type]:
    return {type(module) for module in model.modules() if "Norm" in type(module).__name__}


@pytest.mark.parametrize(
    ("model_type", "inside"),
    [
        ("llama", "model.norm"),
        ("gemma2", "model.layers.0.post_feedforward_layernorm"),  # scales by 1 + weight
        ("olmo2", "model.layers.0.post_attention_layernorm"),  # scales in float32, then casts
        ("qwen3", "model.layers.0.self_attn.q_norm"),  # built by an __init__ under @use_kernelized_func
    ],
)
def test_the_norms_it_finds_load_exactly(pack: ModuleType, tmp_path: Path, model_type: str, inside: str) -> None:
    report = assert_pack_equivalent(PACK, model_type, dtype=torch.bfloat16, generate_tokens=5)
    assert report.replaced, f"{PACK} replaced nothing in {model_type}"
    assert report.replaced == {name: pack.replacement_name(name) for name in report.replaced}
    checkpoint = tiny_checkpoint(model_type, tmp_path / model_type)
    vanilla = load_model(checkpoint).get_submodule(inside)
    patched = load_model(checkpoint, PACK).get_submodule(inside)
    assert type(patched).__name__ == pack.replacement_name(type(vanilla).__name__)
    assert type(patched).__bases__ == (type(vanilla),)


def test_a_norm_it_cannot_reproduce_is_refused_with_the_reason(pack: ModuleType, tmp_path: Path) -> None:
    """Cohere's norm subtracts the mean: a layer norm without bias, which no rms_norm scaling matches."""
    checkpoint = tiny_checkpoint("cohere", tmp_path / "cohere")
    model = load_model(checkpoint, PACK)
    plan = plan_of(model)
    assert plan is not None and not plan.replaced
    (refused,) = plan.refused
    assert refused.pack == PACK and refused.target == "CohereLayerNorm"
    assert refused.reason.startswith("it computes none of rms_norm's scalings (tried weight with variance_epsilon")
    assert {type(module) for module in model.modules()} == {type(module) for module in load_model(checkpoint).modules()}


def test_a_norm_whose_name_another_left_alone_contains_is_refused(pack: ModuleType, tmp_path: Path) -> None:
    """transformers' registry searches class names with a plain name as a pattern: claiming
    ``Qwen3NextRMSNorm`` would replace the gated norm (refused: it takes a gate) too."""
    checkpoint = tiny_checkpoint("qwen3_next", tmp_path / "qwen3_next")
    plan = plan_of(load_model(checkpoint, PACK))
    assert plan is not None and not plan.replaced
    reasons = {refused.target: refused.reason for refused in plan.refused}
    assert (
        reasons["Qwen3NextRMSNorm"]
        == "the registry would replace Qwen3NextRMSNormGated too (its name contains this one)"
    )
    assert reasons["Qwen3NextRMSNormGated"] == "its forward takes more than the hidden states (gate)"


def test_a_norm_whose_instances_differ_is_refused(pack: ModuleType, tmp_path: Path) -> None:
    """gemma3n's norm has a weight in some instances only (``with_scale``): one probed instance
    cannot speak for the others (claimed, the weightless ones failed to load)."""
    from hfpatch_core.testing.zoo import zoo_model_types

    if "gemma3n_text" not in zoo_model_types():
        pytest.skip("no gemma3n_text in this transformers")
    checkpoint = tiny_checkpoint("gemma3n_text", tmp_path / "gemma3n_text")
    plan = plan_of(load_model(checkpoint, PACK))
    assert plan is not None and "Gemma3nRMSNorm" not in plan.replaced
    reasons = {refused.target: refused.reason for refused in plan.refused}
    assert reasons["Gemma3nRMSNorm"] == "its instances differ: some have a weight, some do not"


def test_a_patched_model_pickles_and_unpickles_in_a_fresh_process(pack: ModuleType, tmp_path: Path) -> None:
    """The replacements are built with ``runtime_class`` (the authors' guide, "Classes built at runtime"):
    a patched model deep-copies, pickles, and unpickles where no load has built the class yet."""
    checkpoint = tiny_checkpoint("llama", tmp_path / "llama")
    model = load_model(checkpoint, PACK)
    replaced = type(model.model.norm)
    assert replaced.__name__ == pack.replacement_name("LlamaRMSNorm")
    assert type(copy.deepcopy(model).model.norm) is replaced
    assert type(pickle.loads(pickle.dumps(model)).model.norm) is replaced
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    torch.save({"model": model, "ids": ids, "expected": expected}, tmp_path / "saved.pt")
    script = (
        "import sys, torch\n"
        f"saved = torch.load({str(tmp_path / 'saved.pt')!r}, weights_only=False)\n"
        "model = saved['model']\n"
        "assert type(model.model.norm).__name__ == sys.argv[1], type(model.model.norm)\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(model(saved['ids']).logits, saved['expected'])\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script, replaced.__name__], capture_output=True, text=True, env=environment, check=False
    )
    assert done.returncode == 0, done.stderr


def test_a_large_candidate_is_probed_built_small(pack: ModuleType) -> None:
    """What a probe of a real MLP would materialise (135M parameters at llama's default sizes) is built
    with the config scaled down (``authoring.shrunk_instance``); a norm is probed at its own size."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    from hfpatch_core import LoadContext
    from hfpatch_core.authoring import build_on_meta

    context = LoadContext(model_type="llama", model_class_name="LlamaForCausalLM", config=LlamaConfig())
    model = build_on_meta(context)
    mlp, norm = model.model.layers[0].mlp, model.model.norm
    assert sum(parameter.numel() for parameter in mlp.parameters()) > pack.PROBE_LIMIT
    small = pack._candidate(context, LlamaMLP, mlp)
    assert type(small) is LlamaMLP and small.gate_proj.weight.shape == (128, 64)
    assert small.gate_proj.weight.device.type == "cpu"
    same = pack._candidate(context, LlamaRMSNorm, norm)
    assert same.weight.shape == (4096,) and same.weight.device.type == "cpu"
