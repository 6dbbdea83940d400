"""A load with packs leaves the random streams and the initial weights as vanilla's (issue 52.3, 52.4).

``torch.manual_seed(0)``, a load, then LoRA's initialisation, dropout, data shuffling: a
seeded program draws the same numbers with packs as without.  The packs' probes build and run
modules, and must not draw from generators they do not own (``authoring.isolated_rng``, under
which hfpatch calls every hook and model step).  A seeded ``from_config`` starts where
vanilla's starts, in the packs' layout: vanilla builds and initialises the model, and the
packs' converters carry its weights over, as a checkpoint load maps them.

The first-party packs are installed as wheels (``<venv>/first-party-packs``); the first load
of a model type in a process, where the probes run, is run in a fresh process.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hfpatch_core
from conftest import PACKS_SITE, tiny_llama_config
from hfpatch_core.authoring import isolated_rng
from hfpatch_core.testing import tiny_checkpoint, tiny_config
from packs import PackSpec

_ROOT = Path(hfpatch_core.__file__).resolve().parents[1]
CHECKOUT = str(_ROOT) if (_ROOT / "pyproject.toml").is_file() else ""

#: (model type, pack): every first-party pack on a model it changes
CASES = [
    ("qwen3_moe", "qwen-moe"),
    ("qwen2_moe", "qwen-moe"),
    ("mixtral", "linear-experts"),
    ("olmoe", "linear-experts"),
    ("qwen3_moe", "moe-replay"),
    ("mixtral", "moe-replay"),
    ("llama", "fused-dense"),
    ("llama", "chunked-loss"),
]
IDS = [f"{pack}-{model_type}" for model_type, pack in CASES]

#: in a fresh process: a seeded vanilla load, then the same with the pack (its first load of the
#: model type: the probes run), then once more (the probes' verdicts cached); what each leaves
FIRST_LOAD = textwrap.dedent(
    """
    import json, random, sys
    import numpy as np, torch
    import hfpatch_core
    from transformers import AutoModelForCausalLM

    def seeded_load(**kwargs):
        torch.manual_seed(0); random.seed(0); np.random.seed(0)
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **kwargs)
        after = [*torch.rand(3).tolist(), *torch.randn(3).tolist(), random.random(), float(np.random.rand())]
        return model, after

    _, vanilla = seeded_load()
    with hfpatch_core.enabled(sys.argv[2]):
        model, first = seeded_load()
        _, second = seeded_load(dtype=torch.bfloat16)
    plan = hfpatch_core.plan_of(model)
    print(json.dumps({"vanilla": vanilla, "first": first, "second": second,
                      "replaced": sorted(plan.replaced), "steps": len(plan.installed_steps)}))
    """
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per model type of ``CASES``."""
    return {
        model_type: tiny_checkpoint(model_type, tmp_path_factory.mktemp(model_type))
        for model_type in dict.fromkeys(model_type for model_type, _ in CASES)
    }


def _changes_the_model(result: dict) -> bool:
    return bool(result["replaced"]) or result["steps"] > 0


@pytest.mark.parametrize(("model_type", "pack"), CASES, ids=IDS)
def test_a_first_load_in_a_process_leaves_the_random_streams_as_vanilla(
    checkpoints: dict[str, Path], model_type: str, pack: str
) -> None:
    assert (PACKS_SITE / "hfpatch_pack_fused_dense").is_dir(), f"no first-party packs in {PACKS_SITE}: run make venv"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_PATCH", "HFPATCH"))}
    environment["PYTHONPATH"] = os.pathsep.join(path for path in (str(PACKS_SITE), CHECKOUT) if path)
    environment.update(USE_HUB_KERNELS="0", OMP_NUM_THREADS="1")
    command = [sys.executable, "-c", FIRST_LOAD, str(checkpoints[model_type]), pack]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert _changes_the_model(result), f"{pack} changed nothing on {model_type}: {result}"
    # exact: the same generator states give the same numbers bit for bit
    assert result["first"] == result["vanilla"], f"{pack}'s first load moved the streams"
    assert result["second"] == result["vanilla"], f"{pack}'s second load moved the streams"


