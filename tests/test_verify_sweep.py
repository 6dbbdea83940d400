"""``hfpatch verify --all-model-types`` and the zoo (issue 46): composites claimed in their
sub-models' own loads, whole refusal reasons, and the shared, parallel, cached sweep."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from test_cli import HFPATCH, run

from hfpatch_core.testing import tiny_checkpoint
from hfpatch_core.testing.zoo import load_contexts, offers_anything, verdict_of
from packs import PackSpec

#: A structural pack written as the authors' guide says for composites: it walks the model it is
#: asked about (``build_on_meta``) and claims every ``*MLP`` class, leaving the sub-models that load
#: in loads of their own (``nested_loads``) to those loads, where it claims their classes.
NESTED_MLP_PACK = """
    from hfpatch_core import Patch, hookimpl
    from hfpatch_core.authoring import build_on_meta, nested_loads, runtime_class

    _classes = {}

    def patched_class(original):
        if original not in _classes:
            _classes[original] = runtime_class(
                f"Nested{original.__name__}", (original,), module=__name__, rebuild=patched_class,
                arguments=(original,),
            )
        return _classes[original]

    @hookimpl
    def provide_patches(context):
        if context.config is None or context.model_class is None:
            return []
        try:
            model = build_on_meta(context)
        except Exception:  # a model this pack cannot build has nothing it claims
            return []
        inner = {type(module) for sub in nested_loads(model).values() for module in sub.modules()}
        found = {type(module) for module in model.modules() if type(module).__name__.endswith("MLP")}
        return [Patch(cls.__name__, patched_class(cls)) for cls in sorted(found - inner, key=lambda c: c.__name__)]
"""


def _verify(site: Path, *arguments: str, env: dict[str, str], code: int = 0) -> subprocess.CompletedProcess[str]:
    result = run(HFPATCH, *arguments, site=site, env=env, timeout=300)
    assert result.returncode == code, result.stderr[-3000:]
    return result


def test_a_composite_claimed_in_its_text_models_own_load_verifies_exact(install, tmp_path: Path) -> None:
    # the zoo used to ask the text model with the composite's class and the text config
    # (LoadContext("llama", "LlavaForConditionalGeneration", config=text)): build_on_meta failed,
    # and the pack was "not applicable" on every composite
    install(PackSpec("nested-mlp", NESTED_MLP_PACK))
    checkpoint = tiny_checkpoint("llava", tmp_path / "llava")
    from transformers import AutoConfig

    contexts = [
        (c.model_type, c.model_class_name, getattr(c.parent, "model_class_name", None))
        for c in load_contexts(AutoConfig.from_pretrained(checkpoint))
    ]
    assert contexts[0] == ("llava", "LlavaForConditionalGeneration", None)
    assert ("llama", "LlamaModel", "LlavaForConditionalGeneration") in contexts
    assert offers_anything("nested-mlp", checkpoint)
    torch.manual_seed(0)
    row = verdict_of("nested-mlp", "llava", tmp_path, checkpoint=checkpoint, generate_tokens=2)
    assert (row.verdict, row.detail) == ("exact", "CLIPMLP <- NestedCLIPMLP, LlamaMLP <- NestedLlamaMLP"), row.detail


#: Refuses llama's attention with a reason longer than any column (issue 46.5: it was cut at 200
#: characters, "...differs in float3...").
LONG_REASON = (
    "the fused kernel computes softmax(q k^T / sqrt(d)) in one pass whose accumulation order differs in "
    "float32 from eager attention's by up to 4 ulps per score, and this pack promises exact logits; "
    "it refuses rather than change what the model computes (set head_dim to a multiple of 64 and "
    "attn_implementation='sdpa' for the variant it claims), end of the reason"
)
LONG_REFUSAL_PACK = f"""
    from hfpatch_core import Refusal, hookimpl

    @hookimpl
    def provide_patches(context):
        return [Refusal("LlamaAttention", {LONG_REASON!r})] if context.model_type == "llama" else []
"""


#: Replaces llama's MLP by a subclass (exact); ``VERSION`` tells two installs apart.
MLP_PACK = """
    from hfpatch_core import Patch, hookimpl
    from transformers.models.llama.modeling_llama import LlamaMLP

    VERSION = {version!r}

    class PackMLP(LlamaMLP):
        pass

    @hookimpl
    def provide_patches(context):
        return [Patch("LlamaMLP", PackMLP)] if context.model_type == "llama" else []
