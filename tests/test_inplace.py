"""``hfpatch_core.apply`` / ``revert``: a model already built, patched in place and given back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hfpatch_core
from conftest import tiny_llama_config
from hfpatch_core import ApplyError, PackError, WeightLayoutError, plan_of
from hfpatch_core.testing import assert_pack_equivalent, load_model, safetensors_of
from packs import (
    _FUSED_MLP_CLASS,
    DOUBLING_PACK,
    MLP_PACK,
    PackSpec,
    _fused_qkv_classes,
    fused_attention_and_mlp_pack,
    fused_qkv_pack,
    mlp_pack,
)

HALF_CONVERTED_PACK = f"""
{_fused_qkv_classes("FusedQKVAttention")}
{_FUSED_MLP_CLASS}

@hookimpl
def provide_patches(context):
    if context.model_type != "llama":
        return []
    return [Patch("LlamaAttention", FusedQKVAttention), Patch("LlamaMLP", FusedGateUpMLP)]


@hookimpl
def provide_converters(context):
    size = context.config.intermediate_size
    fuse = WeightConverter(
        source_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        target_patterns="mlp.gate_up_proj.weight",
        operations=[SizedConcatenate(dim=0, sizes=(size, size))],
    )
    return [Converter("llama", [fuse])] if context.model_type == "llama" else []
