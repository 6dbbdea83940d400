from __future__ import annotations

import io

from hfpatch_core.demo import EXAMPLE_PACK, run_demo
from packs import PackSpec


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
