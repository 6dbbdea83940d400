"""A checkpoint that lacks part of what a pack fuses or splits (issue 44.4), loaded as a user loads it.

The contract (README, docs/users-guide.md "Strict mode", docs/adapters.md): by default as
vanilla transformers loads a checkpoint lacking a weight, i.e. the key reported in
``missing_keys`` (``output_loading_info=True``), the weight initialised by the model's own
rule and a warning naming the key and the pack; in strict mode a ``WeightLayoutError``
naming them.  A fused weight (fused-dense's ``qkv_proj``) some of whose parts are in the
checkpoint loads those parts exactly and initialises the others; a missing expert of
linear-experts / qwen-moe is reported under the checkpoint's spelling.  Messages quote
checkpoint keys, never the converters' internal pattern marks (``(?!@llama)``).

The first cases run as a user runs them: a subprocess with ``HF_PATCH_PACKS`` (and
``HF_PATCH_STRICT``) set and the first-party packs installed as wheels
(``<venv>/first-party-packs``, built by ``make venv``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from computed_once import computed_once
from safetensors.torch import load_file, save_file

import hfpatch_core
from conftest import PACKS_SITE
from hfpatch_core import WeightLayoutError
from hfpatch_core.testing import tiny_checkpoint

_ROOT = Path(hfpatch_core.__file__).resolve().parents[1]
CHECKOUT = str(_ROOT) if (_ROOT / "pyproject.toml").is_file() else ""

#: loads the checkpoint in argv[1] patched, prints what a user sees as one JSON line
LOAD = textwrap.dedent(
    """
    import json, sys, torch
    import hfpatch_core
    hfpatch_core.enable()
    from transformers import AutoModelForCausalLM
    from safetensors.torch import load_file
    try:
        model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        raise SystemExit(0)
    fused = model.model.layers[0].self_attn.qkv_proj.weight.detach()
    checkpoint = load_file(sys.argv[1] + "/model.safetensors")
    q, v = (checkpoint[f"model.layers.0.self_attn.{name}_proj.weight"] for name in "qv")
    k = fused[q.shape[0] : q.shape[0] + v.shape[0]]
    print(json.dumps({
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "q": torch.equal(fused[: q.shape[0]], q),
        "v": torch.equal(fused[q.shape[0] + v.shape[0] :], v),
        "k_std": float(k.std()),
        "initializer_range": model.config.initializer_range,
        "plan": hfpatch_core.plan_of(model) is not None,
    }))
    """
)


def _without(directory: Path, *keys: str) -> Path:
    """``directory``'s checkpoint rewritten without ``keys`` (each must be in it)."""
    path = directory / "model.safetensors"
    state = load_file(path)
    for key in keys:
        del state[key]
    save_file(state, path, metadata={"format": "pt"})
    return directory


def _start(checkpoint: Path, **env: str) -> subprocess.Popen[str]:
    assert (PACKS_SITE / "hfpatch_pack_fused_dense").is_dir(), f"no first-party packs in {PACKS_SITE}: run make venv"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_PATCH", "HFPATCH"))}
    environment["PYTHONPATH"] = os.pathsep.join(path for path in (str(PACKS_SITE), CHECKOUT) if path)
    environment.update(USE_HUB_KERNELS="0", OMP_NUM_THREADS="1", **env)
    command = [sys.executable, "-c", LOAD, str(checkpoint)]
    return subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(process: subprocess.Popen[str]) -> dict:
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    result["stderr"] = stderr
    return result


