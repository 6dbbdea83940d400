from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM, conversion_mapping
from transformers.core_model_loading import WeightRenaming

import hfpatch_core
from conftest import tiny_llama_config
from hfpatch_core import ConverterConflictError, PackWarning, WeightLayoutError, plan_of
from hfpatch_core._pipeline.composition import ConversionScope, compose
from hfpatch_core._pipeline.resolution import resolve_converters
from hfpatch_core.authoring.sized import SizedConcatenate, SizedSplit, _whole_of_share
from hfpatch_core.conversion import Converter, describe_transform
from hfpatch_core.plan import BUILTIN, ConverterClaim
from packs import FUSED_MLP_PACK, MLP_PACK, PackSpec, fused_attention_and_mlp_pack, fused_qkv_pack


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits


def registry_state() -> tuple[dict, set]:
    conversion_mapping.get_checkpoint_conversion_mapping("llama")
    cache = dict(conversion_mapping._checkpoint_conversion_mapping_cache)
    user = set(getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", set()))
    return cache, user


def test_sized_ops_reverse_exactly() -> None:
    q, k, v = torch.randn(32, 8), torch.randn(16, 8), torch.randn(16, 8)
    fuse = SizedConcatenate(dim=0, sizes=(32, 16, 16))
    fused = fuse.convert({"q": [q], "k": [k], "v": [v]}, ["q", "k", "v"], ["qkv"])["qkv"]
    parts = fuse.reverse_op.convert({"qkv": fused}, ["qkv"], ["q", "k", "v"])
    assert [tuple(parts[name].shape) for name in "qkv"] == [(32, 8), (16, 8), (16, 8)]
    assert torch.equal(parts["k"], k) and isinstance(fuse.reverse_op, SizedSplit)
    assert isinstance(fuse.reverse_op.reverse_op, SizedConcatenate)
    # a part the checkpoint lacks is zero here, initialised and reported by the load check (issue 44.4)
    partial = fuse.convert({"q": [q], "k": [k]}, ["q", "k", "v"], ["qkv"])["qkv"]
    assert torch.equal(partial, torch.cat([q, k, torch.zeros(16, 8)]))
    with pytest.raises(ValueError, match=r"have sizes \[32, 8, 16\] along dim 0; the converter expects \[32, 16, 16\]"):
        fuse.convert({"q": [q], "k": [k[:8]], "v": [v]}, ["q", "k", "v"], ["qkv"])
    with pytest.raises(hfpatch_core.InvalidPatchError, match="sizes must be positive ints"):
        SizedSplit(0, (3, 0))


def test_an_fsdp2_share_read_from_the_checkpoint_views_its_whole_part_and_a_copy_does_not(tmp_path) -> None:
    # what an FSDP2 rank of two reads of a 75-row part, as transformers does: a slice of the file's tensor
    whole = {"rows": torch.randn(75, 8), "columns": torch.randn(6, 75)}
    save_file(whole, str(tmp_path / "model.safetensors"))
    handle = safe_open(str(tmp_path / "model.safetensors"), "pt")
    for rank, (start, stop) in enumerate([(0, 38), (38, 75)]):
        share = handle.get_slice("rows")[start:stop]
        found = _whole_of_share(share, 75, 0, 2, rank)
        assert found is not None and torch.equal(found, whole["rows"])
        assert found.untyped_storage().data_ptr() == share.untyped_storage().data_ptr()  # no copy
        columns = _whole_of_share(handle.get_slice("columns")[:, start:stop], 75, 1, 2, rank)
        assert columns is not None and torch.equal(columns, whole["columns"])
    share = handle.get_slice("rows")[0:38]
    assert _whole_of_share(share.double(), 75, 0, 2, 0) is None  # cast on read: a copy of the share alone
    assert _whole_of_share(share.clone(), 75, 0, 2, 0) is None
    assert _whole_of_share(handle.get_slice("rows")[38:75], 75, 0, 2, 0) is None  # not rank 0's rows
    assert _whole_of_share(handle.get_slice("rows")[0:38], 76, 0, 2, 0) is None  # not the declared size
    assert _whole_of_share(handle.get_slice("rows")[75:75], 75, 0, 2, 1) is None  # an empty share


def test_grouped_query_fused_qkv_loads_and_saves_the_original_layout(install, tmp_path, snapshot) -> None:
    """4 query heads, 2 key/value heads, head_dim 8: q is (32, 32), k and v are (16, 32)."""
    torch.manual_seed(0)
    source = tmp_path / "source"
    LlamaForCausalLM(tiny_llama_config(num_hidden_layers=2)).save_pretrained(source)
    vanilla = AutoModelForCausalLM.from_pretrained(source)
    conversions_before = registry_state()
    install(PackSpec("qkv", fused_qkv_pack()))
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(source)
    attention = model.model.layers[0].self_attn
    assert type(attention).__name__ == "FusedQKVAttention" and tuple(attention.qkv_proj.weight.shape) == (64, 32)
    torch.testing.assert_close(logits(model), logits(vanilla), rtol=0, atol=1e-5)
    assert registry_state() == conversions_before  # the converter was registered for the load only
    snapshot.assert_unchanged()
    plan = plan_of(model)
    assert [entry.origin for entry in plan.conversions.lists["llama"]] == ["qkv"]

    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    original, written = tensors(source), tensors(saved)
    assert {k: tuple(v.shape) for k, v in written.items()} == {k: tuple(v.shape) for k, v in original.items()}
    assert all(torch.equal(written[key], original[key]) for key in original)
    hfpatch_core.disable()
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(saved)), logits(vanilla), rtol=0, atol=1e-5)