"""


def ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(ids()).logits


def built(**overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def as_it_was(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor], dict[str, object]]:
    return dict(model.named_modules()), {k: v.clone() for k, v in model.state_dict().items()}, dict(vars(model))


def assert_unchanged(model: nn.Module, record: tuple[dict, dict, dict]) -> None:
    modules, state, attributes = record
    assert all(a is b for (_, a), b in zip(model.named_modules(), modules.values(), strict=True))
    now = model.state_dict()
    assert sorted(now) == sorted(state) and all(torch.equal(now[key], state[key]) for key in state)
    assert vars(model).keys() == attributes.keys()


def test_apply_equals_the_load_keeps_other_modules_and_reverts_exactly(
    install, llama_checkpoint: Path, tmp_path: Path, snapshot
) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()))
    loaded = load_model(llama_checkpoint, "fused")
    model = load_model(llama_checkpoint)  # vanilla
    record = as_it_was(model)
    norm, layer = model.model.norm, model.model.layers[1]

    plan = hfpatch_core.apply(model, packs="fused", strict=True)

    assert plan is plan_of(model) and plan.fingerprint == plan_of(loaded).fingerprint
    assert {name: type(m) for name, m in model.named_modules()} == {name: type(m) for name, m in loaded.named_modules()}
    assert (
        model.model.norm is norm
        and model.model.layers[1] is layer
        and layer.input_layernorm is record[0]["model.layers.1.input_layernorm"]
    )
    expected = loaded.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())
    torch.testing.assert_close(logits(model), logits(loaded), rtol=0, atol=1e-5)
    snapshot.assert_unchanged()
    assert not hfpatch_core.is_enabled()
    assert type(LlamaForCausalLM(tiny_llama_config()).model.layers[0].mlp).__name__ == "LlamaMLP"

    model.save_pretrained(tmp_path / "saved")  # the original layout, exactly
    source, saved = safetensors_of(llama_checkpoint), safetensors_of(tmp_path / "saved")
    assert sorted(saved) == sorted(source) and all(torch.equal(saved[key], source[key]) for key in source)
    # a checkpoint in the original layout loads back into the patched model (Trainer's resume)
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.weight.zero_()
    assert not model.load_state_dict(source, strict=True).missing_keys
    torch.testing.assert_close(logits(model), logits(loaded), rtol=0, atol=1e-5)

    hfpatch_core.revert(model)
    modules, state, attributes = record
    assert {name: type(m) for name, m in model.named_modules()} == {name: type(m) for name, m in modules.items()}
    now = model.state_dict()
    assert sorted(now) == sorted(state)
    assert all(now[key].dtype == state[key].dtype and torch.equal(now[key], state[key]) for key in state)
    assert vars(model).keys() == attributes.keys() and plan_of(model) is None
    snapshot.assert_unchanged()


def test_a_model_trained_after_apply_reverts_with_the_trained_values(install) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()))
    model = built()
    hfpatch_core.apply(model, packs="fused")
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # built after apply: the new parameters
    model(input_ids=ids(), labels=ids()).loss.backward()
    optimizer.step()
    model.eval()
    trained, gate_up = logits(model), model.model.layers[0].mlp.gate_up_proj.weight.detach().clone()
    hfpatch_core.revert(model)
    assert model.training is False and type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, gate_up[64:])
    torch.testing.assert_close(logits(model), trained, rtol=0, atol=1e-5)


def test_dtype_requires_grad_training_mode_ties_and_hooks_are_kept(install) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()))
    model = built(tie_word_embeddings=True).to(torch.bfloat16).train()
    model.model.layers[0].self_attn.o_proj.weight.requires_grad_(False)
    model.model.layers[0].mlp.eval()
    calls: list[str] = []
    model.model.layers[1].self_attn.register_forward_hook(lambda *_: calls.append("hook"))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        hfpatch_core.apply(model, packs="fused")
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attention.qkv_proj.weight.dtype == torch.bfloat16 and attention.qkv_proj.weight.requires_grad
    assert not attention.o_proj.weight.requires_grad
    assert attention.training and not mlp.training
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logits(model)
    assert calls == ["hook"]
    hfpatch_core.revert(model)
    logits(model)
    assert calls == ["hook", "hook"]
    assert not model.model.layers[0].self_attn.o_proj.weight.requires_grad
    assert model.model.layers[0].self_attn.q_proj.weight.requires_grad
    after = model.state_dict()
    assert all(after[key].dtype == torch.bfloat16 and torch.equal(after[key], before[key]) for key in before)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_apply_and_revert_under_no_grad_or_inference_mode_keep_requires_grad(install, context) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()))
    model = built().train()
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    model.model.layers[1].self_attn.q_proj.weight.requires_grad_(False)  # one part of what is fused
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    with context():
        hfpatch_core.apply(model, packs="fused")
    parameters = dict(model.named_parameters())
    assert {name: p.requires_grad for name, p in parameters.items() if name in trainable} == {
        name: value for name, value in trainable.items() if name in parameters
    }
    assert parameters["model.layers.1.self_attn.qkv_proj.weight"].requires_grad  # trainable where any part was
    assert not any(p.is_inference() for p in parameters.values())  # inference tensors could never be trained
    model(input_ids=ids(), labels=ids()).loss.backward()
    assert parameters["model.layers.0.mlp.gate_up_proj.weight"].grad is not None
    model.zero_grad(set_to_none=True)
    with context():
        hfpatch_core.revert(model)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == trainable
    assert not any(p.is_inference() for p in model.parameters())
    model(input_ids=ids(), labels=ids()).loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_a_pack_that_keeps_the_parameters_needs_no_converter(install) -> None:
    install(PackSpec("mlp", MLP_PACK))
    model = built()
    reference = logits(model)
    plan = hfpatch_core.apply(model)  # every installed pack, as HF_PATCH_PACKS unset selects
    assert [claim.pack for claim in plan.entries] == ["mlp"]
    assert type(model.model.layers[0].mlp).__name__ == "PackMLP"
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=0)
    hfpatch_core.revert(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_enabled_packs_are_the_default_and_the_session_stays(install) -> None:
    install(PackSpec("mlp", MLP_PACK), PackSpec("doubling", mlp_pack("Other", priority=-1)))
    selection = hfpatch_core.enable("mlp")
    model = built()
    hfpatch_core.apply(model)
    assert type(model.model.layers[0].mlp).__name__ == "PackMLP"
    hfpatch_core.revert(model)
    hfpatch_core.apply(model, packs="doubling")
    assert type(model.model.layers[0].mlp).__name__ == "Other"
    assert hfpatch_core.is_enabled()
    assert type(AutoModelForCausalLM.from_config(tiny_llama_config()).model.layers[0].mlp).__name__ == "PackMLP"
    assert selection.packs


def test_nothing_to_replace_leaves_the_model_as_it_was(install) -> None:
    install(PackSpec("mlp", mlp_pack(target="MistralMLP")))
    model = built()
    record = as_it_was(model)
    plan = hfpatch_core.apply(model, packs="mlp")
    assert plan.entries and not plan.replaced
    assert_unchanged(model, record)
    with pytest.raises(ApplyError, match=r"was not patched by hfpatch_core\.apply"):
        hfpatch_core.revert(model)


def test_a_replacement_without_converter_is_refused_naming_the_pack(install, snapshot) -> None:
    install(PackSpec("qkv", fused_qkv_pack(converter="none")))
    model = built()
    record = as_it_was(model)
    with pytest.raises(ApplyError) as caught:
        hfpatch_core.apply(model, packs="qkv")
    message = str(caught.value)
    assert "pack 'qkv' cannot replace LlamaAttention at model.layers.0.self_attn" in message
    assert "qkv_proj.weight" in message and "no converter" in message
    assert_unchanged(model, record)
    snapshot.assert_unchanged()


def test_a_converter_that_does_not_cover_the_parameters_is_refused(install, snapshot) -> None:
    # converts gate/up only, while the pack also fuses q/k/v: the load's layout check fails
    install(PackSpec("fused", HALF_CONVERTED_PACK))
    model = built()
    record = as_it_was(model)
    with pytest.raises(ApplyError, match=r"cannot apply pack\(s\) 'fused' to LlamaForCausalLM") as caught:
        hfpatch_core.apply(model, packs="fused")
    assert isinstance(caught.value.__cause__, WeightLayoutError | PackError)
    assert_unchanged(model, record)
    snapshot.assert_unchanged()


def test_a_replacement_that_raises_leaves_the_model_as_it_was(install, snapshot) -> None:
    install(PackSpec("broken", mlp_pack(init_raises=True)))
    model = built()
    record = as_it_was(model)
    with pytest.raises(PackError, match="broken"):
        hfpatch_core.apply(model, packs="broken")
    assert_unchanged(model, record)
    snapshot.assert_unchanged()


def test_meta_quantized_and_already_patched_models_are_refused(install, llama_checkpoint: Path) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()))
    with torch.device("meta"):
        meta = LlamaForCausalLM(tiny_llama_config())
    with pytest.raises(
        ApplyError, match=r"pack 'fused' cannot replace LlamaAttention at .*: q_proj.weight is on the meta"
    ):
        hfpatch_core.apply(meta, packs="fused")

    model = built()
    projection = model.model.layers[1].self_attn.q_proj
    projection.weight = nn.Parameter(projection.weight.detach().to(torch.int8), requires_grad=False)
    record = as_it_was(model)
    with pytest.raises(ApplyError, match=r"at model.layers.1.self_attn: q_proj.weight is quantized"):
        hfpatch_core.apply(model, packs="fused")
    assert_unchanged(model, record)

    quantized = built()
    quantized.hf_quantizer = object()
    with pytest.raises(ApplyError, match="is quantized"):
        hfpatch_core.apply(quantized, packs="fused")

    model = built()
    hfpatch_core.apply(model, packs="fused")
    with pytest.raises(ApplyError, match=r"already patched by hfpatch_core\.apply"):
        hfpatch_core.apply(model, packs="fused")
    with pytest.raises(ApplyError, match="loaded with packs already"):
        hfpatch_core.apply(load_model(llama_checkpoint, "fused"), packs="fused")
    with pytest.raises(ApplyError, match=r"PreTrainedModel \(or a PEFT model\), not Linear"):
        hfpatch_core.apply(nn.Linear(2, 2), packs="fused")


def test_a_model_on_several_devices_is_refused(install) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()))
    model = built()
    model.model.norm.to("meta")
    with pytest.raises(ApplyError, match=r"spread over several devices \(cpu, meta\)"):
        hfpatch_core.apply(model, packs="fused")


RANKS = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import hfpatch_core

dist.init_process_group("gloo")
torch.manual_seed(0)
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128)
model = LlamaForCausalLM(config)
state = {key: value.clone() for key, value in model.state_dict().items()}
try:
    hfpatch_core.apply(model, packs="fused")
except hfpatch_core.ApplyError as exc:
    after = model.state_dict()
    unchanged = sorted(after) == sorted(state) and all(torch.equal(after[key], state[key]) for key in state)
    # a file per rank: the ranks' standard outputs interleave
    Path(sys.argv[1], f"rank{dist.get_rank()}").write_text(f"unchanged={unchanged}: {exc}")
dist.destroy_process_group()
"""