@pytest.fixture(scope="module")
def without_k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint without ``model.layers.0.self_attn.k_proj.weight`` (q and v there)."""
    directory = tiny_checkpoint("llama", tmp_path_factory.mktemp("without-k"))
    return _without(directory, "model.layers.0.self_attn.k_proj.weight")


@pytest.fixture(scope="module")
def loads(without_k: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """What a user sees loading it with ``HF_PATCH_PACKS=fused-dense``, by default and with
    ``HF_PATCH_STRICT=1`` (the two processes run side by side)."""

    def load() -> dict[str, dict]:
        default = _start(without_k, HF_PATCH_PACKS="fused-dense")
        strict = _start(without_k, HF_PATCH_PACKS="fused-dense", HF_PATCH_STRICT="1")
        return {"default": _result(default), "strict": _result(strict)}

    return computed_once(tmp_path_factory, "checkpoint-gaps-loads", load)


def test_a_fused_part_missing_loads_as_vanilla_by_default(loads: dict[str, dict]) -> None:
    seen = loads["default"]
    assert "error" not in seen, seen
    assert seen["plan"]
    assert seen["missing"] == ["model.layers.0.self_attn.k_proj.weight"] and seen["unexpected"] == []
    assert seen["q"] and seen["v"]  # the parts the checkpoint has, exactly
    # initialised as transformers initialises a missing Linear weight: N(0, initializer_range) over
    # 2048 values, whose sample std is within a few percent of it; zeros (not initialised) fail
    assert 0.5 * seen["initializer_range"] < seen["k_std"] < 2 * seen["initializer_range"]
    warning = next(line for line in seen["stderr"].splitlines() if "model.layers.0.self_attn.k_proj.weight" in line)
    assert "missing from the checkpoint" in warning and "pack 'fused-dense'" in warning
    assert "(?!" not in seen["stderr"] and "issues during automatic conversion" not in seen["stderr"]


def test_a_fused_part_missing_is_a_weight_layout_error_in_strict_mode(loads: dict[str, dict]) -> None:
    seen = loads["strict"]
    assert seen.get("error") == "WeightLayoutError", seen
    assert "model.layers.0.self_attn.k_proj.weight: missing from the checkpoint" in seen["message"]
    assert "pack 'fused-dense'" in seen["message"] and "strict mode" in seen["message"]
    assert "(?!" not in seen["message"]


def test_vanilla_loads_the_same_checkpoint_reporting_the_key(without_k: Path) -> None:
    """The reference the contract follows: no pack, the same key in ``missing_keys``."""
    from transformers import AutoModelForCausalLM

    with hfpatch_core.enabled(packs="none"):
        _, info = AutoModelForCausalLM.from_pretrained(without_k, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["model.layers.0.self_attn.k_proj.weight"]


def test_a_part_of_another_size_names_the_checkpoint_keys_and_the_pack(first_party, tmp_path: Path) -> None:
    """A part of the wrong size (another configuration's checkpoint) cannot load as vanilla would either
    (vanilla refuses a mismatched size): a ``WeightLayoutError`` with the converter's reason, in the
    checkpoint's names, instead of transformers' bare ``RuntimeError``."""
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint("llama", tmp_path / "short-k")
    state = load_file(directory / "model.safetensors")
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:16].clone()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    for strict in (False, True):
        with pytest.raises(WeightLayoutError) as caught, hfpatch_core.enabled(packs="fused-dense", strict=strict):
            AutoModelForCausalLM.from_pretrained(directory)
        message = str(caught.value)
        assert "model.layers.0.self_attn.qkv_proj.weight (converter of pack 'fused-dense')" in message
        assert "'model.layers.0.self_attn.k_proj.weight'" in message and "sizes [64, 16, 32]" in message
        assert "(?!" not in message


#: (model type, pack, the checkpoint key left out, how the report names it)
EXPERTS = [
    ("mixtral", "linear-experts", "model.layers.0.block_sparse_moe.experts.1.w1.weight", "mlp.experts.1.w1.weight"),
    ("qwen3_moe", "linear-experts", "model.layers.0.mlp.experts.1.gate_proj.weight", "mlp.experts.1.gate_proj.weight"),
    ("qwen3_moe", "qwen-moe", "model.layers.0.mlp.experts.1.gate_proj.weight", "mlp.experts.1.gate_proj.weight"),
]


@pytest.mark.parametrize(("model_type", "pack", "key", "reported"), EXPERTS)
def test_a_missing_expert_is_reported_as_the_checkpoint_spells_it(
    first_party, tmp_path, caplog, model_type, pack, key, reported
) -> None:
    """One expert's projection missing: vanilla transformers 5.25 refuses it (its stacking of the
    experts fails); a per-expert pack loads the others, initialises it, and names it as the
    checkpoint does (mixtral's ``block_sparse_moe``), an error in strict mode."""
    from transformers import AutoModelForCausalLM

    directory = _without(tiny_checkpoint(model_type, tmp_path / model_type), key)
    with hfpatch_core.enabled(packs=pack, strict=False), caplog.at_level("WARNING", logger="hfpatch"):
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert sorted(info["missing_keys"]) == [f"model.layers.0.{reported}"]
    weight = model.get_parameter(f"model.layers.0.{reported}")
    assert weight.abs().sum() > 0  # initialised
    line = next(line for line in caplog.text.splitlines() if reported in line and "touched by" in line)
    assert key in line and f"pack {pack!r}" in line
    with pytest.raises(WeightLayoutError) as caught, hfpatch_core.enabled(packs=pack, strict=True):
        AutoModelForCausalLM.from_pretrained(directory)
    assert key in str(caught.value) and f"pack {pack!r}" in str(caught.value)


def test_sized_concatenate_zero_fills_and_records_a_missing_part() -> None:
    """The operation alone: the parts it gets in place, the missing one zero (the load check
    initialises it) and recorded under the checkpoint key, for the model being loaded."""
    from hfpatch_core.authoring.sized import SizedConcatenate, parts_not_in_checkpoint

    model = torch.nn.Module()
    q, v = torch.ones(4, 2), torch.full((2, 2), 3.0)
    fused = SizedConcatenate(0, (4, 2, 2)).convert(
        {"self_attn.q_proj.weight(?!@llama)": [q], "self_attn.v_proj.weight(?!@llama)": [v]},
        source_patterns=[f"self_attn.{n}_proj.weight(?!@llama)" for n in "qkv"],
        target_patterns=["self_attn.qkv_proj.weight"],
        full_layer_name="model.layers.3.self_attn.qkv_proj.weight",
        model=model,
    )["self_attn.qkv_proj.weight"]
    assert torch.equal(fused, torch.cat([q, torch.zeros(2, 2), v]))
    (part,) = parts_not_in_checkpoint(model)
    assert (part.key, part.target, part.start, part.size) == (
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.qkv_proj.weight",
        4,
        2,
    )
    assert parts_not_in_checkpoint(model) == []  # read once


def test_qwen_moe_fused_attention_missing_a_part_loads_the_others(first_party, tmp_path: Path) -> None:
    """The same generic path for another pack's ``SizedConcatenate`` (qwen-moe's fused q/k/v of qwen3_moe)."""
    from transformers import AutoModelForCausalLM

    key = "model.layers.1.self_attn.q_proj.weight"
    directory = _without(tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe"), key)
    checkpoint = load_file(directory / "model.safetensors")
    with hfpatch_core.enabled(packs="qwen-moe", strict=False):
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert sorted(info["missing_keys"]) == [key]
    fused = model.get_parameter("model.layers.1.self_attn.qkv_proj.weight").detach()
    k, v = (checkpoint[f"model.layers.1.self_attn.{name}_proj.weight"] for name in "kv")
    q_rows = fused.shape[0] - k.shape[0] - v.shape[0]
    assert torch.equal(fused[q_rows : q_rows + k.shape[0]], k) and torch.equal(fused[q_rows + k.shape[0] :], v)
    assert fused[:q_rows].abs().sum() > 0  # initialised
