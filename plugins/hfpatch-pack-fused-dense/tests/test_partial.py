"""Partial fusion: where the forward gives only some parts one input, those parts are fused.

An encoder-decoder's attention class serves as self-attention and as cross-attention:
``q_proj(hidden_states)``, ``k_proj(current_states)``, ``v_proj(current_states)``.  Only k
and v provably share an input, so the pack fuses them into ``kv_proj`` and leaves
``q_proj`` the module's own ``nn.Linear``.  Every test compares with vanilla transformers.
"""

from __future__ import annotations

from pathlib import Path

import hfpatch_pack_fused_dense
import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForSeq2SeqLM

from conftest import PACK
from hfpatch_core import LoadContext
from hfpatch_core.authoring.packing import PackedPart
from hfpatch_core.testing import (
    TrainingTolerances,
    assert_pack_equivalent,
    load_model,
    safetensors_of,
    tiny_checkpoint,
    training_batches,
)
from hfpatch_core.testing.training import enable_checkpointing

ATOL = 1e-5
VOCAB = 128


@pytest.fixture(scope="module")
def biogpt() -> Path:
    """A decoder-only causal LM whose attention class is written for cross-attention too."""
    return tiny_checkpoint("biogpt", seed=3, initializer_range=0.2)


@pytest.fixture(scope="module")
def bart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An encoder-decoder: the decoder's ``encoder_attn`` reads the encoder's output for k/v."""
    config = AutoConfig.for_model(
        "bart",
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        init_std=0.2,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    torch.manual_seed(4)
    path = tmp_path_factory.mktemp("bart")
    AutoModelForSeq2SeqLM.from_config(config).save_pretrained(path)
    return path


def test_a_cross_attention_class_is_exact_fusing_k_and_v(biogpt: Path) -> None:
    """Logits, greedy generation, the saved layout and the in-place apply, against vanilla."""
    report = assert_pack_equivalent(PACK, biogpt, expected_replacements=["BioGptAttention"], apply_path=True)
    assert report.round_trip and report.max_abs_diff is not None and report.max_abs_diff <= ATOL
    assert report.generation_match
    model = load_model(biogpt, PACK)
    attention = model.biogpt.layers[0].self_attn
    assert type(attention).__name__ == "FusedKVBioGptAttention"
    assert type(attention.q_proj) is nn.Linear and "qkv_proj" not in attention._modules
    assert isinstance(attention.k_proj, PackedPart) and isinstance(attention.v_proj, PackedPart)
    assert attention.kv_proj.weight.shape[0] == attention.k_proj.out_features + attention.v_proj.out_features
    assert {key for key in model.state_dict() if ".kv_proj." in key}
    assert not any(".kv_proj." in key for key in safetensors_of(biogpt))


def _hold_key_biases(model: nn.Module) -> None:
    """Give every attention's k bias a zero gradient.

    Without rotary embeddings a bias on k adds ``q . b`` to every score of a query alike, which
    the softmax cancels: its gradient is zero in exact arithmetic, and what backward computes
    for it is rounding noise (1e-9 here), which AdamW's normalisation turns into steps of the
    full learning rate in the noise's direction, in vanilla as well.  Held at zero on both
    sides, so the comparison checks every parameter that learns.
    """
    for module in model.modules():
        if "kv_proj" in module._modules:
            rows = module.k_proj.out_features
            module.kv_proj.bias.register_hook(lambda grad, rows=rows: torch.cat([grad[:rows] * 0, grad[rows:]]))
        elif type(module).__name__ == "BioGptAttention":
            module.k_proj.bias.register_hook(torch.zeros_like)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_matches_vanilla(biogpt: Path, checkpointing: bool) -> None:
    """5 AdamW steps (dropout on, the same masks): the same losses and, after every step, the same
    parameters, read by their checkpoint names (the patched model's k/v are views of ``kv_proj``)."""
    tolerances = TrainingTolerances.default(torch.float32)
    batches = training_batches(VOCAB, 5, pad_token_id=1)
    runs = []
    for packs in (None, PACK):
        model = load_model(biogpt, packs)
        _hold_key_biases(model)
        if checkpointing:
            enable_checkpointing(model)
        model.train()
        names = [name for name, _ in load_model(biogpt).named_parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        measured = []
        for step, (ids, mask, labels) in enumerate(batches):
            torch.manual_seed(step)
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            optimizer.step()
            parameters = {name: _tensor(model, name).detach().clone() for name in names}
            measured.append((loss.item(), parameters))
        runs.append(measured)
    for step, ((expected_loss, expected), (loss, found)) in enumerate(zip(*runs, strict=True)):
        assert abs(loss - expected_loss) <= tolerances.loss, step
        for name, value in expected.items():
            difference = (found[name] - value).abs().max().item()
            assert difference <= tolerances.parameters, (step, name, difference)
    # the model learned: the parts' weights moved between the first and the last step
    first, last = runs[1][0][1], runs[1][-1][1]
    for part in ("q_proj", "k_proj", "v_proj"):
        name = f"biogpt.layers.0.self_attn.{part}.weight"
        assert not torch.equal(first[name], last[name]), name


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter ``name`` of vanilla's layout: on the patched model, a part's view of the fused one."""
    path, _, attribute = name.rpartition(".")
    tensor: torch.Tensor = getattr(model.get_submodule(path), attribute)
    return tensor


def test_an_encoder_decoder_matches_vanilla_with_its_cross_attention(bart: Path, tmp_path: Path) -> None:
    """bart's encoder self-attention, decoder self-attention and cross-attention all fuse k/v;
    logits and greedy generation with the encoder-decoder cache match, and it saves bart's layout."""
    vanilla = load_model(bart, model_class=AutoModelForSeq2SeqLM)
    patched = load_model(bart, PACK, model_class=AutoModelForSeq2SeqLM)
    cross = patched.model.decoder.layers[0].encoder_attn
    assert type(cross).__name__ == "FusedKVBartAttention" and type(cross.q_proj) is nn.Linear
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    decoder_ids = torch.randint(3, VOCAB, (2, 5), generator=generator)
    with torch.no_grad():
        expected = vanilla(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        found = patched(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        torch.testing.assert_close(found, expected, atol=ATOL, rtol=0)
        settings = dict(max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert torch.equal(
            patched.generate(input_ids=ids, attention_mask=mask, **settings),
            vanilla.generate(input_ids=ids, attention_mask=mask, **settings),
        )
    patched.save_pretrained(tmp_path)
    saved, source = safetensors_of(tmp_path), safetensors_of(bart)
    assert saved.keys() == source.keys()
    assert all(torch.equal(saved[key], source[key]) for key in source)


def test_a_seeded_adapter_on_all_linear_starts_from_vanilla_adapter(biogpt: Path) -> None:
    """``kv_proj`` is registered just before ``k_proj`` and is no ``nn.Linear``: PEFT wraps
    q/k/v/out in vanilla's order and draws vanilla's adapter; the adapters name the parts."""
    adapters = []
    for packs in (None, PACK):
        model = load_model(biogpt, packs)
        torch.manual_seed(1234)
        wrapped = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        adapters.append({key: value.clone() for key, value in wrapped.state_dict().items() if "lora_" in key})
    vanilla, patched = adapters
    assert list(patched) == list(vanilla) and any(".k_proj.lora_A" in key for key in vanilla)
    for key, value in vanilla.items():
        assert torch.equal(patched[key], value), key


def test_the_fused_pair_declares_its_sharding_and_converter(biogpt: Path) -> None:
    config = AutoConfig.from_pretrained(biogpt)
    context = LoadContext("biogpt", "BioGptForCausalLM", config, parallel=("tp",))
    (patch,) = hfpatch_pack_fused_dense.provide_patches(context)
    assert patch.target == "BioGptAttention"
    assert (patch.replacement.hfpatch_tp_plan, patch.replacement.hfpatch_fsdp_plan) == ({"kv_proj": "colwise"}, {})
    assert patch.replacement.hfpatch_packed_modules == {"kv_proj": ("k_proj", "v_proj")}
    (converter,) = hfpatch_pack_fused_dense.provide_converters(context)
    patterns = sorted(tuple(transform.source_patterns) for transform in converter.transforms)
    assert patterns == [
        ("self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        ("self_attn.k_proj.input_", "self_attn.v_proj.input_"),  # a quantized checkpoint's activation scales
        ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ]
