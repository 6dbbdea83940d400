from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaModel

import hfpatch_core
from packs import PackSpec

RECORDED_PACK = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

class PackLayer(LlamaDecoderLayer):
    pass

class PackAttention(LlamaAttention):
    pass

@hookimpl
def provide_patches(context):
    return [Patch("LlamaDecoderLayer", PackLayer), Patch("LlamaAttention", PackAttention)]
"""


def outputs(model):
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids, output_hidden_states=True, output_attentions=True)


def recorder_state() -> dict:
    state = {}
    for key, value in (LlamaModel._can_record_outputs or {}).items():
        items = value if isinstance(value, list) else [value]
        state[key] = [getattr(item, "target_class", item) for item in items]
    return state


def test_output_recorders_are_restored_and_capture_still_works(install, llama_checkpoint, snapshot) -> None:
    before = recorder_state()
    install(PackSpec("rec", RECORDED_PACK))
    hfpatch_core.enable()
    patched = AutoModelForCausalLM.from_pretrained(llama_checkpoint, attn_implementation="eager")
    assert type(patched.model.layers[0]).__name__ == "PackLayer"
    assert recorder_state() == before
    result = outputs(patched)
    assert len(result.hidden_states) == 3 and len(result.attentions) == 2
    assert all(attention is not None for attention in result.attentions)
    hfpatch_core.disable()
    vanilla = AutoModelForCausalLM.from_pretrained(llama_checkpoint, attn_implementation="eager")
    again = outputs(vanilla)
    assert len(again.hidden_states) == 3 and len(again.attentions) == 2
    for ours, theirs in zip(result.hidden_states, again.hidden_states, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    snapshot.assert_unchanged()


PROXY_PACK = """
import torch.nn as nn
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaAttention

class ProxyAttention(nn.Module):
    '''LlamaAttention's modules and forward, in a class that is not a LlamaAttention.'''

    def __init__(self, config, layer_idx):
        super().__init__()
        inner = LlamaAttention(config, layer_idx)
        vars(self).update({key: value for key, value in vars(inner).items() if key != "training"})

    def forward(self, *args, **kwargs):
        return LlamaAttention.forward(self, *args, **kwargs)

@hookimpl
def provide_patches(context):
    return [Patch("LlamaAttention", ProxyAttention)]
"""


def test_a_replacement_outside_the_recorded_class_is_still_recorded(install, llama_checkpoint, snapshot) -> None:
    # LlamaModel records attentions by class; ProxyAttention is not a subclass, so the
    # recorders must point at it for this model (and only for it).
    before = recorder_state()
    install(PackSpec("proxy", PROXY_PACK))
    hfpatch_core.enable()
    patched = AutoModelForCausalLM.from_pretrained(llama_checkpoint, attn_implementation="eager")
    assert type(patched.model.layers[0].self_attn).__name__ == "ProxyAttention"
    assert recorder_state() == before
    result = outputs(patched)
    assert len(result.attentions) == 2 and all(attention is not None for attention in result.attentions)
    hfpatch_core.disable()
    vanilla = AutoModelForCausalLM.from_pretrained(llama_checkpoint, attn_implementation="eager")
    for ours, theirs in zip(result.attentions, outputs(vanilla).attentions, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    snapshot.assert_unchanged()
