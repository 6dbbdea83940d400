"""llm-compressor's schemes through the converting packs, both ways (issue 51 points 1, 2 and 4).

Each converting pack (qwen-moe's fused q/k/v and per-expert experts, fused-dense's fused
q/k/v and gate/up, linear-experts' per-expert experts) quantized by ``oneshot`` with the
schemes users ship, on CPU:

* the patched model saves: compressed-tensors' tensor families (``weight_packed``,
  ``weight_scale``, ``weight_zero_point``, ``weight_shape``, ``input_scale``) split back to
  the original layout, and for every scheme whose weights are quantized per row (per
  channel or per group) the checkpoint is the very one llm-compressor writes for the
  unpatched model, tensor for tensor (a fused linear's rows are quantized as its parts'
  rows are); FP8's per-tensor weights share one scale across q/k/v, saved in each;
* the checkpoint reloads with the pack to the quantized model's logits exactly, and without
  it where transformers can load the scheme at all (it cannot load 3-D experts' W8A8 or
  asymmetric W4A16 checkpoints: the packs' per-expert linears can);
* the unpatched model's checkpoint loads into the pack (the same logits as the unpatched
  quantized model), except FP8's per-tensor weights, whose q/k/v scales differ: refused
  with a ``WeightLayoutError`` that names the tensors and the scheme, nothing loaded;
* a save the conversions refuse writes nothing (no half-written directory);
* fused-dense, whose original projections are views of the fused weight, refuses a quantizer
  that would add scales to the views, and leaves a quantized checkpoint's classes unfused,
  with the reason in the plan.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from harness import SCHEMES, SIZES, ids, load, logits, quantize
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, monkey_patching

import hfpatch_core
from hfpatch_core import AdapterError, PackWarning, WeightLayoutError
from hfpatch_core.testing import tiny_checkpoint

transformers.utils.logging.disable_progress_bar()


@dataclasses.dataclass(frozen=True)
class Case:
    pack: str
    model_type: str
    overrides: dict
    #: the fused linear a load of the pack holds (``None``: the pack fuses none)
    fused: str | None
    #: a checkpoint key of one part of it, or of one expert projection
    part: str
    #: llm-compressor's own names of the unpatched model's tensors, where they are not the checkpoint's
    renamed: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.pack}-{self.model_type}"

    def theirs(self, key: str) -> str:
        for ours, llmcompressors in self.renamed:
            key = key.replace(ours, llmcompressors)
        return key


CASES = [
    Case("qwen-moe", "qwen3_moe", {**SIZES, "moe_intermediate_size": 128}, "self_attn.qkv_proj", "self_attn.k_proj"),
    # llm-compressor linearizes mixtral's experts under the names of other families, which
    # transformers does not read (vLLM 0.30 maps them): the pack keeps the checkpoint's w1 / w3 / w2
    Case(
        "linear-experts",
        "mixtral",
        SIZES,
        None,
        "block_sparse_moe.experts.3.w2",
        renamed=((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")),
    ),
]

MOE = {"qwen3_moe", "mixtral"}


def schemes(model) -> dict[str, object]:
    """The quantization scheme of each module that holds one, by name."""
    return {
        name: module.quantization_scheme
        for name, module in model.named_modules()
        if getattr(module, "quantization_scheme", None) is not None
    }


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request, tmp_path_factory) -> tuple[Case, Path]:
    spec: Case = request.param
    return spec, tiny_checkpoint(spec.model_type, tmp_path_factory.mktemp(spec.model_type), **spec.overrides)


@pytest.fixture(autouse=True)
def _disable() -> None:
    yield
    hfpatch_core.disable()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_patched_quantized_model_saves_the_original_layout_and_reloads_both_ways(case, defused, tmp_path, scheme):
    spec, checkpoint = case
    _, per_row, vanilla_loads_experts = SCHEMES[scheme]

    vanilla = load(checkpoint)
    tokens = ids(vanilla)
    quantize(vanilla, scheme)
    expected = logits(vanilla, tokens)
    vanilla.save_pretrained(tmp_path / "vanilla", save_compressed=True)
    theirs = load_file(tmp_path / "vanilla" / "model.safetensors")

    model = load(checkpoint, spec.pack)
    assert hfpatch_core.plan_of(model).replaced
    quantize(model, scheme)
    if spec.fused:
        fused = model.model.layers[0].get_submodule(spec.fused)
        assert getattr(fused, "quantization_scheme", None) is not None
    quantized = logits(model, tokens)
    out = tmp_path / "patched"
    model.save_pretrained(out, save_compressed=True)
    assert monkey_patching.get_patch_mapping() == {}

    saved = load_file(out / "model.safetensors")
    # the original layout: the checkpoint's modules, each with its quantized family
    original = {key.rsplit(".", 1)[0] for key in load_file(checkpoint / "model.safetensors")}
    assert {key.rsplit(".", 1)[0] for key in saved} == original
    members = {key.rsplit(".", 1)[1] for key in saved if f".{spec.part}." in key}
    assert "weight_scale" in members and members & {"weight", "weight_packed"}
    # llm-compressor's own checkpoint of the unpatched model, tensor for tensor (but FP8's per-tensor
    # weight scales: one for the fused q/k/v, saved in each part)
    assert {spec.theirs(key) for key in saved} == theirs.keys()
    for key in saved:
        if per_row or not spec.fused or spec.fused.rsplit(".", 1)[0] not in key:
            torch.testing.assert_close(saved[key], theirs[spec.theirs(key)], rtol=0, atol=0, msg=key)
    if per_row:
        torch.testing.assert_close(quantized, expected, rtol=0, atol=1e-5)

    patched = load(out, spec.pack)
    torch.testing.assert_close(logits(patched, tokens), quantized, rtol=0, atol=1e-5)
    # the reload keeps the scheme of every quantized linear, each expert's included
    assert schemes(patched) == schemes(model)
    assert any(".experts." in name for name in schemes(patched))
    if spec.fused:
        assert getattr(patched.model.layers[0].get_submodule(spec.fused), "quantization_scheme", None) is not None
    if spec.model_type not in MOE or vanilla_loads_experts:
        plain = load(out)
        assert not any((spec.fused or "-") in name for name, _ in plain.named_modules())
    else:  # transformers' own 3-D experts cannot take this scheme's per-expert tensors; the pack's linears can
        with pytest.raises(RuntimeError, match="conversion of the weights"):
            load(out)

    # the unpatched model's checkpoint into the pack
    if spec.renamed:  # llm-compressor's names are not the model's: refused, where vanilla drops them
        _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "vanilla", output_loading_info=True)
        assert any(spec.renamed[-1][1] in key for key in info["unexpected_keys"])
        # packed weights: hfpatch's load check names every tensor; int8 / fp8 ``weight``s: transformers'
        # own initialisation of the missing ones fails first (no normal_ for those dtypes)
        unloadable = WeightLayoutError if "A16" in scheme else NotImplementedError
        with pytest.raises(unloadable, match=r"does not match the checkpoint|not implemented for"):
            load(tmp_path / "vanilla", spec.pack)
    elif spec.fused and not per_row:
        with pytest.raises(WeightLayoutError, match=r"weight_scale differs between the parts.*per tensor"):
            load(tmp_path / "vanilla", spec.pack)
    else:
        torch.testing.assert_close(logits(load(tmp_path / "vanilla", spec.pack), tokens), expected, rtol=0, atol=1e-5)


def test_a_refused_save_writes_nothing(defused, tmp_path_factory, tmp_path):
    """A quantized tensor the pack's conversion cannot split back (here: a packed zero point
    whose rows do not divide the parts' sizes) is refused on the meta run, before any file."""
    spec = CASES[0]
    checkpoint = tiny_checkpoint(spec.model_type, tmp_path_factory.mktemp("refused"), **spec.overrides)
    model = load(checkpoint, spec.pack)
    quantize(model, "W4A16_ASYM")
    fused = model.model.layers[0].get_submodule(spec.fused)
    fused.weight_zero_point.data = fused.weight_zero_point.data[:-1]  # one row short of the packed rows
    out = tmp_path / "refused"
    with pytest.raises(
        WeightLayoutError,
        match=r"weight_zero_point has 511 rows.*\[256, 128, 128\].*compressed-tensors.*4-bit int per group of 128",
    ):
        model.save_pretrained(out, save_compressed=False)
    assert not list(tmp_path.iterdir())  # no directory, no staging directory beside it either


