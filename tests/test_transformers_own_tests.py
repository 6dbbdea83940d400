"""transformers' own loading and saving model tests, run unmodified with the first-party packs on (issue 44.8).

The test methods are those of ``ModelTesterMixin`` in ``tests/test_modeling_common.py`` of the
installed transformers release (5.25.0 on ``.venv``, 5.3.0 on ``.venv-oldest``), Copyright The
HuggingFace Team, Apache License 2.0.  transformers' wheel has no tests; ``make venv`` downloads
the pinned release's sdist with pip and extracts its ``tests/*.py`` into
``<venv>/transformers-tests`` (the sdist's name in ``SOURCE``): nothing of transformers is
committed here.  The sdist lacks ``tests/models/`` (each model's tester), ``tests/generation/``
and ``tests/exporters/``, so what the mixin needs of those is written here: a tester of our own
(``TinyTester``: a tiny config from ``hfpatch_core.testing.tiny_config`` and its inputs) and empty
``GenerationTesterMixin`` / ``ExportTesterMixin`` bases (none of the methods run here uses them).

Each method runs as transformers wrote it (``TestCase.debug``: the first failed assertion is the
test's failure) for llama, mixtral and qwen3_moe, once vanilla (the reference: it must pass) and
once inside ``hfpatch_core.enabled(packs=...)`` with each pack of issue 44.8 that replaces modules
there.  Models the method builds by their constructor stay vanilla (a patched load is
``from_pretrained``), so a method that compares a constructed model with a loaded one by
``state_dict()`` key or ``parameters()`` position cannot hold: those are strict expected
failures, with the reason docs/adapters.md gives ("What transformers' own tests see");
``tests/test_transformers_model_tests.py`` checks the same through ``original_state_dict``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import types
import unittest
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

import hfpatch_core
from hfpatch_core import plan_of
from hfpatch_core.testing import tiny_config

OWN_TESTS = Path(sys.prefix) / "transformers-tests"
#: the package name transformers' ``tests/`` is imported under (its relative imports need one)
PACKAGE = "transformers_own_tests"

#: issue 44.8: the packs that replace modules of each family (None: vanilla, the reference)
CASES = [
    ("llama", None),
    ("llama", "fused-dense"),
    ("mixtral", None),
    ("mixtral", "linear-experts"),
    ("qwen3_moe", None),
    ("qwen3_moe", "linear-experts"),
    ("qwen3_moe", "qwen-moe"),
]

_STATE_DICT_NAMES = (
    "compares a model built by its constructor (vanilla: a patched load is from_pretrained) with a patched "
    "load by state_dict() key: the patched model's own names (qkv_proj.weight, experts.3.gate_proj.weight)"
)
#: transformers' method -> why it cannot hold with a replacing pack (docs/adapters.md); every
#: other selected method must pass with the packs as it does without
CANNOT_HOLD = {
    "test_can_use_safetensors": _STATE_DICT_NAMES,
    "test_load_save_without_tied_weights": _STATE_DICT_NAMES,
    "test_from_pretrained_no_checkpoint": _STATE_DICT_NAMES,
    "test_can_load_from_already_mapped_keys": _STATE_DICT_NAMES,
    "test_reverse_loading_mapping": _STATE_DICT_NAMES + " (after its mapping checks, which pass)",
    "test_can_load_ignoring_mismatched_shapes": "compares named_parameters() of a constructed classifier "
    "and a patched load by name: the patched model's own names",
    "test_can_init_all_missing_weights": _STATE_DICT_NAMES
    + "; with linear-experts and qwen-moe the random values differ too (drawn expert by expert)",
}
#: what transformers raises for a comparison that fails: assertions, a missing key, and
#: compare_state_dicts' ValueError for different key sets
FAILED_COMPARISON = (AssertionError, KeyError, ValueError)
#: the loading and saving methods of ModelTesterMixin run here (issue 44.8, docs/adapters.md)
METHODS = (
    "test_save_load",
    "test_can_use_safetensors",
    "test_load_save_without_tied_weights",
    "test_can_load_from_already_mapped_keys",
    "test_from_pretrained_no_checkpoint",
    "test_reverse_loading_mapping",
    "test_model_weights_reload_no_missing_tied_weights",
    "test_can_load_ignoring_mismatched_shapes",
    "test_can_init_all_missing_weights",
)


def _can_init_before_2023() -> bool:
    """Whether the mixin lets a model test opt a family whose config file dates before 2023 (llama) into
    ``test_can_init_all_missing_weights``; 5.3.0's skips such families always (read from the extracted
    file, as the parameters are chosen before it is imported; absent, the fixture fails the tests)."""
    source = OWN_TESTS / "test_modeling_common.py"
    return not source.is_file() or "test_can_init_all_missing_weights_before_2023" in source.read_text(encoding="utf-8")


#: methods transformers skips for a family: llama has no weight conversion to test (its
#: checkpoints hold the model's own names), so two skip with "No conversion found"
NOT_APPLICABLE = {
    "llama": {"test_can_load_from_already_mapped_keys", "test_reverse_loading_mapping"}
    | (set() if _can_init_before_2023() else {"test_can_init_all_missing_weights"})
}

_HEADS = (
    "MODEL_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
)


def model_classes(family: str) -> tuple[type, ...]:
    """Every class of ``family`` transformers maps a task to, as its model tests' ``all_model_classes``."""
    names = [getattr(modeling_auto, mapping).get(family) for mapping in _HEADS]
    return tuple(getattr(transformers, name) for name in dict.fromkeys(n for n in names if isinstance(n, str)))


