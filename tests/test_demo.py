from __future__ import annotations

import io

from transformers import monkey_patching

import hfpatch_core
from hfpatch_core.demo import EXAMPLE_PACK, run_demo
from packs import PackSpec

CHECKS = ["classes replaced", "logits match", "greedy generation matches", "save round trip", "nothing left behind"]


def test_demo_with_the_first_party_pack_passes_every_check(snapshot) -> None:
    out = io.StringIO()
    report = run_demo(packs="qwen-moe", out=out)
    text = out.getvalue()
    assert report.ok, text
    assert report.model_type == "qwen2_moe" and set(report.replaced) == {"Qwen2MoeExperts", "Qwen2MoeAttention"}
    for check in CHECKS:
        assert f"PASS  {check}" in text
    assert "Converters applied:" in text and "SizedConcatenate" in text and "removed WeightConverter" in text
    assert not hfpatch_core.is_enabled() and monkey_patching.get_patch_mapping() == {}
    snapshot.assert_unchanged()


def test_demo_with_the_example_pack_on_llama(snapshot) -> None:
    out = io.StringIO()
    report = run_demo(packs=EXAMPLE_PACK, out=out)
    assert report.ok and report.replaced == {"LlamaMLP": "CountingMLP", "LlamaRMSNorm": "CountingRMSNorm"}
    snapshot.assert_unchanged()


def test_demo_fails_when_a_pack_changes_the_math(install, llama_checkpoint) -> None:
    source = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class DoubledMLP(LlamaMLP):
    def forward(self, x):
        return 2 * super().forward(x)

@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", DoubledMLP)]
"""
    install(PackSpec("doubled", source))
    out = io.StringIO()
    report = run_demo(str(llama_checkpoint), "doubled", out=out)
    assert not report.ok and "FAIL  logits match" in out.getvalue() and "PASS  classes replaced" in out.getvalue()
