"""The pytest plugin's ``hfpatch_isolation`` fixture, run on inner test files with pytester."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import conversion_mapping, monkey_patching
from transformers.models.llama import modeling_llama
from transformers.utils import logging as transformers_logging

import hfpatch_core
from conftest import Installer
from hfpatch_core._runtime.snapshot import GlobalState
from packs import PackSpec
from test_recorders import PROXY_PACK

#: Imported by every inner test file: a tiny llama config and a replacement that is not a LlamaAttention.
HEADER = """
import os

import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaConfig, conversion_mapping, monkey_patching
from transformers.models.llama import modeling_llama

import hfpatch_core

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


class Stranger(nn.Module):
    def __init__(self, config=None, layer_idx=None):
        super().__init__()


def assert_clean():
    assert monkey_patching.get_patch_mapping() == {}
    assert modeling_llama.LlamaPreTrainedModel._can_record_outputs["attentions"] is modeling_llama.LlamaAttention
    assert modeling_llama.LlamaMLP.__module__ == modeling_llama.__name__
    assert "hfpatch-test" not in conversion_mapping._checkpoint_conversion_mapping_cache
    assert "hfpatch-test" not in getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", ())
    assert not hfpatch_core.is_enabled()
"""


def run_inner(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makepyfile(HEADER + textwrap.dedent(body))
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")


def assert_outer_state_clean() -> None:
    assert monkey_patching.get_patch_mapping() == {}
    assert modeling_llama.LlamaPreTrainedModel._can_record_outputs["attentions"] is modeling_llama.LlamaAttention
    assert modeling_llama.LlamaMLP.__module__ == modeling_llama.__name__
    assert "hfpatch-test" not in conversion_mapping._checkpoint_conversion_mapping_cache
    assert not hfpatch_core.is_enabled()


def test_the_plugin_module_imports_neither_torch_nor_transformers() -> None:
    code = "import sys, hfpatch_core.pytest_plugin; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


#: The modules of hfpatch_core that hfpatch_core._runtime.snapshot must not import.
ABOVE_SNAPSHOT = ("_session", "cli", "testing", "pytest_plugin")


def test_the_snapshot_module_stays_in_its_layer() -> None:
    # hfpatch_core._runtime.snapshot may import the value modules and transformers (lazily), never
    # torch or transformers at import time, nor the session, the command line or the helpers above it
    above = ["torch", "transformers", *(f"hfpatch_core.{name}" for name in ABOVE_SNAPSHOT)]
    code = f"import sys, hfpatch_core._runtime.snapshot; print(sorted(set({above!r}) & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
    # nor later, inside a function: every import, relative ones resolved from hfpatch_core._runtime
    tree = ast.parse((Path(hfpatch_core.__file__).parent / "_runtime" / "snapshot.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = ["hfpatch_core", "_runtime"][: 2 - (node.level - 1)] if node.level else []
        names = [node.module] if node.module else [alias.name for alias in node.names]
        imported |= {".".join([*base, name]) for name in names}
    assert imported, "the test reads no import of snapshot.py"
    tops = {name.removeprefix("hfpatch_core.").split(".")[0] for name in imported if name.startswith("hfpatch_core.")}
    assert not tops & set(ABOVE_SNAPSHOT), imported


def test_the_snapshot_lists_changes_without_restoring_and_restore_puts_them_back() -> None:
    original = modeling_llama.LlamaMLP
    state = GlobalState.capture()
    assert state.changes() == []

    class Other(original):
        pass

    modeling_llama.LlamaMLP = Other
    monkey_patching.register_patch_mapping({"LlamaRMSNorm": Other})
    changes = state.changes()
    assert len(changes) == 2, changes
    assert changes[0].startswith("transformers' patch registry: added 'LlamaRMSNorm'")
    assert "modeling_llama.LlamaMLP is " in changes[1] and changes[1].endswith("modeling_llama.LlamaMLP)")
    assert modeling_llama.LlamaMLP is Other  # only listed
    assert state.restore() == changes
    assert modeling_llama.LlamaMLP is original and monkey_patching.get_patch_mapping() == {}
    assert state.changes() == []


def test_the_test_starts_clean_and_the_environment_comes_back(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_PATCH_PACKS", "outer")
    monkeypatch.setenv("HF_PATCH_STRICT", "1")
    monkeypatch.delenv("HFPATCH_AUTORUN", raising=False)
    hfpatch_core.enable("none")
    outer = hfpatch_core._session.session.active_session()
    result = run_inner(
        pytester,
        """
        def test_changes_the_environment(hfpatch_isolation, monkeypatch):
            assert not hfpatch_core.is_enabled()
            assert not {"HF_PATCH_PACKS", "HF_PATCH_STRICT", "HFPATCH_AUTORUN"} & set(os.environ)
            os.environ["HF_PATCH_PACKS"] = "inner"
            os.environ["HFPATCH_AUTORUN"] = "1"
            monkeypatch.setenv("HF_PATCH_STRICT", "0")
            hfpatch_core.enable("none")
        """,
    )
    # choosing packs and enabling hfpatch is what tests do: put back, not reported
    result.assert_outcomes(passed=1)
    assert (os.environ["HF_PATCH_PACKS"], os.environ["HF_PATCH_STRICT"]) == ("outer", "1")
    assert "HFPATCH_AUTORUN" not in os.environ
    assert (
        hfpatch_core._session.session.active_session() is outer
    )  # enabled before the inner test: enabled again after it


def test_a_registered_patch_and_the_recorders_it_repointed_are_reported_and_restored(
    pytester: pytest.Pytester,
) -> None:
    # Plain transformers: its patch_output_recorders repoints LlamaModel's recorders for good.
    result = run_inner(
        pytester,
        """
        def test_leaks(hfpatch_isolation):
            monkey_patching.register_patch_mapping({"LlamaAttention": Stranger})
            model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
            assert type(model.model.layers[0].self_attn) is Stranger

        def test_after():
            assert_clean()
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*hfpatch_isolation: the test left global state changed (restored now;*",
            "- transformers' patch registry: added 'LlamaAttention' -> test_a_*.Stranger",
            "- transformers.models.llama.modeling_llama.LlamaPreTrainedModel._can_record_outputs: 'attentions' is "
            "test_a_*.Stranger (was transformers.models.llama.modeling_llama.LlamaAttention)",
            "If the test changes it on purpose, call hfpatch_isolation.allow_changes().",
        ]
    )
    assert "ERROR at teardown of test_leaks" in result.stdout.str()
    assert_outer_state_clean()