def test_a_converted_load_with_fewer_layers_and_a_pickle_round_trip(install, llama_checkpoint) -> None:
    # Layer 1's tensors are unexpected for a 1-layer model, as in vanilla transformers:
    # not the converting pack's doing.  The patched model pickles (torch.save(model)).
    install(PackSpec("qkv", fused_qkv_pack()))
    vanilla = AutoModelForCausalLM.from_pretrained(llama_checkpoint, num_hidden_layers=1)
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, num_hidden_layers=1)
    assert len(model.model.layers) == 1 and type(model.model.layers[0].self_attn).__name__ == "FusedQKVAttention"
    torch.testing.assert_close(logits(model), logits(vanilla), rtol=0, atol=1e-5)
    copy = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(logits(copy), logits(model), rtol=0, atol=0)
    assert copy.save_pretrained.__self__ is copy  # the guard came along, bound to the copy


def test_a_quantized_patched_model_saves_with_the_check_on_what_vanilla_writes(
    install, llama_checkpoint, tmp_path
) -> None:
    """A quantizer adds tensors (scales) vanilla has no name for: the check still requires
    every vanilla weight, and does not refuse the quantizer's own."""
    install(PackSpec("qkv", fused_qkv_pack()))
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    attention = model.model.layers[0].self_attn
    attention.qkv_proj.register_buffer("input_scale", torch.ones(1, dtype=torch.float32))
    with pytest.raises(WeightLayoutError, match=r"qkv_proj.input_scale: would be written"):
        model.save_pretrained(tmp_path / "unquantized")  # an extra tensor on a plain model is refused
    attention.qkv_proj.register_buffer("input_zero_point", torch.zeros(1, dtype=torch.int8))
    model.save_pretrained(tmp_path / "quantized")
    written = tensors(tmp_path / "quantized")
    assert "model.layers.0.self_attn.q_proj.weight" in written
    assert "model.layers.0.self_attn.qkv_proj.weight" not in written
    del attention.qkv_proj.input_scale  # a quantized model that lost a vanilla weight is still refused
    object.__setattr__(model, "_weight_conversions", [])
    with pytest.raises(WeightLayoutError, match="vanilla transformers expects it"):
        model.save_pretrained(tmp_path / "broken")


def test_the_save_guard_rebinds_as_a_bound_method(install, llama_checkpoint, tmp_path) -> None:
    """Wrappers of save_pretrained (llm-compressor's) take ``__self__`` / ``__func__`` and rebind them."""
    install(PackSpec("qkv", fused_qkv_pack(converter="chunk")))
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    bound = model.save_pretrained
    assert bound.__self__ is model
    rebound = bound.__func__.__get__(model, type(model))
    with pytest.raises(WeightLayoutError):  # the layout check runs through the rebound function
        rebound(tmp_path / "saved")
    assert not (tmp_path / "saved" / "model.safetensors").exists()


def test_equal_chunk_reversal_is_caught_before_writing(install, llama_checkpoint, tmp_path) -> None:
    install(PackSpec("qkv", fused_qkv_pack(converter="chunk")))
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    with pytest.raises(WeightLayoutError) as caught:
        model.save_pretrained(tmp_path / "out")
    message = str(caught.value)
    # torch.chunk splits the fused 64 rows into 22, 22 and 20 instead of 32, 16 and 16
    assert "model.layers.0.self_attn.q_proj.weight: would be written as (22, 32), the original layout is (32, 32)" in (
        message
    )
    assert "model.layers.1.self_attn.k_proj.weight: would be written as (22, 32), the original layout is (16, 32)" in (
        message
    )
    assert "SizedConcatenate" in message
    assert not (tmp_path / "out" / "model.safetensors").exists()
    model.save_pretrained(tmp_path / "fused", save_original_format=False)  # an explicit opt-out still works
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors(tmp_path / "fused")


