from __future__ import annotations

import io

from hfpatch_core.cli import main
from hfpatch_core.cli.demo import EXAMPLE_PACK, run_demo
from packs import MLP_PACK, PackSpec


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


def test_demo_follows_hf_patch_packs_like_every_other_command(install, llama_checkpoint, monkeypatch) -> None:
    install(PackSpec("mlp", MLP_PACK))
    monkeypatch.setenv("HF_PATCH_PACKS", "mlp")
    out = io.StringIO()
    report = run_demo(str(llama_checkpoint), out=out)
    assert report.ok and report.replaced == {"LlamaMLP": "PackMLP"}
    assert "then with HF_PATCH_PACKS=mlp ..." in out.getvalue()


def test_an_empty_choice_means_no_pack_whichever_way_it_is_given(install, monkeypatch, capsys) -> None:
    install(PackSpec("mlp", MLP_PACK))
    assert main(["demo", "--packs", ""]) == 0
    by_option = capsys.readouterr().out
    monkeypatch.setenv("HF_PATCH_PACKS", "")
    assert main(["demo"]) == 0
    assert capsys.readouterr().out == by_option == "No pack to demonstrate: HF_PATCH_PACKS='' selects none.\n"


def test_bad_input_is_exit_2_before_any_work(install, monkeypatch, capsys, tmp_path) -> None:
    install(PackSpec("mlp", MLP_PACK))
    monkeypatch.setattr("hfpatch_core.testing.tiny_checkpoint", _no_work)
    assert main(["demo", "--packs", "mpl"]) == 2
    typo = capsys.readouterr()
    assert (
        typo.out == "" and "names pack 'mpl', which is not installed" in typo.err and "did you mean 'mlp'" in typo.err
    )
    assert main(["demo", "--model", str(tmp_path / "nonexistent"), "--packs", "mlp"]) == 2
    missing = capsys.readouterr()
    assert missing.out == "" and "nonexistent': the path does not exist" in missing.err
    assert main(["demo", "--model", str(tmp_path), "--packs", "mlp"]) == 2
    assert "no config.json in it" in capsys.readouterr().err


def _no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("a checkpoint was built for bad input")


def test_demo_of_a_model_without_a_choice_uses_the_installed_packs_that_apply(
    install, llama_checkpoint, monkeypatch
) -> None:
    # issue 40: `hfpatch demo --model ./tiny-llama` with HF_PATCH_PACKS unset picked qwen-moe ("classes replaced: none")
    from packs import NORM_PATTERN_PACK

    qwen_only = MLP_PACK.replace('context.model_type == "llama"', 'context.model_type == "qwen2_moe"')
    install(PackSpec("mlp", MLP_PACK), PackSpec("qwen-only", qwen_only), PackSpec("norms", NORM_PATTERN_PACK))
    monkeypatch.delenv("HF_PATCH_PACKS", raising=False)
    out = io.StringIO()
    report = run_demo(str(llama_checkpoint), out=out)
    assert report.ok and report.replaced == {"LlamaMLP": "PackMLP", "LlamaRMSNorm": "PackNorm"}
    assert "then with HF_PATCH_PACKS=mlp,norms ..." in out.getvalue()
    explicit = io.StringIO()
    assert not run_demo(str(llama_checkpoint), "qwen-only", out=explicit).ok  # an explicit choice is kept
    assert "FAIL  classes replaced or steps installed: none" in explicit.getvalue()


def test_a_truncated_safetensors_file_is_named_before_any_load(llama_checkpoint, tmp_path, capsys) -> None:
    # issue 40: transformers' error for a truncated download names no file
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama_checkpoint, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    for command in (["demo", "--model", str(broken)], ["verify", "--model", str(broken)]):
        assert main(command) == 2
        error = capsys.readouterr().err
        assert f"{weights.name} is not a readable safetensors file" in error and "save or download it again" in error


def test_demo_shows_the_model_steps_and_checks_a_training_step(first_party) -> None:
    """Issue 44.7: ``hfpatch demo --packs fused-dense,chunked-loss`` never mentioned the installed step."""
    out = io.StringIO()
    report = run_demo(packs="fused-dense,chunked-loss", out=out)
    text = out.getvalue()
    assert report.ok, text
    assert "Model steps:\n  causal-lm-loss             installed: hfpatch_pack_chunked_loss." in text
    assert "[chunked-loss 0.1.0]" in text
    assert "PASS  classes replaced or steps installed: LlamaAttention, LlamaMLP, step causal-lm-loss" in text
    assert "PASS  training step matches: loss diff" in text