def _saved(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory)
    return load_file(directory / "model.safetensors")


def _after() -> list[float]:
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _seeded(build):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = build()
    return model, _after()


@pytest.mark.parametrize("through", ["AutoModelForCausalLM.from_config", "_from_config"])
@pytest.mark.parametrize(("model_type", "pack"), CASES, ids=IDS)
def test_a_seeded_from_config_starts_where_vanillas_starts(
    first_party, tmp_path: Path, model_type: str, pack: str, through: str
) -> None:
    config = tiny_config(model_type)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]  # the class Auto builds

    def build():
        if through == "_from_config":
            return model_class._from_config(config)
        return AutoModelForCausalLM.from_config(config)

    vanilla, vanilla_after = _seeded(build)
    with hfpatch_core.enabled(pack):
        patched, patched_after = _seeded(build)
    plan = hfpatch_core.plan_of(patched)
    assert plan is not None and (plan.replaced or plan.installed_steps), f"{pack} changed nothing on {model_type}"
    assert patched_after == vanilla_after, "the from_config moved the random streams"
    # the pack's own save writes the original layout: the same tensors, bit for bit
    expected, got = _saved(vanilla, tmp_path / "vanilla"), _saved(patched, tmp_path / "patched")
    assert got.keys() == expected.keys()
    differ = [key for key in expected if not torch.equal(got[key], expected[key])]
    assert not differ, f"{len(differ)} of {len(expected)} tensors differ from vanilla's: {differ[:5]}"
    # in memory: every tensor the pack left where vanilla has it is vanilla's, and the model is in train mode
    state = patched.state_dict()
    same = [key for key, value in vanilla.state_dict().items() if key in state and state[key].shape == value.shape]
    assert same and all(torch.equal(state[key], vanilla.state_dict()[key]) for key in same)
    assert patched.training == vanilla.training
    buffers = dict(patched.named_buffers())
    assert all(torch.equal(buffers[name], value) for name, value in vanilla.named_buffers() if name in buffers)


def test_qwen_moe_experts_hold_the_rows_of_vanillas_fused_experts(first_party) -> None:
    config = tiny_config("qwen3_moe")
    vanilla, _ = _seeded(lambda: AutoModelForCausalLM.from_config(config))
    with hfpatch_core.enabled("qwen-moe"):
        patched, _ = _seeded(lambda: AutoModelForCausalLM.from_config(config))
    fused = vanilla.model.layers[0].mlp.experts
    experts = patched.model.layers[0].mlp.experts
    size = fused.down_proj.shape[-1]
    for index in range(fused.gate_up_proj.shape[0]):
        expert = experts[index] if isinstance(experts, torch.nn.ModuleList) else getattr(experts, str(index))
        assert torch.equal(expert.gate_proj.weight, fused.gate_up_proj[index, :size])
        assert torch.equal(expert.up_proj.weight, fused.gate_up_proj[index, size:])
        assert torch.equal(expert.down_proj.weight, fused.down_proj[index])
    attention, reference = patched.model.layers[0].self_attn, vanilla.model.layers[0].self_attn
    q, k, v = (getattr(reference, f"{name}_proj").weight for name in "qkv")
    assert torch.equal(attention.qkv_proj.weight, torch.cat([q, k, v]))


#: a pack that draws from every global stream in its hooks and its step, and from torch's in its
#: replacement's __init__
DRAWING_PACK = """
import random
import numpy as np
import torch
from torch import nn
from hfpatch_core import ModelStep, Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP


def draw():
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    nn.Linear(8, 8)
    return float(torch.rand(1)) + random.random() + float(np.random.rand())


class DrawingMLP(LlamaMLP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # torch's own draws only: a from_pretrained builds on the meta device, where they draw nothing
        nn.Linear(8, 8)
        torch.rand(1)


def install(model):
    draw()


def uninstall(model):
    draw()


@hookimpl
def provide_patches(context):
    draw()
    return [Patch("LlamaMLP", DrawingMLP)] if context.model_type == "llama" else []


@hookimpl
def provide_model_steps(context):
    draw()
    return [ModelStep("drawing", install, uninstall)] if context.model_type == "llama" else []
"""


