"""``hfpatch_core.apply`` / ``revert`` on PEFT models: the base model patched around its adapters."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

import hfpatch_core
from conftest import tiny_llama_config
from hfpatch_core import ApplyError, plan_of
from hfpatch_core.testing import load_model, safetensors_of
from packs import FUSED_MLP_PACK, PackSpec, fused_attention_and_mlp_pack


def lora(**overrides: object) -> LoraConfig:
    # init_lora_weights=False: B is random too, so the adapters change the logits
    values: dict[str, object] = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    values.update(overrides)
    return LoraConfig(**values)  # type: ignore[arg-type]


def built() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids()).logits


def snapshot_of(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, torch.Tensor], dict[str, bool]]:
    return (
        dict(model.named_modules()),
        {key: value.clone() for key, value in model.state_dict().items()},
        {name: p.requires_grad for name, p in model.named_parameters()},
    )


def assert_as_before(model: nn.Module, before: tuple[dict, dict, dict], *, same_modules: bool) -> None:
    modules, state, trainable = before
    if same_modules:
        assert all(a is b for (_, a), b in zip(model.named_modules(), modules.values(), strict=True))
    else:
        assert {n: type(m) for n, m in model.named_modules()} == {n: type(m) for n, m in modules.items()}
    now = model.state_dict()
    assert sorted(now) == sorted(state)
    assert all(now[key].dtype == state[key].dtype and torch.equal(now[key], state[key]) for key in state)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == trainable


@contextlib.contextmanager
def load_reports() -> Iterator[list[str]]:
    """What transformers' loader warns about weights in the block (missing, unexpected, not initialized)."""
    found: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if any(word in message for word in ("MISSING", "UNEXPECTED", "not initialized", "not used")):
                found.append(message)

    handler = Handler(logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def adapter_files(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    return safetensors_of(directory), (directory / "adapter_config.json").read_text()


def test_a_peft_model_is_patched_around_its_adapters_and_reverts_exactly(
    install, llama_checkpoint: Path, tmp_path: Path, snapshot
) -> None:
    install(PackSpec("fused-mlp", FUSED_MLP_PACK))
    torch.manual_seed(1)
    # LoRA on the attention, and the lm_head trained in full (a modules_to_save copy)
    model = get_peft_model(load_model(llama_checkpoint), lora(modules_to_save=["lm_head"])).eval()
    model.save_pretrained(tmp_path / "adapter")
    before = snapshot_of(model)
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert len(adapters) == 9  # lora_A and lora_B of q_proj and v_proj in two layers, the lm_head copy

    with load_reports() as reports:
        plan = hfpatch_core.apply(model, packs="fused-mlp", strict=True)
    assert not reports  # the weights went through the load without the adapters: none missing or unexpected

    base = model.get_base_model()
    assert plan is plan_of(base) and plan.fingerprint == plan_of(load_model(llama_checkpoint, "fused-mlp")).fingerprint
    assert type(base.model.layers[0].mlp).__name__ == "FusedGateUpMLP"
    assert type(base.model.layers[0].self_attn.q_proj).__module__.startswith("peft.tuners.lora")
    # the PEFT model on a base loaded with the pack: the same adapters, the same logits
    reference = PeftModel.from_pretrained(load_model(llama_checkpoint, "fused-mlp"), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=1e-5)
    # the adapters are the same tensors, the only trainable ones; the swapped modules stay frozen
    assert all(model.get_parameter(name) is p for name, p in adapters.items())
    assert {name for name, p in model.named_parameters() if p.requires_grad} == set(adapters)
    assert not base.model.layers[0].mlp.gate_up_proj.weight.requires_grad
    model.save_pretrained(tmp_path / "again")
    tensors, config = adapter_files(tmp_path / "again")
    expected, expected_config = adapter_files(tmp_path / "adapter")
    assert config == expected_config and sorted(tensors) == sorted(expected)
    assert all(torch.equal(tensors[key], expected[key]) for key in expected)
    model.train()
    model(input_ids=ids(), labels=ids()).loss.backward()  # the adapters still learn, through the fused MLP
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters.values())
    assert all(p.grad is None for name, p in model.named_parameters() if name not in adapters)
    model.zero_grad(set_to_none=True)
    model.eval()
    snapshot.assert_unchanged()

    with load_reports() as reports:
        hfpatch_core.revert(model)
    assert not reports
    assert_as_before(model, before, same_modules=False)
    assert plan_of(base) is None and all(model.get_parameter(name) is p for name, p in adapters.items())
    snapshot.assert_unchanged()


def test_a_module_holding_adapters_is_refused_and_nothing_changes(install, tmp_path: Path, snapshot) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()), PackSpec("fused-mlp", FUSED_MLP_PACK))
    torch.manual_seed(0)
    get_peft_model(built(), lora()).save_pretrained(tmp_path / "adapter")
    model = PeftModel.from_pretrained(built(), tmp_path / "adapter")
    before = snapshot_of(model)
    with pytest.raises(ApplyError) as caught:
        hfpatch_core.apply(model, packs="fused")
    message = str(caught.value)
    assert message.startswith("pack 'fused' cannot replace LlamaAttention at model.layers.0.self_attn: ")
    assert "holds PEFT adapter layers (q_proj (lora.Linear), v_proj (lora.Linear)) (and 1 more module)" in message
    assert "Apply the packs before adding adapters" in message and 'packs="all,-fused"' in message
    assert_as_before(model, before, same_modules=True)
    snapshot.assert_unchanged()
    reference = logits(model)
    hfpatch_core.apply(model, packs="fused-mlp")  # the same model, with a pack that leaves the attention alone
    assert type(model.get_base_model().model.layers[0].mlp).__name__ == "FusedGateUpMLP"
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=1e-5)
    hfpatch_core.revert(model)
    assert_as_before(model, before, same_modules=False)

    # a module trained in full (modules_to_save) is an adapter too: its copy would be lost
    wrapped = get_peft_model(built(), lora(target_modules=["o_proj"], modules_to_save=["mlp"]))
    before = snapshot_of(wrapped)
    with pytest.raises(ApplyError, match=r"at model.layers.0.mlp: it holds PEFT adapter layers \(model.layers.0.mlp "):
        hfpatch_core.apply(wrapped, packs="fused-mlp")
    assert_as_before(wrapped, before, same_modules=True)


