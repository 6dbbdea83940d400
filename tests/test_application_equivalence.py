"""``apply_mapping`` replaces exactly what transformers' own ``apply_patches`` replaces.

hfpatch stands its own application in for ``transformers.monkey_patching.apply_patches``
(exception-safe, locked, with a per-module cache of matching names).  These tests hold
it to the upstream function itself: for many registry contents, over every loaded
transformers module (the modeling modules of 30 model types are imported first), the
state *inside* both context managers -- every class-valued attribute of every loaded
``transformers*`` module -- must be the same, and both must restore everything.

The upstream function rescans ``dir()`` of every loaded transformers module on each call
(about half a second here), so it is called once per registry content.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import types
from collections.abc import Iterator, Mapping

import pytest
import torch.nn as nn
import transformers
from transformers import monkey_patching

from conftest import Snapshot, transformers_classes
from hfpatch_core._pipeline.resolution import find_replacement
from hfpatch_core._runtime import application
from hfpatch_core._runtime.application import apply_mapping

#: Model types whose modeling modules are imported before comparing (present in 5.3 and 5.24).
MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3",
    "phi",
    "phi3",
    "gpt2",
    "gpt_neox",
    "bert",
    "t5",
    "olmoe",
    "deepseek_v2",
    "falcon",
    "opt",
    "bloom",
    "starcoder2",
    "cohere",
    "granite",
    "mamba",
    "whisper",
    "clip",
    "siglip",
    "llava",
    "vit",
)


def _replacement(name: str) -> type[nn.Module]:
    return type(name, (nn.Module,), {"__module__": __name__})


A, B, C, D = (_replacement(f"Replacement{letter}") for letter in "ABCD")

#: Registry contents, in insertion order (which decides among patterns).
MAPPINGS: dict[str, dict[str, type[nn.Module]]] = {
    "exact name": {"LlamaMLP": A},
    "two exact names": {"LlamaMLP": A, "MistralRMSNorm": B},
    "plain name matching longer names": {"Attention": A},
    "plain name inside longer names": {"MLP": B},
    "anchored pattern": {".*Attention$": A},
    "exact beats an earlier pattern": {".*Attention$": A, "LlamaAttention": B},
    "prefix pattern": {"^Qwen2": C},
    "RMSNorm then .*Norm$": {"RMSNorm": A, ".*Norm$": B},
    ".*Norm$ then RMSNorm": {".*Norm$": B, "RMSNorm": A},
    "exact, plain and prefix overlapping": {"LlamaMLP": A, "MLP": B, "^Llama": C},
    "prefix before plain, reversed": {"^Llama": C, "MLP": B, "LlamaMLP": A},
    "alternation and groups": {"(Sparse)?MoeBlock$": D, "Qwen[23]Moe.*Experts": A},
    "invalid regex is not a pattern": {"*Attention": A, "MLP$": B},
    "non-class attributes are left alone": {"^logger$": A, "ALL_ATTENTION_FUNCTIONS": B, "LlamaConfig": C},
}


@pytest.fixture(scope="module", autouse=True)
def _modeling_modules() -> Iterator[None]:
    for model_type in MODEL_TYPES:
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    before = transformers_classes()
    yield
    # Safety net for the rest of the session: should a pass here (or upstream's) have left one of
    # this file's replacement classes behind, put the original back, or remove what was not there.
    for (module_name, name), value in transformers_classes().items():
        if value in (A, B, C, D):
            module = sys.modules[module_name]
            if (module_name, name) in before:
                setattr(module, name, before[(module_name, name)])
            else:
                delattr(module, name)


@pytest.fixture
def quiet_transformers() -> Iterator[None]:
    """Upstream logs one warning per attribute name for an invalid pattern: silence it."""
    logger = logging.getLogger("transformers.monkey_patching")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


State = dict[tuple[str, str], object]


def _settle(mapping: Mapping[str, type]) -> None:
    """Let every lazy attribute and import that resolving ``mapping``'s names triggers happen now.

    Both implementations ``getattr`` every matching name, which materialises lazy
    attributes and can import modules; after this, neither changes which modules exist.
    """
    for _ in range(5):
        modules, names = set(sys.modules), set(transformers_classes())
        with apply_mapping(mapping):
            pass
        if set(sys.modules) == modules and set(transformers_classes()) == names:
            return
    raise AssertionError("resolving the mapping's names keeps importing modules")


def _differences(first: State, second: State) -> dict[tuple[str, str], tuple[object, object]]:
    return {
        key: (first.get(key), second.get(key))
        for key in first.keys() | second.keys()
        if first.get(key, None) is not second.get(key, None)
    }


def _upstream(mapping: Mapping[str, type]) -> tuple[State, set[str]]:
    """The state inside transformers' own ``apply_patches`` with ``mapping`` as the registry."""
    saved = monkey_patching.get_patch_mapping()
    monkey_patching.clear_patch_mapping()
    monkey_patching.register_patch_mapping(dict(mapping))
    try:
        with monkey_patching.apply_patches():
            inside = transformers_classes()
            modules = set(sys.modules)
    finally:
        monkey_patching.clear_patch_mapping()
        if saved:
            monkey_patching.register_patch_mapping(saved)
    return inside, modules


