from __future__ import annotations

import io

from transformers import monkey_patching

import hfpatch_core
from hfpatch_core.demo import run_demo


def test_demo_passes_every_check_and_cleans_up(snapshot) -> None:
    out = io.StringIO()
    checks = run_demo(out=out)
    assert [check.name for check in checks] == [
        "classes replaced",
        "logits match (fp32, atol 1e-5)",
        "greedy generation matches",
        "nothing left behind",
    ]
    assert all(check.ok for check in checks), out.getvalue()
    assert "LlamaMLP" in out.getvalue() and "CountingMLP" in out.getvalue()
    assert not hfpatch_core.is_enabled() and monkey_patching.get_patch_mapping() == {}
    snapshot.assert_unchanged()


def test_demo_fails_when_a_pack_changes_the_math(install, llama_checkpoint) -> None:
    from packs import PackSpec

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
    checks = {check.name: check for check in run_demo(str(llama_checkpoint), "doubled", out=out)}
    assert checks["classes replaced"].ok and not checks["logits match (fp32, atol 1e-5)"].ok
    assert "FAIL  logits match" in out.getvalue()
