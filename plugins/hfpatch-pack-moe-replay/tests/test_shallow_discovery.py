"""``provide_model_types`` answers fast (issue 52.5: it was most of a cold ``hfpatch list``) and as before:
the modeling modules' files are read instead of every module imported (``moe_model_types``), and each
MoE model is built on meta with its first layers first (``sites.router_sites``). Both are checked
against the way it was answered before, on the installed transformers (5.25 and 5.3 in ``make test``)."""

from __future__ import annotations

import inspect

import pytest
from hfpatch_pack_moe_replay import discovery, moe_model_types, provide_model_types, sites
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _imported_moe_model_types() -> list[str]:
    """The enumeration as it was: every modeling module of the causal-LM mapping imported, its source read."""
    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        module = discovery.modeling_module(model_type)
        if module is None:
            continue
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        if "topk" in source and "expert" in source.lower():
            found.append(model_type)
    return found


def _summary(found: discovery.Discovery) -> tuple[object, ...]:
    return (
        found.replayable,
        found.refused,
        found.candidate,
        [(family.router_class, family.selection, family.rule) for family in found.routers],
    )


def test_the_declared_model_types_are_those_of_the_whole_imports_and_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "_cache", {})
    assert moe_model_types() == _imported_moe_model_types()
    declared = list(provide_model_types())
    shallow = {model_type: _summary(discovery.discover(model_type)) for model_type in moe_model_types()}
    # the way it was: every model built with all its layers
    monkeypatch.setattr(discovery, "_cache", {})
    monkeypatch.setattr(sites, "SHALLOW_LAYERS", None)
    whole = {model_type: _summary(discovery.discover(model_type)) for model_type in moe_model_types()}
    assert shallow == whole
    assert declared == list(provide_model_types())
    assert declared and set(declared) <= set(moe_model_types()), declared


def test_the_shallow_build_is_taken_only_when_it_builds_every_class_that_can_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model whose first layers do not build a class named like a router of its module (a later
    layer might hold it) is built whole."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_moe")
    module = discovery.modeling_module("qwen3_moe")
    candidates = list(sites.candidate_classes(module))
    assert config.num_hidden_layers > sites.SHALLOW_LAYERS
    layers: list[int] = []
    import hfpatch_core.authoring as authoring  # sites imports build_on_meta from it when it builds

    real = authoring.build_on_meta

    def recording(model_class: type, attempt: object) -> object:
        model = real(model_class, attempt)
        layers.append(sum(type(sub).__name__.endswith("DecoderLayer") for sub in model.modules()))
        return model

    monkeypatch.setattr(authoring, "build_on_meta", recording)
    sites.router_sites(module, "qwen3_moe", config, candidates)
    assert layers == [sites.SHALLOW_LAYERS]
    layers.clear()

    class Qwen3MoeLateRouter(discovery.nn.Module):  # built by no layer of the model
        pass

    monkeypatch.setattr(module, "Qwen3MoeLateRouter", Qwen3MoeLateRouter, raising=False)
    sites.router_sites(module, "qwen3_moe", config, candidates)
    assert layers == [sites.SHALLOW_LAYERS, config.num_hidden_layers]


def test_the_candidate_classes_read_from_code_objects_are_those_getsource_finds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sites._function_lines`` reads a method's lines from its code object instead of tokenizing the
    file (``inspect.getsource``): the classes whose forward calls ``topk`` are the same, in every MoE
    modeling module of the installed release."""
    modules = [discovery.modeling_module(model_type) for model_type in moe_model_types()]
    modules = [module for module in modules if module is not None]
    assert modules
    read = {module.__name__: list(sites.candidate_classes(module)) for module in modules}

    def getsource(function: object) -> str | None:
        try:
            return inspect.getsource(function)  # type: ignore[arg-type]
        except (OSError, TypeError):
            return None

    monkeypatch.setattr(sites, "_function_lines", getsource)
    tokenized = {module.__name__: list(sites.candidate_classes(module)) for module in modules}
    assert read == tokenized
    assert sum(map(len, read.values())) >= len(modules)


def test_a_probe_config_shrinks_the_sizes_of_the_sub_configs_it_holds() -> None:
    """dbrx's MoE block reads its sizes from ``config.ffn_config``; probed at its default sizes it
    held 88M parameters."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("dbrx")
    shrunk = sites.shrunk_config(config)
    assert (shrunk.d_model, shrunk.ffn_config.hidden_size) == (16, 16)
    fresh = AutoConfig.for_model("dbrx")  # the config asked about is unchanged
    assert (config.d_model, config.ffn_config.hidden_size) == (fresh.d_model, fresh.ffn_config.hidden_size)
    assert min(config.d_model, config.ffn_config.hidden_size) > 16