class TinyTester:
    """What ``ModelTesterMixin`` asks of ``self.model_tester`` in the methods run here."""

    batch_size = 2
    seq_length = 7

    def __init__(self, family: str) -> None:
        self.family = family

    def get_config(self) -> Any:
        # pad_token_id: the sequence-classification heads pool at the last non-pad token
        return tiny_config(self.family, pad_token_id=0)

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, torch.Tensor]]:
        config = self.get_config()
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(1, config.vocab_size, (self.batch_size, self.seq_length), generator=generator)
        return config, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _empty_module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


@cache
def model_tester_mixin() -> type:
    """transformers' ``ModelTesterMixin``, imported from the extracted ``tests/test_modeling_common.py``
    (``register_markers`` first, under ``--strict-markers``)."""
    source = OWN_TESTS / "SOURCE"
    assert source.is_file(), f"transformers' own tests are not in {OWN_TESTS}: run make venv (or make venv-oldest)"
    expected = f"transformers-{transformers.__version__}.tar.gz"
    assert source.read_text().strip() == expected, (
        f"{OWN_TESTS} holds the tests of {source.read_text().strip()}, not of the installed {expected}: "
        "remove it and run make venv again"
    )
    sys.path.insert(0, str(OWN_TESTS / "libraries"))  # parameterized, which the file imports
    package = _empty_module(PACKAGE, __path__=[str(OWN_TESTS)])
    # the sdist lacks tests/generation and tests/exporters: empty bases, unused by the methods run here
    package.generation = _empty_module(f"{PACKAGE}.generation", __path__=[])
    _empty_module(f"{PACKAGE}.generation.test_utils", GenerationTesterMixin=type("GenerationTesterMixin", (), {}))
    package.exporters = _empty_module(f"{PACKAGE}.exporters", __path__=[])
    _empty_module(f"{PACKAGE}.exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
    return importlib.import_module(f"{PACKAGE}.test_modeling_common").ModelTesterMixin


@cache
def case_class(family: str) -> type[unittest.TestCase]:
    """A ``unittest.TestCase`` of transformers' mixin for ``family`` (built here, so pytest collects none of it)."""

    def set_up(self: Any) -> None:
        self.model_tester = TinyTester(family)

    return type(
        f"{family.title()}ModelTest",
        (model_tester_mixin(), unittest.TestCase),
        {
            "all_model_classes": model_classes(family),
            "setUp": set_up,
            # transformers skips this method for models added before 2023 unless their tests set it
            "test_can_init_all_missing_weights_before_2023": True,
        },
    )


def register_markers(config: pytest.Config) -> None:
    """The markers transformers' file and its ``testing_utils`` decorate methods with (``mark.slow``,
    ``mark.flash_attn_test``, ...), which transformers' own conftest registers: our
    ``--strict-markers`` refuses them otherwise."""
    testing_utils = importlib.util.find_spec("transformers.testing_utils")
    assert testing_utils is not None and testing_utils.origin is not None
    files = (OWN_TESTS / "test_modeling_common.py", Path(testing_utils.origin))
    source = "".join(path.read_text(encoding="utf-8") for path in files)
    for marker in sorted(set(re.findall(r"\bmark\.([A-Za-z_][A-Za-z0-9_]*)", source))):
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' tests/test_modeling_common.py")


@pytest.fixture(scope="session")
def own_tests(pytestconfig: pytest.Config) -> None:
    """Imported before the per-test isolation snapshots the global state (the import is not a leak)."""
    assert (OWN_TESTS / "SOURCE").is_file(), f"transformers' own tests are not in {OWN_TESTS}: run make venv"
    register_markers(pytestconfig)
    model_tester_mixin()


def _params() -> list[Any]:
    params = []
    for family, pack in CASES:
        for method in METHODS:
            if method in NOT_APPLICABLE.get(family, ()):
                continue
            marks = []
            if pack is not None and method in CANNOT_HOLD:
                marks.append(pytest.mark.xfail(strict=True, raises=FAILED_COMPARISON, reason=CANNOT_HOLD[method]))
            params.append(pytest.param(family, pack, method, marks=marks, id=f"{family}-{pack or 'vanilla'}-{method}"))
    return params


@pytest.mark.parametrize(("family", "pack"), [case for case in CASES if case[1] is not None])
def test_the_pack_replaces_modules_of_the_family(first_party, tmp_path, family, pack) -> None:
    """What the methods below run with a pack is a patched load, not a vanilla one: the pack applies."""
    cls = model_classes(family)[1]
    cls(tiny_config(family, pad_token_id=0)).save_pretrained(tmp_path)
    with hfpatch_core.enabled(packs=pack, strict=True):
        model = cls.from_pretrained(tmp_path)
    plan = plan_of(model)
    assert plan is not None and plan.replaced, f"{pack} replaced nothing in {cls.__name__}"


@pytest.mark.parametrize(("family", "pack", "method"), _params())
def test_transformers_own_method(own_tests, first_party, family, pack, method) -> None:
    """One of transformers' ``ModelTesterMixin`` methods, unmodified, vanilla or with ``pack`` selected."""
    case = case_class(family)(method)
    try:
        with hfpatch_core.enabled(packs=pack or "none", strict=False):
            case.debug()
    except unittest.SkipTest as skipped:  # a skip would pass nothing: the selection above is wrong
        pytest.fail(f"transformers skipped {method} for {family}: {skipped}")