@pytest.mark.parametrize("case", list(MAPPINGS))
def test_apply_mapping_replaces_what_apply_patches_replaces(case: str, quiet_transformers: None) -> None:
    mapping = MAPPINGS[case]
    _settle(mapping)
    before = transformers_classes()
    modules = set(sys.modules)
    assert len([name for name in modules if name.startswith("transformers.models.")]) >= 2 * len(MODEL_TYPES)

    application._caches.clear()  # a cold scan first, then the cached one
    with apply_mapping(mapping) as replaced:
        cold = transformers_classes()
    assert not _differences(transformers_classes(), before), "apply_mapping left attributes patched"
    with apply_mapping(mapping) as replaced_again:
        warm = transformers_classes()
    assert not _differences(transformers_classes(), before)

    upstream, upstream_modules = _upstream(mapping)
    assert upstream_modules == modules, "apply_patches imported modules: the comparison would be unfair"
    assert not _differences(transformers_classes(), before), "apply_patches left attributes patched"

    assert not _differences(cold, upstream), f"{case}: hfpatch and transformers differ"
    assert not _differences(warm, cold), f"{case}: the cached scan differs from the cold one"

    changed = {key for key, value in before.items() if cold[key] is not value}
    assert {(module.__name__, name) for module, name, _ in replaced} == changed
    assert [(m, n, o) for m, n, o in replaced] == [(m, n, o) for m, n, o in replaced_again]
    for module_name, name in changed:
        assert cold[(module_name, name)] is find_replacement(name, mapping)
        assert before[(module_name, name)] is getattr(sys.modules[module_name], name)
    assert changed, f"{case}: the mapping should replace something in the loaded modules"
    assert set(cold) == set(before)