def test_a_leaked_conversion_and_module_class_are_reported_and_restored(pytester: pytest.Pytester) -> None:
    result = run_inner(
        pytester,
        """
        def test_leaks(hfpatch_isolation):
            conversion_mapping.register_checkpoint_conversion_mapping("hfpatch-test", [], overwrite=True)
            modeling_llama.LlamaMLP = Stranger

        def test_after():
            assert_clean()
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "- transformers' conversion registry: added 'hfpatch-test' -> []",
            "- transformers.models.llama.modeling_llama.LlamaMLP is test_a_*.Stranger "
            "(was transformers.models.llama.modeling_llama.LlamaMLP)",
        ]
    )
    assert_outer_state_clean()


def test_what_monkeypatch_undoes_and_changes_allowed_on_purpose_are_not_reported(pytester: pytest.Pytester) -> None:
    result = run_inner(
        pytester,
        """
        import pytest

        @pytest.fixture
        def stranger_mlp(monkeypatch):
            monkeypatch.setattr(modeling_llama, "LlamaMLP", Stranger)
            monkeypatch.setenv("HF_PATCH_PACKS", "none")

        def test_monkeypatched(monkeypatch, hfpatch_isolation):
            monkeypatch.setattr(modeling_llama, "LlamaMLP", Stranger)
            monkeypatch.setitem(modeling_llama.LlamaPreTrainedModel._can_record_outputs, "attentions", Stranger)

        def test_a_fixture_set_up_first_monkeypatched(stranger_mlp, hfpatch_isolation):
            assert modeling_llama.LlamaMLP is Stranger and "HF_PATCH_PACKS" not in os.environ

        def test_on_purpose(hfpatch_isolation):
            hfpatch_isolation.allow_changes()
            monkey_patching.register_patch_mapping({"LlamaAttention": Stranger})

        def test_after():
            assert_clean()
            assert "HF_PATCH_PACKS" not in os.environ
        """,
    )
    result.assert_outcomes(passed=4)
    assert_outer_state_clean()


def test_recorders_of_a_class_imported_during_the_test_pointing_outside_transformers_are_reported(
    pytester: pytest.Pytester,
) -> None:
    name = "transformers.models.hfpatch_fake.modeling_hfpatch_fake"
    try:
        result = run_inner(
            pytester,
            f"""
            import sys
            import types

            class FakePreTrainedModel(nn.Module):
                __module__ = {name!r}
                _can_record_outputs = {{"hidden_states": Stranger, "attentions": modeling_llama.LlamaAttention}}

            def test_imports_a_leaky_module(hfpatch_isolation):
                module = sys.modules[{name!r}] = types.ModuleType({name!r})
                module.FakePreTrainedModel = FakePreTrainedModel
            """,
        )
    finally:
        sys.modules.pop(name, None)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.re_match_lines(
        [
            re.escape(f"- {name}.FakePreTrainedModel._can_record_outputs['hidden_states'] points at test_")
            + r"\w+"
            + re.escape(".Stranger (the class was first imported during the test: not restored)"),
        ]
    )
    assert "'attentions'" not in result.stdout.str()


def test_a_load_hfpatch_manages_leaves_nothing_to_report(pytester: pytest.Pytester, install: Installer) -> None:
    # ProxyAttention is not a LlamaAttention: hfpatch repoints the recorders for the load, then puts them back.
    install(PackSpec("proxy", PROXY_PACK))
    result = run_inner(
        pytester,
        """
        def test_loads(hfpatch_isolation):
            hfpatch_core.enable("proxy", strict=True)
            model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
            assert type(model.model.layers[0].self_attn).__name__ == "ProxyAttention"
        """,
    )
    result.assert_outcomes(passed=1)
    assert_outer_state_clean()


def test_the_factory_fixture_and_its_old_name_build_checkpoints_beside_the_function(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from hfpatch_core.testing import tiny_checkpoint

        def test_both(tiny_checkpoint_factory, request, tmp_path):
            made = tiny_checkpoint_factory("llama", num_hidden_layers=1)
            assert (made / "model.safetensors").exists()
            old = request.getfixturevalue("tiny_checkpoint")
            assert (old("llama", num_hidden_layers=1) / "config.json").exists()
            # the function keeps its name in a test that uses the factory
            assert (tiny_checkpoint("llama", tmp_path / "c", num_hidden_layers=1) / "config.json").exists()
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)


#: A pack whose LlamaMLP holds one parameter more: a checkpoint saved with it enabled has ``mlp.marker``.
MARKED_PACK = """
import torch
import torch.nn as nn
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP

class MarkedMLP(LlamaMLP):
    def __init__(self, config):
        super().__init__(config)
        self.marker = nn.Parameter(torch.zeros(1))

@hookimpl
def provide_patches(context):
    return [Patch("LlamaMLP", MarkedMLP)]
"""


def test_a_suites_cases_are_saved_once_per_session_by_vanilla_transformers(
    pytester: pytest.Pytester, install: Installer
) -> None:
    """``tiny_checkpoints``: what every first-party pack's ``checkpoints`` fixture returns (issue 38.10)."""
    install(PackSpec("marked", MARKED_PACK))
    pytester.makeconftest(
        """
        import pytest
        from transformers import LlamaConfig, Qwen2Config

        import hfpatch_core
        from hfpatch_core.testing import TINY_DECODER

        CASES = {
            "llama": lambda: LlamaConfig(**TINY_DECODER),
            "qwen2": Qwen2Config(**{**TINY_DECODER, "num_hidden_layers": 1}),  # a config, not a function
            "llama-again": lambda: LlamaConfig(**TINY_DECODER),
        }
        BUILT = []


        @pytest.fixture(scope="session")
        def checkpoints(tiny_checkpoints):
            hfpatch_core.enable("marked", strict=True)  # a pack chosen when the session fixture runs
            BUILT.append(1)
            try:
                return tiny_checkpoints(CASES)
            finally:
                hfpatch_core.disable()
        """
    )
    pytester.makepyfile(
        """
        import json

        from conftest import BUILT
        from hfpatch_core.testing import TINY_DECODER, safetensors_of


        def test_each_case_is_saved(checkpoints):
            assert list(checkpoints) == ["llama", "qwen2", "llama-again"]
            assert len({path.parent for path in checkpoints.values()}) == 1  # pytest's temporary directory
            saved = {name: json.loads((path / "config.json").read_text()) for name, path in checkpoints.items()}
            assert [config["model_type"] for config in saved.values()] == ["llama", "qwen2", "llama"]
            assert saved["qwen2"]["num_hidden_layers"] == 1
            assert all(saved[name]["initializer_range"] == TINY_DECODER["initializer_range"] for name in saved)


        def test_vanilla_layout_and_one_seed_a_case(checkpoints):
            llama, again = safetensors_of(checkpoints["llama"]), safetensors_of(checkpoints["llama-again"])
            assert "model.layers.0.self_attn.q_proj.weight" in llama
            assert not any(key.endswith("marker") for key in llama)  # built without the pack enabled around it
            assert sorted(llama) == sorted(again)
            assert not any(llama[key].equal(again[key]) for key in llama if key.endswith("q_proj.weight"))
            assert BUILT == [1]  # once for the session


        def test_transformers_is_quiet_for_the_session(checkpoints):
            from transformers.utils import logging

            assert logging.get_verbosity() == logging.ERROR and not logging.is_progress_bar_enabled()
        """
    )
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.enable_progress_bar()
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
        result.assert_outcomes(passed=3)
        assert_outer_state_clean()
        # put back at the end of the inner session
        assert transformers_logging.get_verbosity() == verbosity and transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.disable_progress_bar()  # as this suite's conftest has it
