from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM, monkey_patching
from transformers.models.llama import modeling_llama

import hfpatch_core
from conftest import Snapshot, race, tiny_llama_config, vanilla_problems
from hfpatch_core import plan_of
from hfpatch_core._runtime.application import apply_mapping
from hfpatch_core.testing import load_model
from packs import MLP_PACK, NORM_PATTERN_PACK, PackSpec, fused_qkv_pack


class Replacement(modeling_llama.LlamaMLP):
    pass


def _overlap(apply) -> None:
    """Thread A enters, thread B enters, A leaves, B leaves."""
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with apply():
            a_inside.set()
            b_inside.wait(30)
        a_left.set()

    def second() -> None:
        a_inside.wait(30)
        with apply():
            b_inside.set()
            a_left.wait(30)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def test_upstream_apply_patches_leaks_when_two_threads_overlap(snapshot) -> None:
    """Documented upstream behaviour (transformers' own apply_patches): the second thread
    saves the first thread's replacement as the 'original' and restores it last."""
    original = modeling_llama.LlamaMLP
    monkey_patching.register_patch_mapping({"LlamaMLP": Replacement})
    try:
        _overlap(monkey_patching.apply_patches)
        assert modeling_llama.LlamaMLP is Replacement  # leaked for good
    finally:
        for (module, name), value in snapshot.classes.items():
            if vars(sys.modules[module]).get(name) is not value:
                setattr(sys.modules[module], name, value)
        monkey_patching.clear_patch_mapping()
    assert modeling_llama.LlamaMLP is original


def test_hfpatch_application_serialises_overlapping_threads(snapshot) -> None:
    order: list[str] = []
    inside = threading.Event()

    def first() -> None:
        with apply_mapping({"LlamaMLP": Replacement}):
            order.append("a in")
            inside.set()
            threading.Event().wait(0.2)
            order.append("a out")

    def second() -> None:
        inside.wait(30)
        with apply_mapping({"LlamaMLP": Replacement}):
            order.append("b in")
            assert modeling_llama.LlamaMLP is Replacement
        order.append("b out")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert order == ["a in", "a out", "b in", "b out"]
    snapshot.assert_unchanged()


@pytest.fixture(scope="module")
def mistral_checkpoint(tmp_path_factory):
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny-mistral")
    config = MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    MistralForCausalLM(config).save_pretrained(path)
    return path


def test_eight_threads_loading_patched_and_unpatched_models_never_leak(install, llama_checkpoint, mistral_checkpoint):
    install(PackSpec("mlp", MLP_PACK), PackSpec("norm", NORM_PATTERN_PACK))
    # warm the lazy modules so the snapshot sees the attributes the loads will touch
    AutoModelForCausalLM.from_pretrained(llama_checkpoint)
    AutoModelForCausalLM.from_pretrained(mistral_checkpoint)
    before = Snapshot()
    hfpatch_core.enable()
    config = tiny_llama_config()
    mistral_config = MistralConfig.from_pretrained(mistral_checkpoint)

    def work(worker: int) -> list[str]:
        problems = []
        for step in range(20):
            kind = (worker + step) % 4
            if kind == 0:
                model = AutoModelForCausalLM.from_pretrained(llama_checkpoint)
                expected = {"LlamaMLP": "PackMLP", "LlamaRMSNorm": "PackNorm"}
            elif kind == 1:
                model = AutoModelForCausalLM.from_pretrained(mistral_checkpoint)
                expected = {"MistralMLP": "MistralMLP", "MistralRMSNorm": "MistralRMSNorm"}
            elif kind == 2:
                with hfpatch_core.patched(config):
                    model = modeling_llama.LlamaForCausalLM(config)
                expected = {"LlamaMLP": "PackMLP", "LlamaRMSNorm": "PackNorm"}
            else:
                model = MistralForCausalLM._from_config(mistral_config)
                expected = {"MistralMLP": "MistralMLP", "MistralRMSNorm": "MistralRMSNorm"}
            names = {type(model.model.layers[0].mlp).__name__, type(model.model.norm).__name__}
            if names != set(expected.values()):
                problems.append(f"worker {worker} step {step} kind {kind}: {names}")
            plan = plan_of(model)
            if kind in (1, 3) and (plan is None or plan.entries):
                problems.append(f"worker {worker}: an unpatched load has plan {plan}")
            if plan is not None:
                for original, replacement in expected.items():
                    claim = plan.replaced.get(original)
                    if (claim.patch.replacement.__name__ if claim else original) != replacement:
                        problems.append(f"worker {worker}: plan says {claim} for {original}")
        return problems

    with ThreadPoolExecutor(max_workers=8) as pool:
        problems = [problem for result in pool.map(work, range(8)) for problem in result]
    hfpatch_core.disable()
    assert problems == []
    before.assert_unchanged()


class _LoadReports(logging.Handler):
    """The LOAD REPORTs transformers logs (missing, unexpected or mismatched keys)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reports: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "LOAD REPORT" in message:
            self.reports.append(message)


@contextlib.contextmanager
def _load_reports() -> Iterator[_LoadReports]:
    handler = _LoadReports()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_vanilla_loads_racing_a_converting_pack_always_get_the_checkpoint(install, llama_checkpoint) -> None:
    """Thread A loads with a pack that fuses q/k/v (a converter); thread B loads the same checkpoint
    with the documented vanilla path. B must never build A's replacement without its converters
    (random weights, a LOAD REPORT of missing keys)."""
    install(PackSpec("qkv", fused_qkv_pack()))
    reference = {key: value.clone() for key, value in load_model(llama_checkpoint).state_dict().items()}
    before = Snapshot()

    def patched_load(step: int) -> list[str]:
        model, info = load_model(llama_checkpoint, "qkv", output_loading_info=True)
        if type(model.model.layers[0].self_attn).__name__ != "FusedQKVAttention" or info["missing_keys"]:
            return [f"patched {step}: {type(model.model.layers[0].self_attn).__name__} {info['missing_keys']}"]
        return []

    def vanilla_load(step: int) -> list[str]:
        model, info = load_model(llama_checkpoint, output_loading_info=True)
        return vanilla_problems(model, reference, info, f"vanilla {step}")

    with _load_reports() as logged:
        problems = race(patched_load, vanilla_load, iterations=25)
    assert problems == []
    assert logged.reports == []
    before.assert_unchanged()
