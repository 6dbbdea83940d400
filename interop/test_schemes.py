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
  that would add scales to the views; a quantized checkpoint loads into its quantizable
  variant (the fused projection is the linear compressed-tensors quantizes, the views are
  not linears) and saves back tensor for tensor; a class whose parts the checkpoint
  quantizes differently stays unfused, with the reason in the plan and a warning.
"""

from __future__ import annotations

import copy
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


@pytest.mark.parametrize("spec", [CASES[0], Case("fused-dense", "llama", SIZES, "self_attn.qkv_proj", "")], ids=str)
def test_a_float32_checkpoint_loads_in_bfloat16_as_the_unpatched_model_does(defused, tmp_path, spec) -> None:
    """transformers reads a pre-quantized checkpoint's converted tensors in the checkpoint's dtype
    and the others in the load's: the fused linear's scales are cast as its parts' would be, so a
    float32 checkpoint loaded in bfloat16 runs, as close to the unpatched model as bfloat16 is to
    float32."""
    checkpoint = tiny_checkpoint(spec.model_type, tmp_path / "checkpoint", **spec.overrides)
    vanilla = load(checkpoint)
    tokens = ids(vanilla)
    quantize(vanilla, "W4A16")
    vanilla.save_pretrained(tmp_path / "w4a16")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "w4a16", dtype=torch.bfloat16)
    hfpatch_core.enable(spec.pack)
    try:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "w4a16", dtype=torch.bfloat16)
    finally:
        hfpatch_core.disable()
    fused = model.model.layers[0].get_submodule(spec.fused)
    assert {tensor.dtype for tensor in fused.parameters() if tensor.is_floating_point()} == {torch.bfloat16}
    expected = logits(reference, tokens).float()
    bound = float((expected - logits(load(tmp_path / "w4a16"), tokens)).abs().max())
    torch.testing.assert_close(logits(model, tokens).float(), expected, rtol=0, atol=bound)


#: How a test breaks a quantized fused linear so that the pack's split refuses it, per ``save_compressed``:
#: a packed zero point one row short (uncompressed: llm-compressor's compression would refuse it first),
#: and a member hfpatch does not know (compressed: the compression leaves it alone).
BREAKAGES = {
    False: r"weight_zero_point has 511 rows.*\[256, 128, 128\].*compressed-tensors.*4-bit int per group of 128",
    True: r"does not know how to split the quantized tensor 'weight_unknown'.*compressed-tensors pack-quantized",
}


@pytest.mark.parametrize("compressed", [False, True], ids=["uncompressed", "compressed"])
def test_a_refused_save_writes_nothing_and_leaves_the_model_to_save_again(
    defused, tmp_path_factory, tmp_path, compressed
):
    """A quantized tensor the pack's conversion cannot split back is refused on the meta run,
    before any file. llm-compressor's save wrapper had moved the weights behind accelerate's
    offloading hooks for the save (and compressed them, as after every save it makes): they are
    taken back as after a successful save, the model computes what it computed, and saves again."""
    spec = CASES[0]
    checkpoint = tiny_checkpoint(spec.model_type, tmp_path_factory.mktemp("refused"), **spec.overrides)
    model = load(checkpoint, spec.pack)
    tokens = ids(model)
    quantize(model, "W4A16_ASYM")
    quantized = logits(model, tokens)
    fused = model.model.layers[0].get_submodule(spec.fused)
    zero_point = fused.weight_zero_point.data
    if compressed:
        fused.register_buffer("weight_unknown", torch.zeros(fused.out_features, 1))
    else:
        fused.weight_zero_point.data = zero_point[:-1]  # one row short of the packed rows
    out = tmp_path / "saves" / "refused"
    with pytest.raises(WeightLayoutError, match=BREAKAGES[compressed]):
        model.save_pretrained(out, save_compressed=compressed)
    assert not list(tmp_path.iterdir())  # no directory, no staging directory beside it either
    assert not any(hasattr(module, "_hf_hook") for module in model.modules())

    if compressed:
        del fused._buffers["weight_unknown"]
    else:
        fused.weight_zero_point.data = zero_point
    torch.testing.assert_close(logits(model, tokens), quantized, rtol=0, atol=0)
    model.save_pretrained(out, save_compressed=compressed)
    torch.testing.assert_close(logits(load(out, spec.pack), tokens), quantized, rtol=0, atol=1e-5)


# --- fused-dense: views of a fused weight, which quantizers must not take for linears -----------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), **SIZES)


def test_fused_dense_refuses_a_quantizer_on_its_views_with_the_remedy(llama, defused) -> None:
    """compressed-tensors takes the views (``nn.Linear`` subclasses over rows of the fused weight) for
    linears and adds scales to them, which the fused forward never reads: refused at once."""
    model = load(llama, "fused-dense")
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "ProjectionView"
    with pytest.raises(AdapterError, match=r"owns no tensor.*HF_PATCH_PACKS=all,-PACK.*load the quantized checkpoint"):
        quantize(model, "W4A16")


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fused_dense_loads_a_quantized_checkpoint_fused_and_saves_it_back(llama, defused, tmp_path, scheme) -> None:
    """A checkpoint llm-compressor wrote for the unpatched model loads into fused projections that
    compressed-tensors quantizes as one linear each (their parts' tensor families fused), computes
    what the unpatched reload computes, and saves back the very checkpoint, before and after the
    first forward (which decompresses the weights, in both models alike)."""
    _, per_row, _ = SCHEMES[scheme]
    vanilla = load(llama)
    tokens = ids(vanilla)
    quantize(vanilla, scheme)
    vanilla.save_pretrained(tmp_path / "quantized")
    if not per_row:  # FP8's per-tensor weight scales differ between q, k and v: one fused linear holds one
        with pytest.raises(WeightLayoutError, match=r"weight_scale differs between the parts.*per tensor"):
            load(tmp_path / "quantized", "fused-dense")
        return
    reloaded = load(tmp_path / "quantized")

    model = load(tmp_path / "quantized", "fused-dense")
    assert set(hfpatch_core.plan_of(model).replaced) == {"LlamaAttention", "LlamaMLP"}
    for layer in model.model.layers:
        fusions = (("self_attn", "qkv_proj", ("q", "k", "v")), ("mlp", "gate_up_proj", ("gate", "up")))
        for parent, fused, parts in fusions:
            assert layer.get_submodule(f"{parent}.{fused}").quantization_scheme is not None
            for part in parts:
                view = layer.get_submodule(f"{parent}.{part}_proj")
                assert type(view).__name__ == "OutputView" and getattr(view, "quantization_scheme", None) is None
    model.save_pretrained(tmp_path / "saved")
    assert_same_files(tmp_path / "saved", tmp_path / "quantized")

    expected = logits(reloaded, tokens)
    torch.testing.assert_close(logits(model, tokens), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(copy.deepcopy(model), tokens), expected, rtol=0, atol=1e-5)
    reloaded.save_pretrained(tmp_path / "vanilla-after-forward")
    model.save_pretrained(tmp_path / "after-forward")
    assert_same_files(tmp_path / "after-forward", tmp_path / "vanilla-after-forward")
    torch.testing.assert_close(logits(load(tmp_path / "saved"), tokens), expected, rtol=0, atol=1e-5)


def assert_same_files(saved: Path, reference: Path) -> None:
    ours, theirs = load_file(saved / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[key], rtol=0, atol=0, msg=key)


def test_fused_dense_leaves_a_class_whose_parts_are_quantized_differently_unfused_and_says_why(
    llama, defused, tmp_path
) -> None:
    vanilla = load(llama)
    tokens = ids(vanilla)
    quantize(vanilla, "W4A16", ignore=("lm_head", "re:.*k_proj$"))
    vanilla.save_pretrained(tmp_path / "w4a16")
    expected = logits(load(tmp_path / "w4a16"), tokens)
    with pytest.warns(PackWarning, match=r"'fused-dense' leaves LlamaAttention unfused: .*k_proj: unquantized"):
        model = load(tmp_path / "w4a16", "fused-dense")
    plan = hfpatch_core.plan_of(model)
    assert set(plan.replaced) == {"LlamaMLP"}
    assert [refusal.target for refusal in plan.refused] == ["LlamaAttention"]
    assert "quantizes the parts differently" in plan.refused[0].reason
    torch.testing.assert_close(logits(model, tokens), expected, rtol=0, atol=1e-5)
