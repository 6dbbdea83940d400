"""``hfpatch_core.enabled()``: a selection bound to one thread or asyncio task."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoModelForCausalLM, modeling_utils

import hfpatch_core
from conftest import Snapshot, race, vanilla_problems
from hfpatch_core import plan_of
from hfpatch_core.testing import load_model
from packs import PackSpec, fused_qkv_pack, mlp_pack

ORIGINAL_FROM_PRETRAINED = modeling_utils.PreTrainedModel.__dict__["from_pretrained"]

#: each pack name -> the MLP class its loads get (``none``: vanilla)
EXPECTED = {"alpha": "AlphaMLP", "beta": "BetaMLP", "gamma": "GammaMLP", "none": "LlamaMLP"}


@pytest.fixture
def three_packs(install):
    install(*(PackSpec(name, mlp_pack(cls)) for name, cls in EXPECTED.items() if name != "none"))


def _mlp(model) -> str:
    return type(model.model.layers[0].mlp).__name__


def _check(model, packs: str, label: str) -> list[str]:
    problems = []
    if _mlp(model) != EXPECTED[packs]:
        problems.append(f"{label}: {packs} got {_mlp(model)}")
    plan = plan_of(model)
    used = [name for name, _ in plan.packs] if plan is not None else []
    if used != ([] if packs == "none" else [packs]):
        problems.append(f"{label}: {packs} loaded with the packs {used}")
    return problems


def _hooked() -> bool:
    return modeling_utils.PreTrainedModel.__dict__["from_pretrained"] is not ORIGINAL_FROM_PRETRAINED


def test_threads_loading_with_different_packs_each_get_their_own(three_packs, llama_checkpoint) -> None:
    before = Snapshot()
    hfpatch_core.enable("gamma")  # the process-wide default underneath the blocks

    def worker(packs: str):
        def load(step: int) -> list[str]:
            with hfpatch_core.enabled(packs=packs) as selection:
                assert list(selection.packs) == ([] if packs == "none" else [packs])
                problems = _check(AutoModelForCausalLM.from_pretrained(llama_checkpoint), packs, f"step {step}")
            # the thread's own loads outside its block get the default again
            return problems + _check(AutoModelForCausalLM.from_pretrained(llama_checkpoint), "gamma", f"after {step}")

        return load

    problems = race(*(worker(packs) for packs in ("alpha", "beta", "none")), iterations=8)
    assert problems == []
    hfpatch_core.disable()
    assert not _hooked()
    before.assert_unchanged()


def test_asyncio_tasks_loading_with_different_packs_each_get_their_own(three_packs, llama_checkpoint) -> None:
    before = Snapshot()

    async def task(packs: str) -> list[str]:
        problems = []
        with hfpatch_core.enabled(packs=packs):
            for step in range(4):
                await asyncio.sleep(0)  # let the other tasks enter their blocks in between
                model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
                problems += _check(model, packs, f"task step {step}")
                # asyncio.to_thread copies the task's context: the worker thread loads with its packs
                model = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, llama_checkpoint)
                problems += _check(model, packs, f"to_thread step {step}")
        return problems

    async def main() -> list[list[str]]:
        return await asyncio.gather(*(task(packs) for packs in ("alpha", "beta", "none", "gamma")))

    assert [problem for result in asyncio.run(main()) for problem in result] == []
    assert not _hooked() and not hfpatch_core.is_enabled()
    before.assert_unchanged()


def test_blocks_nest_and_restore_what_was_there(three_packs, llama_checkpoint) -> None:
    def load() -> str:
        return _mlp(AutoModelForCausalLM.from_pretrained(llama_checkpoint))

    with hfpatch_core.enabled("alpha"):
        assert load() == "AlphaMLP"
        with hfpatch_core.enabled("beta"):
            assert load() == "BetaMLP"
            with hfpatch_core.enabled("none"):
                assert load() == "LlamaMLP"
            assert load() == "BetaMLP"
        assert load() == "AlphaMLP"
    assert load() == "LlamaMLP" and not _hooked()

    hfpatch_core.enable("gamma")
    with hfpatch_core.enabled("alpha"):
        hfpatch_core.disable()  # drops the process default only: the block keeps its packs
        assert _hooked() and hfpatch_core.is_enabled()
        assert load() == "AlphaMLP"
    assert not _hooked() and not hfpatch_core.is_enabled()
    assert load() == "LlamaMLP"


def test_a_block_restores_its_selection_when_the_load_raises(three_packs, tmp_path) -> None:
    with pytest.raises(OSError), hfpatch_core.enabled("alpha"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "missing")
    assert not _hooked() and not hfpatch_core.is_enabled()
    with pytest.raises(hfpatch_core.SelectionError):
        hfpatch_core.enabled("no-such-pack").__enter__()
    assert not _hooked()


def test_patched_uses_the_block_it_is_in(three_packs) -> None:
    from transformers import LlamaForCausalLM

    from conftest import tiny_llama_config

    config = tiny_llama_config()
    with hfpatch_core.enabled("beta"), hfpatch_core.patched(config) as plan:
        model = LlamaForCausalLM(config)
    assert _mlp(model) == "BetaMLP" and [name for name, _ in plan.packs] == ["beta"]


def test_a_plain_load_racing_a_block_of_another_thread_is_vanilla(install, llama_checkpoint) -> None:
    """Thread A loads in an enabled() block with a converting pack, thread B calls from_pretrained
    with no block (hfpatch's wrappers are installed, no session): B must get vanilla weights."""
    install(PackSpec("qkv", fused_qkv_pack()))
    reference = {key: value.clone() for key, value in load_model(llama_checkpoint).state_dict().items()}
    before = Snapshot()
    hfpatch_core.enable("none")  # the wrappers stay in place, with no pack, for the whole race

    def patched_load(step: int) -> list[str]:
        with hfpatch_core.enabled("qkv"):
            model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
        attention = type(model.model.layers[0].self_attn).__name__
        return [] if attention == "FusedQKVAttention" else [f"patched {step}: {attention}"]

    def plain_load(step: int) -> list[str]:
        model, info = AutoModelForCausalLM.from_pretrained(llama_checkpoint, output_loading_info=True)
        return vanilla_problems(model, reference, info, f"plain {step}")

    assert race(patched_load, plain_load, iterations=25) == []
    hfpatch_core.disable()
    before.assert_unchanged()


def test_threads_see_no_block_of_another_thread(three_packs, llama_checkpoint) -> None:
    inside, checked = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        inside.wait(30)
        seen.append(hfpatch_core.is_enabled())
        checked.set()

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(other)
        with hfpatch_core.enabled("alpha"):
            inside.set()
            checked.wait(30)
        future.result()
    assert seen == [False]