"""


@pytest.mark.release_independent
def test_the_sweep_builds_one_checkpoint_per_model_type_for_every_pack(install, tmp_path, monkeypatch) -> None:
    from hfpatch_core.testing import checkpoints
    from hfpatch_core.testing.zoo import ZooRow, sweep

    install(PackSpec("mlp", MLP_PACK.format(version="1")), PackSpec("long", LONG_REFUSAL_PACK))
    built: list[str] = []
    original = checkpoints.tiny_checkpoint

    def counting(model_type, directory=None, **kwargs):
        built.append(model_type)
        return original(model_type, directory, **kwargs)

    monkeypatch.setattr(checkpoints, "tiny_checkpoint", counting)
    known = {"long": {"gpt2": ZooRow("long", "gpt2", "not applicable", "known before")}}
    seen: list[tuple[int, int, list[tuple[str, str]]]] = []
    rows = sweep(
        ["mlp", "long"],
        ["llama", "gpt2"],
        jobs=1,
        generate_tokens=2,
        known=known,
        progress=lambda found, number, total: seen.append((number, total, [(r.pack, r.verdict) for r in found])),
    )
    assert built == ["llama", "gpt2"]  # one build per model type, shared by both packs
    assert [(row.pack, row.model_type, row.verdict) for row in rows] == [
        ("mlp", "llama", "exact"),
        ("mlp", "gpt2", "not applicable"),
        ("long", "llama", "refused"),
        ("long", "gpt2", "not applicable"),
    ]
    assert rows[3].detail == "known before"  # a known row is not verified again
    assert seen == [
        (1, 2, [("mlp", "exact"), ("long", "refused")]),
        (2, 2, [("mlp", "not applicable"), ("long", "not applicable")]),
    ]


@pytest.mark.release_independent
def test_verify_every_model_type_in_two_workers_caches_by_version_and_keeps_reasons_whole(install, tmp_path) -> None:
    # issue 46.5: a refusal's reason was cut at 200 characters in the table and the JSON;
    # issue 46.7: the sweep runs in worker processes, and a re-run verifies only what changed
    site = install(PackSpec("mlp", MLP_PACK.format(version="1")), PackSpec("long", LONG_REFUSAL_PACK))
    arguments = ["verify", "mlp", "long", "--all-model-types", "--model-type", "llama", "--model-type", "gpt2"]
    env = {"HF_PATCH_CACHE": str(tmp_path / "cache")}
    first = _verify(site, *arguments, "--json", "--jobs", "2", env=env)
    rows = {
        (row["pack"], row["model_type"]): (row["verdict"], row["detail"]) for row in json.loads(first.stdout)["rows"]
    }
    assert rows == {
        ("mlp", "llama"): ("exact", "LlamaMLP <- PackMLP"),
        ("mlp", "gpt2"): ("not applicable", ""),
        ("long", "llama"): ("refused", f"LlamaAttention: {LONG_REASON}"),
        ("long", "gpt2"): ("not applicable", ""),
    }
    # progress as each model type is done, in whichever order the workers finish
    assert "(cached)" not in first.stderr and "long on gpt2: not applicable (" in first.stderr
    assert "[2/2] " in first.stderr and "[3/2]" not in first.stderr

    again = _verify(site, *arguments, env=env)  # the table, from the cache
    assert "hfpatch: 4 verdicts from the cache" in again.stderr and again.stderr.count("(cached)") == 4
    assert f"LlamaAttention: {LONG_REASON}" in again.stdout

    # a new version of one pack: only its verdicts are computed again
    changed = install(
        PackSpec("mlp", MLP_PACK.format(version="2"), version="1.0.1"), PackSpec("long", LONG_REFUSAL_PACK)
    )
    third = _verify(changed, *arguments, "--json", env=env)
    assert "hfpatch: 2 verdicts from the cache" in third.stderr
    assert "long on llama: refused (cached)" in third.stderr and "mlp on llama: exact (cached)" not in third.stderr
    rows = {(row["pack"], row["model_type"]): row["detail"] for row in json.loads(third.stdout)["rows"]}
    assert rows["mlp", "llama"] == "LlamaMLP <- PackMLP"