# --- fused-dense: views of a fused weight, which quantizers must not take for linears -----------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), **SIZES)


def test_fused_dense_refuses_a_quantizer_on_its_views_with_the_remedy(llama, defused) -> None:
    """compressed-tensors takes the views (``nn.Linear`` subclasses over rows of the fused weight) for
    linears and adds scales to them, which the fused forward never reads: refused at once."""
    model = load(llama, "fused-dense")
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "ProjectionView"
    with pytest.raises(AdapterError, match=r"owns no tensor.*HF_PATCH_PACKS=all,-PACK"):
        quantize(model, "W4A16")


def test_fused_dense_leaves_a_quantized_checkpoint_unfused_and_says_why(llama, defused, tmp_path) -> None:
    vanilla = load(llama)
    tokens = ids(vanilla)
    quantize(vanilla, "W4A16")
    vanilla.save_pretrained(tmp_path / "w4a16")
    expected = logits(load(tmp_path / "w4a16"), tokens)
    with pytest.warns(PackWarning, match=r"'fused-dense' leaves LlamaForCausalLM unfused: a quantized checkpoint"):
        model = load(tmp_path / "w4a16", "fused-dense")
    plan = hfpatch_core.plan_of(model)
    assert not plan.replaced
    assert {refusal.target for refusal in plan.refused} == {"LlamaAttention", "LlamaMLP"}
    assert all("a quantized checkpoint" in refusal.reason for refusal in plan.refused)
    torch.testing.assert_close(logits(model, tokens), expected, rtol=0, atol=0)