def test_the_comparison_sees_what_it_should() -> None:
    """Sanity of the cases above: they cover exact, pattern and shadowed matches."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral

    with apply_mapping(MAPPINGS["exact beats an earlier pattern"]):
        assert modeling_llama.LlamaAttention is B and modeling_mistral.MistralAttention is A
    with apply_mapping(MAPPINGS[".*Norm$ then RMSNorm"]):
        assert modeling_llama.LlamaRMSNorm is B  # the first pattern in order wins
    with apply_mapping(MAPPINGS["RMSNorm then .*Norm$"]):
        assert modeling_llama.LlamaRMSNorm is A
    with apply_mapping(MAPPINGS["non-class attributes are left alone"]):
        assert isinstance(modeling_llama.logger, logging.Logger) and modeling_llama.LlamaConfig is C
    with apply_mapping(MAPPINGS["invalid regex is not a pattern"]):
        assert modeling_llama.LlamaAttention.__name__ == "LlamaAttention" and modeling_llama.LlamaMLP is B


# --- the per-module match cache ---------------------------------------------------


def _fresh(mapping: Mapping[str, type]) -> set[tuple[str, str]]:
    """What a cold scan replaces (the cache emptied first)."""
    application._caches.clear()
    with apply_mapping(mapping) as replaced:
        return {(module.__name__, name) for module, name, _ in replaced}


def _cached(mapping: Mapping[str, type]) -> set[tuple[str, str]]:
    with apply_mapping(mapping) as replaced:
        return {(module.__name__, name) for module, name, _ in replaced}


def _probe(name: str) -> type[nn.Module]:
    return type(name, (nn.Module,), {"__module__": "transformers.models.llama.modeling_llama"})


def test_cache_sees_a_newly_imported_modeling_module(quiet_transformers: None, monkeypatch: pytest.MonkeyPatch) -> None:
    mapping = {".*Attention$": A, "RMSNorm": B}
    newcomer = "transformers.models.mpt.modeling_mpt"
    # a test before this one in the process may have imported it (test_pack_conflicts imports every
    # modeling module): forgotten for this test, the original put back after it
    parent = importlib.import_module("transformers.models.mpt")
    monkeypatch.delitem(sys.modules, newcomer, raising=False)
    if "modeling_mpt" in vars(parent):
        monkeypatch.delattr(parent, "modeling_mpt")
    first = _cached(mapping)
    importlib.import_module(newcomer)
    _settle(mapping)
    again = _cached(mapping)
    assert (newcomer, "MptAttention") in again and (newcomer, "MptAttention") not in first
    assert again == _fresh(mapping)
    upstream, _ = _upstream(mapping)
    assert upstream[(newcomer, "MptAttention")] is A


def test_cache_sees_a_class_set_on_a_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama import modeling_llama

    mapping = {".*SetProbeAttention$": A}
    assert _fresh(mapping) == set()
    monkeypatch.setattr(modeling_llama, "HfpatchSetProbeAttention", _probe("HfpatchSetProbeAttention"), raising=False)
    assert _cached(mapping) == {(modeling_llama.__name__, "HfpatchSetProbeAttention")} == _fresh(mapping)
    # A name that already matched keeps matching when its value changes.
    monkeypatch.setattr(modeling_llama, "HfpatchSetProbeAttention", _probe("HfpatchSetProbeAttention"))
    with apply_mapping(mapping):
        assert modeling_llama.HfpatchSetProbeAttention is A
    assert modeling_llama.HfpatchSetProbeAttention is not A
    # A matching name holding a non-class is skipped, and replaced once it holds a class.
    monkeypatch.setattr(modeling_llama, "HfpatchSetProbeAttention", "not a class")
    assert _cached(mapping) == set() == _fresh(mapping)
    monkeypatch.setattr(modeling_llama, "HfpatchSetProbeAttention", _probe("HfpatchSetProbeAttention"))
    assert _cached(mapping) == {(modeling_llama.__name__, "HfpatchSetProbeAttention")}


def test_cache_sees_a_name_replaced_by_another_of_the_same_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """One name removed and another added keeps the namespace's size: the cache must still notice."""
    from transformers.models.llama import modeling_llama

    mapping = {".*SwapProbeAttention$": A}
    monkeypatch.setattr(modeling_llama, "OldSwapProbeAttention", _probe("OldSwapProbeAttention"), raising=False)
    assert _fresh(mapping) == {(modeling_llama.__name__, "OldSwapProbeAttention")}  # cached now
    monkeypatch.delattr(modeling_llama, "OldSwapProbeAttention")
    monkeypatch.setattr(modeling_llama, "NewSwapProbeAttention", _probe("NewSwapProbeAttention"), raising=False)
    with apply_mapping(mapping) as replaced:
        assert modeling_llama.NewSwapProbeAttention is A, "the match cache missed a class added in place of another"
    assert [(module.__name__, name) for module, name, _ in replaced] == [
        (modeling_llama.__name__, "NewSwapProbeAttention")
    ]
    assert modeling_llama.NewSwapProbeAttention is not A