def _add_adapter_refusal() -> str | None:
    """Why transformers' ``add_adapter`` cannot run with the installed peft (5.25 wants peft>=0.22), or None."""
    from transformers.utils.peft_utils import check_peft_version

    try:
        from transformers.integrations.peft import MIN_PEFT_VERSION

        check_peft_version(MIN_PEFT_VERSION)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "inject",
    [
        "inject_adapter_in_model",
        pytest.param(
            "add_adapter",
            marks=pytest.mark.skipif(_add_adapter_refusal() is not None, reason=str(_add_adapter_refusal())),
        ),
    ],
)
def test_adapters_injected_into_the_transformers_model(
    inject: str, install, llama_checkpoint: Path, tmp_path: Path
) -> None:
    """Adapters in the transformers model itself, no PeftModel around it: peft's
    ``inject_adapter_in_model``, or transformers' ``add_adapter`` (``_hf_peft_config_loaded``,
    whose ``save_pretrained`` writes the adapter alone)."""
    from peft import inject_adapter_in_model

    install(PackSpec("fused-mlp", FUSED_MLP_PACK))
    model = load_model(llama_checkpoint).eval()
    torch.manual_seed(2)
    config = lora(target_modules=["q_proj", "o_proj"])
    if inject == "add_adapter":
        model.add_adapter(config)
        model.save_pretrained(tmp_path / "adapter")
    else:
        inject_adapter_in_model(config, model)
    reference = logits(model)
    before = snapshot_of(model)
    hfpatch_core.apply(model, packs="fused-mlp", strict=True)
    assert type(model.model.layers[1].mlp).__name__ == "FusedGateUpMLP"
    assert type(model.model.layers[1].self_attn.o_proj).__module__.startswith("peft.tuners.lora")
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=1e-5)
    if inject == "add_adapter":
        model.save_pretrained(tmp_path / "again")
        (tensors, _), (expected, _) = adapter_files(tmp_path / "again"), adapter_files(tmp_path / "adapter")
        assert sorted(tensors) == sorted(expected) and all(torch.equal(tensors[k], expected[k]) for k in expected)
    hfpatch_core.revert(model)
    assert_as_before(model, before, same_modules=False)


def test_adapters_added_into_a_swapped_module_after_apply_block_revert(install) -> None:
    install(PackSpec("fused", fused_attention_and_mlp_pack()))
    base = built()
    hfpatch_core.apply(base, packs="fused")
    model = get_peft_model(base, lora(target_modules=["qkv_proj"]))
    before = snapshot_of(model)
    with pytest.raises(ApplyError) as caught:
        hfpatch_core.revert(model)
    assert str(caught.value).startswith(
        "cannot revert LlamaForCausalLM: model.layers.0.self_attn, which pack 'fused' put there, holds PEFT adapter "
        "layers added since apply(): qkv_proj (lora.Linear)"
    )
    assert_as_before(model, before, same_modules=True)

    # a swapped module itself wrapped for full training (modules_to_save)
    other = built()
    hfpatch_core.apply(other, packs="fused")
    wrapped = get_peft_model(other, lora(target_modules=["lm_head"], modules_to_save=["mlp"]))
    with pytest.raises(ApplyError, match=r"model.layers.0.mlp, which pack 'fused' put there, holds PEFT adapter"):
        hfpatch_core.revert(wrapped)
    assert type(other.model.layers[0].mlp).__name__ == "ModulesToSaveWrapper"