def test_a_missing_converter_is_a_weight_layout_error_naming_key_and_pack(install, llama_checkpoint, snapshot) -> None:
    install(PackSpec("qkv", fused_qkv_pack(converter="none")))
    hfpatch_core.enable()
    with pytest.raises(WeightLayoutError) as caught:
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    message = str(caught.value)
    assert "model.layers.0.self_attn.qkv_proj.weight: missing from the checkpoint" in message
    assert "model.layers.1.self_attn.q_proj.weight: in the checkpoint but not used by the model" in message
    assert "touched by pack 'qkv'" in message and "provide_converters" in message
    snapshot.assert_unchanged()


def test_two_packs_converting_one_model_type_compose(install, llama_checkpoint, tmp_path) -> None:
    install(PackSpec("qkv", fused_qkv_pack()), PackSpec("gateup", FUSED_MLP_PACK))
    vanilla = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    hfpatch_core.enable()
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(model.model.layers[0].mlp).__name__ == "FusedGateUpMLP"
    assert sorted(entry.origin for entry in plan_of(model).conversions.lists["llama"]) == ["gateup", "qkv"]
    torch.testing.assert_close(logits(model), logits(vanilla), rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    assert set(tensors(tmp_path / "saved")) == set(tensors(llama_checkpoint))


def test_a_pack_whose_patches_all_lose_keeps_its_converters_out(install, llama_checkpoint, snapshot) -> None:
    # gateup's converter fuses gate/up for its own MLP; when mlp's plain MLP wins, the
    # checkpoint must load unconverted into it.
    install(PackSpec("gateup", FUSED_MLP_PACK), PackSpec("mlp", MLP_PACK))
    vanilla = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    hfpatch_core.enable("all,mlp@+1")
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    plan = plan_of(model)
    assert type(model.model.layers[0].mlp).__name__ == "PackMLP" and [lost.claim.pack for lost in plan.lost] == [
        "gateup"
    ]
    assert not plan.conversions
    assert [(claim.pack, reason) for claim, reason in plan.conversions.lost] == [
        ("gateup", "no patch of pack 'gateup' is applied")
    ]
    torch.testing.assert_close(logits(model), logits(vanilla), rtol=0, atol=0)
    hfpatch_core.enable("all,gateup@+1")
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(model.model.layers[0].mlp).__name__ == "FusedGateUpMLP"
    assert [entry.origin for entry in plan_of(model).conversions.lists["llama"]] == ["gateup"]
    hfpatch_core.disable()
    snapshot.assert_unchanged()


def test_a_pack_that_loses_one_of_two_classes_converts_for_the_winning_one_only(
    install, llama_checkpoint, tmp_path, capsys, monkeypatch
) -> None:
    # fused wins LlamaAttention and loses LlamaMLP to mlp: only the converter whose
    # patch_targets name the attention patch may apply, or the checkpoint's gate/up would
    # be fused for a plain MLP that has no gate_up_proj.
    install(PackSpec("fused", fused_attention_and_mlp_pack()), PackSpec("mlp", MLP_PACK))
    vanilla = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    hfpatch_core.enable("all,mlp@+1")
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    layer = model.model.layers[0]
    assert (type(layer.self_attn).__name__, type(layer.mlp).__name__) == ("FusedQKVAttention", "PackMLP")
    torch.testing.assert_close(logits(model), logits(vanilla), rtol=0, atol=1e-5)
    conversions = plan_of(model).conversions
    assert [describe_transform(entry.transform) for entry in conversions.lists["llama"]] == [
        describe_transform(fused_qkv_transform(conversions))
    ]
    [(claim, reason)] = conversions.lost
    assert claim.pack == "fused" and claim.converter.patch_targets == ("LlamaMLP",)
    assert reason.startswith("its patch 'LlamaMLP' is not applied: priority 0 < 1 of pack 'mlp'")
    model.save_pretrained(tmp_path / "saved")
    assert set(tensors(tmp_path / "saved")) == set(tensors(llama_checkpoint))

    from hfpatch_core.cli import main

    monkeypatch.setenv("HF_PATCH_PACKS", "all,mlp@+1")
    assert main(["explain", str(llama_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "not applied: pack 'fused' (converter for 'llama': ['mlp.gate_proj.weight', 'mlp.up_proj.weight'])" in out
    assert main(["explain", str(llama_checkpoint), "--json"]) == 0
    lost = json.loads(capsys.readouterr().out)["conversions_lost"]
    assert [(entry["pack"], entry["reason"][:28]) for entry in lost] == [("fused", "its patch 'LlamaMLP' is not ")]


def fused_qkv_transform(conversions) -> object:
    return next(t for claim in conversions.claims for t in claim.converter.transforms if "qkv" in describe_transform(t))


def test_a_patch_target_the_pack_does_not_return_is_a_pack_error(install, llama_checkpoint) -> None:
    # A misspelt patch target would leave the pack's MLP without its converter: the pack
    # is skipped as a failing pack is, and the model loads vanilla.
    install(PackSpec("fused", fused_attention_and_mlp_pack(mlp_targets="('LlamaMlp',)")))
    vanilla = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    hfpatch_core.enable()
    with pytest.warns(PackWarning, match=r"names patch target 'LlamaMlp', but the pack returned no patch for it"):
        model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    layer = model.model.layers[0]
    assert (type(layer.self_attn).__name__, type(layer.mlp).__name__) == ("LlamaAttention", "LlamaMLP")
    torch.testing.assert_close(logits(model), logits(vanilla), rtol=0, atol=0)
    hfpatch_core.enable(strict=True)
    with pytest.raises(hfpatch_core.PackError, match=r"its patches: \['LlamaAttention', 'LlamaMLP'\]"):
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)


def test_two_packs_converting_the_same_tensors_conflict_or_follow_priority(install, llama_checkpoint) -> None:
    install(
        PackSpec("one", fused_qkv_pack(class_name="OneAttention", priority=0)),
        PackSpec("two", fused_qkv_pack(class_name="TwoAttention", priority=0)),
    )
    hfpatch_core.enable()
    with pytest.raises(hfpatch_core.PatchConflictError):  # their patches tie first
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    claims = [
        ConverterClaim(pack, "1", Converter("llama", [WeightRenaming("mlp.fc", "mlp.proj")]), 0) for pack in ("a", "b")
    ]
    overlap = ConversionScope().overlap
    with pytest.raises(ConverterConflictError) as caught:
        resolve_converters(claims, overlap=overlap)
    assert "packs 'a' and 'b' both convert checkpoint tensors ['mlp.fc'] for 'llama'" in str(caught.value)
    assert "HF_PATCH_PACKS=all,a@+1" in str(caught.value)
    raised = [claims[0], ConverterClaim("b", "1", claims[1].converter, 5)]
    result = resolve_converters(raised, overlap=overlap)
    assert [claim.pack for claim in result.winners] == ["b"] and "priority 0 < 5" in result.lost[0][1]
    hfpatch_core.enable("all,two@+1")
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(model.model.layers[0].self_attn).__name__ == "TwoAttention"
    assert [entry.origin for entry in plan_of(model).conversions.lists["llama"]] == ["two"]


def test_replaces_removes_a_builtin_transform_and_the_rest_stays() -> None:
    builtin = conversion_mapping.get_checkpoint_conversion_mapping("qwen2_moe")
    assert builtin is not None and len(builtin) == 2
    converter = Converter("qwen2_moe", [], replaces=("mlp.experts.*.gate_proj.weight",))
    result = compose(
        [ConverterClaim("experts", "1", converter, 0)], builtin=conversion_mapping.get_checkpoint_conversion_mapping
    )
    remaining = result.lists["qwen2_moe"]
    assert [entry.origin for entry in remaining] == [BUILTIN]
    assert remaining[0].transform.target_patterns == builtin[1].target_patterns
    assert [removal.pattern for removal in result.removed] == ["mlp.experts.*.gate_proj.weight"]
    unmatched = compose(
        [ConverterClaim("typo", "1", Converter("qwen2_moe", [], replaces=("mlp.expert.*.gate",)), 0)],
        builtin=conversion_mapping.get_checkpoint_conversion_mapping,
    )
    assert unmatched.unmatched[0][1] == "mlp.expert.*.gate" and len(unmatched.lists["qwen2_moe"]) == 2


def test_class_name_keys_take_precedence_and_keep_the_model_type_list() -> None:
    claims = [
        ConverterClaim("typed", "1", Converter("qwen2_moe", [WeightRenaming("a", "b")]), 0),
        ConverterClaim("classy", "1", Converter("Qwen2MoeForCausalLM", [WeightRenaming("c", "d")]), 1),
    ]
    scope = ConversionScope(frozenset(["qwen2_moe"]), {"Qwen2MoeForCausalLM": "qwen2_moe"})
    result = compose(claims, builtin=conversion_mapping.get_checkpoint_conversion_mapping, scope=scope)
    assert [entry.origin for entry in result.lists["Qwen2MoeForCausalLM"]] == ["classy", "typed", BUILTIN, BUILTIN]
    assert [entry.origin for entry in result.lists["qwen2_moe"]] == ["typed", BUILTIN, BUILTIN]
    folded = compose(
        claims,
        builtin=conversion_mapping.get_checkpoint_conversion_mapping,
        scope=dataclasses.replace(scope, class_keys_supported=False),
    )
    assert list(folded.lists) == ["qwen2_moe"]
    assert [entry.origin for entry in folded.lists["qwen2_moe"]] == ["classy", "typed", BUILTIN, BUILTIN]


def test_a_replaces_entry_that_matches_nothing_warns(install, llama_checkpoint) -> None:
    source = """
from hfpatch_core import Converter, hookimpl
@hookimpl
def provide_converters(context):
    return [Converter(context.model_type, [], replaces=("no.such.pattern",))]
"""
    install(PackSpec("typo", source))
    hfpatch_core.enable()
    with pytest.warns(PackWarning, match=r"replaces 'no.such.pattern', which matches no transform"):
        AutoModelForCausalLM.from_pretrained(llama_checkpoint)


def test_from_config_models_save_through_the_packs_conversions(install, tmp_path) -> None:
    install(PackSpec("qkv", fused_qkv_pack()))
    hfpatch_core.enable()
    config = tiny_llama_config()
    model = AutoModelForCausalLM.from_config(config)
    assert type(model.model.layers[0].self_attn).__name__ == "FusedQKVAttention"
    model.save_pretrained(tmp_path / "saved")
    hfpatch_core.disable()
    written = tensors(tmp_path / "saved")
    assert tuple(written["model.layers.0.self_attn.k_proj.weight"].shape) == (16, 32)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=1e-5)


def test_models_built_in_patched_save_through_the_packs_conversions(install, tmp_path) -> None:
    install(PackSpec("qkv", fused_qkv_pack()))
    config = tiny_llama_config()
    with hfpatch_core.patched(config, model_class=LlamaForCausalLM) as plan:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    assert type(model.model.layers[0].self_attn).__name__ == "FusedQKVAttention"
    assert plan_of(model) is plan and plan_of(model.model) is None
    model.save_pretrained(tmp_path / "saved")
    written = tensors(tmp_path / "saved")
    assert tuple(written["model.layers.0.self_attn.k_proj.weight"].shape) == (16, 32)
    assert not any("qkv_proj" in key for key in written)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=1e-5)


def test_nested_patched_blocks_and_loads_inside_one_save_the_original_layout(
    install, llama_checkpoint, tmp_path
) -> None:
    install(PackSpec("qkv", fused_qkv_pack()))
    config = tiny_llama_config()
    with (
        hfpatch_core.patched(config, model_class=LlamaForCausalLM),  # hfpatch not enabled
        hfpatch_core.patched(config, model_class=LlamaForCausalLM) as inner,
    ):
        model = LlamaForCausalLM(config)
    assert plan_of(model) is inner and inner.replaced["LlamaAttention"].pack == "qkv" and not inner.lost
    model.save_pretrained(tmp_path / "nested")
    assert not any("qkv_proj" in key for key in tensors(tmp_path / "nested"))

    hfpatch_core.enable()
    with hfpatch_core.patched(config, model_class=LlamaForCausalLM):
        loaded = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    assert type(loaded.model.layers[0].self_attn).__name__ == "FusedQKVAttention"
    loaded.save_pretrained(tmp_path / "loaded")
    assert set(tensors(tmp_path / "loaded")) == set(tensors(llama_checkpoint))


def test_explain_shows_composed_lists_with_their_origins(install) -> None:
    from hfpatch_core._session.session import new_session
    from hfpatch_core.cli.explain import explain

    source = """
from hfpatch_core import Converter, hookimpl
@hookimpl
def provide_converters(context):
    if context.model_type != "qwen2_moe":
        return []
    return [Converter("qwen2_moe", [], replaces=("mlp.experts.*.down_proj.weight",))]
"""
    install(PackSpec("trim", source))
    data = explain("qwen2_moe", new_session("trim")).to_json()
    assert [entry["from"] for entry in data["conversions"]["qwen2_moe"]] == ["transformers"]
    assert "gate_up_proj" in data["conversions"]["qwen2_moe"][0]["transform"]
    assert data["conversions_removed"][0]["by"] == "trim" and "down_proj" in data["conversions_removed"][0]["transform"]