def test_cache_sees_a_new_module_under_a_transformers_name(monkeypatch: pytest.MonkeyPatch) -> None:
    mapping = {".*ModuleProbeAttention$": A}
    assert _fresh(mapping) == set()
    module = types.ModuleType("transformers.hfpatch_probe")
    module.ModuleProbeAttention = _probe("ModuleProbeAttention")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert _cached(mapping) == {(module.__name__, "ModuleProbeAttention")} == _fresh(mapping)
    with apply_mapping(mapping):
        assert module.ModuleProbeAttention is A
    assert module.ModuleProbeAttention.__name__ == "ModuleProbeAttention"


def test_a_name_resolved_lazily_during_the_pass_gets_its_original_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy module resolving a name from a module the same pass already patched.

    ``transformers`` (a ``_LazyModule``) re-exports classes defined in its submodules and
    resolves them on first access.  When the defining module comes first in
    ``sys.modules`` (transformers' own import leaves ``transformers`` after
    ``transformers.utils.*`` and the dummy-object modules, e.g. the placeholder
    ``MistralCommonBackend``), the pass has already replaced the class there when it asks
    the lazy module for the name: the lazy module then caches, and the pass records as
    "original", the replacement.  Whatever the order, after the block every attribute
    must be what it was before (or, if it was not materialised yet, the real class).
    """
    from transformers.models.llama import modeling_llama

    top = sys.modules["transformers"]
    real = modeling_llama.LlamaForCausalLM
    monkeypatch.delitem(vars(top), "LlamaForCausalLM", raising=False)  # not materialised yet
    sys.modules["transformers"] = sys.modules.pop("transformers")  # after every submodule, as for its utils
    try:
        with apply_mapping({"LlamaForCausalLM": A}) as replaced:
            assert modeling_llama.LlamaForCausalLM is A and top.LlamaForCausalLM is A
        originals = {(module.__name__, name): original for module, name, original in replaced}
        assert originals[("transformers", "LlamaForCausalLM")] is real
        assert vars(top).get("LlamaForCausalLM", real) is real, "the lazy module kept the replacement"
        assert top.LlamaForCausalLM is real and modeling_llama.LlamaForCausalLM is real
    finally:
        if vars(top).get("LlamaForCausalLM") is A:
            top.LlamaForCausalLM = real


# --- threads ----------------------------------------------------------------------


def test_threads_applying_different_mappings_leave_nothing_behind() -> None:
    mappings = [
        {"LlamaMLP": A},
        {".*Attention$": B},
        {"RMSNorm": C},
        {"^Qwen2Moe": D, "MLP$": A},
        {"^Mistral.*(Attention|MLP)$": B},
        {".*DecoderLayer$": C},
        {"Gemma.*Norm": D, "LlamaAttention": A},
        {"RotaryEmbedding$": B},
    ]
    for mapping in mappings:
        _settle(mapping)
    expected = [_fresh(mapping) for mapping in mappings]
    assert all(expected)
    snapshot = Snapshot()
    barrier = threading.Barrier(len(mappings))
    errors: list[BaseException] = []
    seen: list[set[tuple[str, str]]] = [set() for _ in mappings]

    def work(index: int) -> None:
        mapping = mappings[index]
        try:
            barrier.wait(30)
            for _ in range(25):
                with apply_mapping(mapping) as replaced:
                    seen[index] |= {(module.__name__, name) for module, name, _ in replaced}
                    for module, name, original in replaced:
                        assert getattr(module, name) is find_replacement(name, mapping), (index, name)
                        assert original not in (A, B, C, D), (index, name)  # another thread's leftover
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(mappings))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors
    assert seen == expected
    snapshot.assert_unchanged()
    assert transformers.models.llama.modeling_llama.LlamaMLP.__name__ == "LlamaMLP"