def test_a_pack_that_draws_everywhere_moves_no_stream(install, llama_checkpoint: Path, tmp_path: Path) -> None:
    # the guarantee is core's: hooks, steps and the conversion of a from_config run under isolated_rng
    install(PackSpec("drawing", DRAWING_PACK))
    config = tiny_llama_config()
    loads = {
        "from_pretrained": lambda: AutoModelForCausalLM.from_pretrained(llama_checkpoint),
        "from_config": lambda: AutoModelForCausalLM.from_config(config),
    }
    for name, build in loads.items():
        vanilla, expected = _seeded(build)
        with hfpatch_core.enabled("drawing"):
            patched, got = _seeded(build)
        assert type(patched.model.layers[0].mlp).__name__ == "DrawingMLP"
        assert got == expected, f"{name} moved the streams"
        if name == "from_config":
            state, reference = patched.state_dict(), vanilla.state_dict()
            assert state.keys() == reference.keys()
            assert all(torch.equal(state[key], reference[key]) for key in reference)
        torch.manual_seed(9)
        hfpatch_core.revert(patched)  # uninstalls the step, which draws
        after_revert = torch.rand(3).tolist()
        torch.manual_seed(9)
        assert after_revert == torch.rand(3).tolist(), "revert() moved torch's stream"
    model = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(5)
    expected = _after()
    torch.manual_seed(5)
    hfpatch_core.apply(model, "drawing")
    hfpatch_core.revert(model)
    assert _after()[:3] == expected[:3], "apply() and revert() moved torch's stream"


#: a replacement with a parameter vanilla's weights cannot fill (and no converter)
EXTRA_PACK = """
import torch
from torch import nn
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP


class ScaledMLP(LlamaMLP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.ones(1))


@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", ScaledMLP)] if context.model_type == "llama" else []
"""


def test_a_layout_vanillas_weights_cannot_fill_warns_and_is_initialised(install) -> None:
    install(PackSpec("extra", EXTRA_PACK))
    config = tiny_llama_config()
    _, expected = _seeded(lambda: AutoModelForCausalLM.from_config(config))
    with hfpatch_core.enabled("extra"), pytest.warns(hfpatch_core.PackWarning, match="initial weights differ"):
        model, got = _seeded(lambda: AutoModelForCausalLM.from_config(config))
    assert got == expected
    mlp = model.model.layers[0].mlp
    assert torch.equal(mlp.scale, torch.ones(1))
    assert torch.isfinite(mlp.gate_proj.weight).all() and float(mlp.gate_proj.weight.detach().std()) > 0


def test_isolated_rng_seeds_the_block_and_puts_every_stream_back() -> None:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    expected = _after()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    with isolated_rng(3) as generator:
        inside = [float(torch.rand(1)), random.random(), float(np.random.rand())]
        assert float(torch.rand(1, generator=generator)) == float(
            torch.rand(1, generator=torch.Generator().manual_seed(3))
        )
        with isolated_rng(None):
            torch.manual_seed(99)
            torch.rand(5)
        assert float(torch.rand(1)) == float(torch.rand(2, generator=torch.Generator().manual_seed(3))[1])
    assert _after() == expected
    torch.manual_seed(0)
    with pytest.raises(ZeroDivisionError), isolated_rng(1):
        torch.rand(1)
        1 / 0  # noqa: B018
    assert float(torch.rand(1)) == float(torch.rand(1, generator=torch.Generator().manual_seed(0)))
    with isolated_rng(3):
        again = [float(torch.rand(1)), random.random(), float(np.random.rand())]
    assert again == inside  # the block's draws do not depend on the caller's seed