def test_a_model_on_several_ranks_is_refused(install, tmp_path: Path) -> None:
    """Two real ranks (torchrun, gloo on CPU): each rank's model is refused, as it was."""
    site = install(PackSpec("fused", fused_attention_and_mlp_pack()))
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    checkout = Path(hfpatch_core.__file__).resolve().parents[1]
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_PATCH", "HFPATCH"))}
    environment["PYTHONPATH"] = os.pathsep.join([str(site), str(checkout)])
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = [(tmp_path / f"rank{rank}").read_text() if (tmp_path / f"rank{rank}").exists() else "" for rank in (0, 1)]
    expected = (
        "unchanged=True: LlamaForCausalLM: torch.distributed runs with 2 ranks, and a model sharded across ranks "
        "cannot be converted in place; load the checkpoint with the packs enabled on every rank (hfpatch run)"
    )
    assert found == [expected, expected]


def test_dtensor_parameters_are_refused(install, tmp_path: Path) -> None:
    """A real DTensor, on a one-rank gloo group (what a sharded model holds on each rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    install(PackSpec("fused", fused_attention_and_mlp_pack()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = built()
        projection = model.model.layers[0].mlp.up_proj
        projection.weight = nn.Parameter(distribute_tensor(projection.weight.detach(), mesh, [Replicate()]))
        with pytest.raises(ApplyError, match=r"at model.layers.0.mlp: up_proj.weight is a DTensor"):
            hfpatch_core.apply(model, packs="fused")
    finally:
        dist.destroy_process_group()


def test_assert_pack_equivalent_checks_the_apply_path(install, llama_checkpoint: Path) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()), PackSpec("doubling", DOUBLING_PACK))
    assert assert_pack_equivalent("fused", llama_checkpoint, apply_path=True, generate_tokens=0).apply_path is True
    report = assert_pack_equivalent(
        "doubling", llama_checkpoint, expect="different", apply_path=True, generate_tokens=0
    )
    assert report.apply_path is True
