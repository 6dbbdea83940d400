"""Every bad input hfpatch can meet, in the default and the strict mode, in one table.

For each case a good pack (``good``, replacing ``LlamaMLP``) is installed next to the
faulty input, and the process already runs ``enable("good")`` when the faulty
``HF_PATCH_PACKS`` / ``HF_PATCH_STRICT`` arrive.  Then ``enable()`` reads them and a tiny
llama is loaded twice.  Each case states, per mode, where the problem surfaces:

* ``raise@enable`` / ``raise@load``: that step raises the case's error type with the
  case's message, and nothing was registered before it;
* ``warn@enable`` / ``warn@load``: exactly one ``PackWarning`` with the message, across
  ``enable()`` and both loads, and the loads succeed without the faulty pack;
* ``quiet``: no warning, no error (what is wrong is not a failure at load time, e.g. a
  converter for a key no model has); ``hfpatch check`` is what reports it.

and, whatever the outcome: the good pack still applies to every load that runs (an
``enable()`` that fails leaves the previous selection in force); transformers' patch
registry, its conversion registry and every transformers module attribute are as
before; only the good pack's keys (and those a case lists as legitimately registered)
ever reach the registries; and ``hfpatch check bad`` reports the problem where the
problem is in a pack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from transformers import AutoModelForCausalLM, conversion_mapping, monkey_patching

import hfpatch_core
import hfpatch_core.cli as cli
from conftest import Snapshot
from hfpatch_core import DuplicatePackError, PackError, PackWarning, SelectionError, plan_of
from hfpatch_core.cli.exit_codes import EXIT_PROBLEMS
from packs import MLP_PACK, PackSpec

Outcome = Literal["raise@enable", "raise@load", "warn@enable", "warn@load", "quiet"]


@dataclasses.dataclass(frozen=True)
class Fault:
    """One bad input and what hfpatch must do about it."""

    packs: tuple[PackSpec, ...]
    message: str
    default: Outcome
    strict: Outcome
    error: type[Exception] = PackError
    selection: str = "bad,good"
    #: regex ``hfpatch check bad`` must print (exit code 1); None where the input is not a pack's.
    check: str | None = None
    #: registry keys the faulty pack registers: for a load (it is valid, just useless), or by
    #: calling transformers' registration functions itself (undone before the load goes on).
    registers: frozenset[str] = frozenset()
    converts: frozenset[str] = frozenset()


def hook(body: str, name: str = "provide_patches", argument: str = "context") -> str:
    """A pack module whose one hook runs ``body``."""
    lines = "\n".join(f"    {line}" for line in body.strip().splitlines())
    return (
        "import torch\nfrom torch import nn\nfrom hfpatch_core import Converter, Patch, hookimpl\n"
        "from transformers.core_model_loading import WeightRenaming\n"
        "from transformers.models.llama.modeling_llama import LlamaMLP\n\n"
        f"@hookimpl\ndef {name}({argument}):\n{lines}\n"
    )


def bad(source: str, **fields: Any) -> tuple[PackSpec, ...]:
    return (PackSpec("bad", source, **fields),)


PACK_FAILURE = {"default": "warn@load", "strict": "raise@load"}
SELECTION_PROBLEM = {"default": "warn@enable", "strict": "raise@enable"}
INPUT_ERROR = {"default": "raise@enable", "strict": "raise@enable"}

FAULTS: dict[str, Fault] = {
    "pack import error": Fault(
        bad("raise ImportError('no such kernel')\n"),
        r"pack 'bad' \(hfpatch-pack-bad 1\.0\.0\) failed to import 'hfpatch_test_pack_bad': "
        r"ImportError: no such kernel",
        **PACK_FAILURE,
        check=r"failed to import 'hfpatch_test_pack_bad': ImportError: no such kernel",
    ),
    "pack syntax error": Fault(
        bad("def provide_patches(context:\n"),
        r"pack 'bad' .*failed to import 'hfpatch_test_pack_bad': SyntaxError",
        **PACK_FAILURE,
        check=r"failed to import 'hfpatch_test_pack_bad': SyntaxError",
    ),
    "entry point names a missing module": Fault(
        bad(MLP_PACK, entry_value="hfpatch_test_pack_nowhere"),
        r"pack 'bad' .*failed to import 'hfpatch_test_pack_nowhere': ModuleNotFoundError",
        **PACK_FAILURE,
        check=r"failed to import 'hfpatch_test_pack_nowhere'",
    ),
    "hook raises": Fault(
        bad(hook("raise KeyError('oops')")),
        r"pack 'bad': provide_patches\(\) raised KeyError: 'oops'",
        **PACK_FAILURE,
        check=r"provide_patches\(\) raised KeyError: 'oops'",
    ),
    "converter hook raises": Fault(
        bad(hook("raise RuntimeError('no layout')", name="provide_converters")),
        r"pack 'bad': provide_converters\(\) raised RuntimeError: no layout",
        **PACK_FAILURE,
        check=r"provide_converters\(\) raised RuntimeError: no layout",
    ),
    "hook returns None": Fault(
        bad(hook("pass")),
        r"pack 'bad': provide_patches\(\) returned None; return an empty list",
        **PACK_FAILURE,
        check=r"provide_patches\(\) returned None",
    ),
    "hook returns a dict": Fault(
        bad(hook("return {'LlamaMLP': nn.Identity}")),
        r"pack 'bad': provide_patches\(\) returned dict .*; return a list of Patch or Refusal objects",
        **PACK_FAILURE,
        check=r"provide_patches\(\) returned dict",
    ),
    "hook returns a string": Fault(
        bad(hook("return 'LlamaMLP'")),
        r"pack 'bad': provide_patches\(\) returned str 'LlamaMLP'; return a list of Patch or Refusal objects",
        **PACK_FAILURE,
        check=r"provide_patches\(\) returned str",
    ),
    "hook returns a class instead of a Patch": Fault(
        bad(hook("return [nn.Identity]")),
        r"pack 'bad': provide_patches\(\) returned type .*Identity.* among its results; every item must be a Patch",
        **PACK_FAILURE,
        check=r"every item must be a Patch",
    ),
    "converter hook returns a Patch": Fault(
        bad(hook("return [Patch('LlamaMLP', nn.Identity)]", name="provide_converters")),
        r"pack 'bad': provide_converters\(\) returned Patch .* every item must be a Converter",
        **PACK_FAILURE,
        check=r"every item must be a Converter",
    ),
    "replacement is not a Module class": Fault(
        bad(hook("return [Patch('LlamaMLP', dict)]")),
        r"pack 'bad': provide_patches\(\) built an invalid value: .*class builtins\.dict does not derive from "
        r"torch\.nn\.Module",
        **PACK_FAILURE,
        check=r"does not derive from torch\.nn\.Module",
    ),
    "replacement is an instance": Fault(
        bad(hook("return [Patch('LlamaMLP', nn.Identity())]")),
        r"pack 'bad': provide_patches\(\) built an invalid value: .*got an instance of Identity; "
        r"pass the class itself",
        **PACK_FAILURE,
        check=r"got an instance of Identity",
    ),
    "invalid regex": Fault(
        bad(hook("return [Patch('*MLP', LlamaMLP)]")),
        r"pack 'bad': provide_patches\(\) built an invalid value: Patch target '\*MLP' is not a valid regular "
        r"expression",
        **PACK_FAILURE,
        check=r"'\*MLP' is not a valid regular expression",
    ),
    "converter with a bad key": Fault(
        bad(hook("return [Converter(42, [])]", name="provide_converters")),
        r"pack 'bad': provide_converters\(\) built an invalid value: Converter key must be a model_type",
        **PACK_FAILURE,
        check=r"Converter key must be a model_type",
    ),
    "hook registers a patch mapping itself": Fault(
        bad(
            hook(
                "from transformers import monkey_patching\n"
                "from transformers.models.llama.modeling_llama import LlamaRMSNorm\n"
                "class LeakedNorm(LlamaRMSNorm):\n    pass\n"
                "monkey_patching.register_patch_mapping({'LlamaRMSNorm': LeakedNorm})\n"
                "return []"
            )
        ),
        r"pack 'bad': provide_patches\(\) changed transformers' registries itself \(register_patch_mapping\("
        r"\{'LlamaRMSNorm': hfpatch_test_pack_bad\.provide_patches\.<locals>\.LeakedNorm\}\)\); undone",
        **PACK_FAILURE,
        check=r"provide_patches\(\) changed transformers' registries itself",
        registers=frozenset({"LlamaRMSNorm"}),
    ),
    "hook registers a conversion list itself": Fault(
        bad(
            hook(
                "from transformers import conversion_mapping\n"
                "conversion_mapping.register_checkpoint_conversion_mapping(\n"
                "    'llama', [WeightRenaming('mlp.up_proj', 'mlp.up')], overwrite=True\n)\n"
                "return []",
                name="provide_converters",
            )
        ),
        r"pack 'bad': provide_converters\(\) changed transformers' registries itself "
        r"\(register_checkpoint_conversion_mapping\('llama', \.\.\.\)\); undone",
        **PACK_FAILURE,
        check=r"provide_converters\(\) changed transformers' registries itself",
        converts=frozenset({"llama"}),
    ),
    "hook with an argument no spec has": Fault(
        bad(hook("return []", argument="model")),
        r"pack 'bad' .*provide_patches.*\bmodel\b.*(?:not available|can not be found)",
        **PACK_FAILURE,
        check=r"provide_patches.*\bmodel\b",
    ),
    "misspelled hook name": Fault(
        bad(hook("return [Patch('LlamaMLP', LlamaMLP)]", name="provide_patch")),
        r"pack 'bad'.*unknown hook 'provide_patch'",
        **PACK_FAILURE,
        check=r"unknown hook 'provide_patch'",
    ),
    "target matches nothing": Fault(
        bad(hook("return [Patch('LlamaMPL', LlamaMLP)] if context.model_type == 'llama' else []")),
        r"pack 'bad': patch target 'LlamaMPL' matches no module class of the installed transformers",
        **PACK_FAILURE,
        check=r"pack 'bad': patch target 'LlamaMPL' matches no module class a llama load reads",
    ),
    "target of no class anywhere, next to a good one": Fault(
        bad(
            hook(
                "if context.model_type != 'llama':\n    return []\n"
                "return [Patch('LlamaNonexistentClass', LlamaMLP, priority=-5),\n"
                "        Patch('LlamaMLP', LlamaMLP, priority=-5)]"
            )
        ),
        r"pack 'bad': patch target 'LlamaNonexistentClass' matches no module class of the installed transformers",
        **PACK_FAILURE,
        check=r"'LlamaNonexistentClass' matches no module class",
    ),
    "converter for a key no model has": Fault(
        bad(
            hook(
                "if context.model_type != 'llama':\n    return []\n"
                "return [Converter('no_such_model', [WeightRenaming('mlp.up_proj', 'mlp.up')])]",
                name="provide_converters",
            )
        ),
        "",
        default="quiet",
        strict="quiet",
        check=r"pack 'bad': converter key 'no_such_model' is neither a model type nor a model class",
        converts=frozenset({"no_such_model"}),
    ),
    "duplicate pack name": Fault(
        (
            PackSpec("bad", MLP_PACK, distribution="hfpatch-pack-bad", module="hfpatch_test_pack_bad_one"),
            PackSpec("bad", MLP_PACK, distribution="other-bad", version="2.0", module="hfpatch_test_pack_bad_two"),
        ),
        r"pack name 'bad' is declared by hfpatch-pack-bad 1\.0\.0 \(hfpatch_test_pack_bad_one\) and other-bad 2\.0 "
        r"\(hfpatch_test_pack_bad_two\); uninstall all but one",
        **SELECTION_PROBLEM,
        error=DuplicatePackError,
        check=r"pack name 'bad' is declared by",
    ),
    "incompatible transformers range": Fault(
        bad(MLP_PACK, requires=("transformers>=6,<7",)),
        r"pack 'bad' \(hfpatch-pack-bad 1\.0\.0\) supports transformers<7,>=6 but \S+ is installed; it is skipped",
        **SELECTION_PROBLEM,
        check=r"supports transformers<7,>=6",
    ),
    "transformers range below the installed one": Fault(
        bad(MLP_PACK, requires=("transformers<5",)),
        r"pack 'bad' \(hfpatch-pack-bad 1\.0\.0\) supports transformers<5 but \S+ is installed",
        **SELECTION_PROBLEM,
        check=r"supports transformers<5",
    ),
    "malformed HF_PATCH_PACKS: none plus a name": Fault(
        (),
        r"HF_PATCH_PACKS='none,good': 'none' cannot be combined with other items",
        **INPUT_ERROR,
        error=SelectionError,
        selection="none,good",
    ),
    "malformed HF_PATCH_PACKS: bad offset": Fault(
        (),
        r"HF_PATCH_PACKS='good@x': 'good@x' is not a pack name, '-name' or 'name@N'",
        **INPUT_ERROR,
        error=SelectionError,
        selection="good@x",
    ),
    "malformed HF_PATCH_PACKS: exclusion without all": Fault(
        (),
        r"HF_PATCH_PACKS='good,-other': '-other' disables a pack while 'good' lists the only packs",
        **INPUT_ERROR,
        error=SelectionError,
        selection="good,-other",
    ),
    "malformed HF_PATCH_PACKS: stray characters": Fault(
        (),
        r"HF_PATCH_PACKS='good;other': 'good;other' is not a pack name",
        **INPUT_ERROR,
        error=SelectionError,
        selection="good;other",
    ),
    "unknown pack name": Fault(
        (),
        r"HF_PATCH_PACKS='good,goood' names pack 'goood', which is not installed \(installed packs: .*good.*\); "
        r"did you mean 'good'\?",
        **INPUT_ERROR,
        error=SelectionError,
        selection="good,goood",
    ),
    "priority override of a pack that does not exist": Fault(
        (),
        r"HF_PATCH_PACKS='all,ghost@\+5' names pack 'ghost', which is not installed",
        **INPUT_ERROR,
        error=SelectionError,
        selection="all,ghost@+5",
    ),
    "exclusion of a pack that does not exist": Fault(
        (),
        r"HF_PATCH_PACKS='-ghost' names pack 'ghost', which is not installed",
        **INPUT_ERROR,
        error=SelectionError,
        selection="-ghost",
    ),
}

MODES = ("default", "strict")
CASES = [(case, mode) for case in FAULTS for mode in MODES]


def test_fault_matrix_size() -> None:
    # the count is printed in the run's summary (conftest.pytest_terminal_summary)
    assert len(CASES) == 2 * len(FAULTS) >= 50


def conversion_state() -> tuple[dict[str, int], frozenset[str] | None]:
    """transformers' conversion registry: each key and the identity of its list, and the user-registered keys."""
    conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds the registry if it is not yet
    cache = conversion_mapping._checkpoint_conversion_mapping_cache
    assert cache is not None
    user = getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", None)
    return {key: id(value) for key, value in cache.items()}, (frozenset(user) if user is not None else None)


@dataclasses.dataclass
class Registrations:
    """Keys registered in transformers' two registries while :func:`recording` is active."""

    patches: list[str] = dataclasses.field(default_factory=list)
    conversions: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def recording(seen: Registrations) -> Iterator[Registrations]:
    register_patches = monkey_patching.register_patch_mapping
    register_conversions = conversion_mapping.register_checkpoint_conversion_mapping

    def patches(mapping: dict[str, type], *args: Any, **kwargs: Any) -> None:
        seen.patches.extend(mapping)
        register_patches(mapping, *args, **kwargs)

    def conversions(key: str, *args: Any, **kwargs: Any) -> None:
        seen.conversions.append(key)
        register_conversions(key, *args, **kwargs)

    monkey_patching.register_patch_mapping = patches
    conversion_mapping.register_checkpoint_conversion_mapping = conversions
    try:
        yield seen
    finally:
        monkey_patching.register_patch_mapping = register_patches
        conversion_mapping.register_checkpoint_conversion_mapping = register_conversions


def mlp_class(model: Any) -> str:
    return type(model.model.layers[0].mlp).__name__


@pytest.mark.parametrize(("case", "mode"), CASES, ids=[f"{case}-{mode}" for case, mode in CASES])
def test_fault(case: str, mode: str, install, llama_checkpoint, monkeypatch, capsys) -> None:
    fault = FAULTS[case]
    install(PackSpec("good", MLP_PACK), *fault.packs)
    conversions_before = conversion_state()
    snapshot = Snapshot()
    hfpatch_core.enable("good", strict=False)  # what the process runs when the bad input arrives

    monkeypatch.setenv("HF_PATCH_PACKS", fault.selection)
    if mode == "strict":
        monkeypatch.setenv("HF_PATCH_STRICT", "1")
    expected: Outcome = fault.strict if mode == "strict" else fault.default
    seen = Registrations()
    raised_at: str | None = None
    error: Exception | None = None
    models: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            hfpatch_core.enable()
        except Exception as exc:
            raised_at, error = "enable", exc
        at_enable = len(caught)
        with recording(seen):
            try:
                for _ in range(2):
                    models.append(AutoModelForCausalLM.from_pretrained(llama_checkpoint))
            except Exception as exc:
                assert raised_at is None, f"enable() raised {error!r}, then the load raised {exc!r}"
                raised_at, error = "load", exc
    pack_warnings = [(index, w) for index, w in enumerate(caught) if issubclass(w.category, PackWarning)]
    messages = [str(w.message) for _, w in pack_warnings]

    if expected.startswith("raise@"):
        assert raised_at == expected.removeprefix("raise@"), f"expected {expected}, got {raised_at}: {error!r}"
        assert isinstance(error, fault.error), repr(error)
        assert re.search(fault.message, str(error), re.S), str(error)
        assert not messages, messages
    else:
        assert error is None, f"{expected}: {error!r}"
        if expected == "quiet":
            assert not messages, messages
        else:
            assert len(messages) == 1, messages  # once, although enable() and two loads saw it
            assert re.search(fault.message, messages[0], re.S), messages[0]
            phase = "enable" if pack_warnings[0][0] < at_enable else "load"
            assert phase == expected.removeprefix("warn@"), f"the warning came at {phase}"

    if raised_at == "load":
        assert not models
        assert set(seen.patches) <= fault.registers, f"registered before raising: {seen.patches}"
        assert set(seen.conversions) <= fault.converts, f"registered before raising: {seen.conversions}"
    else:
        assert len(models) == 2
        for model in models:
            plan = plan_of(model)
            assert mlp_class(model) == "PackMLP", "the good pack no longer applies"
            assert plan is not None and "good" in dict(plan.packs)
            assert ("bad" in dict(plan.packs)) == (expected == "quiet")
            assert plan.replaced["LlamaMLP"].pack == "good"
            assert not any(claim.pack == "bad" for claim in plan.replaced.values())
        assert set(seen.patches) <= {"LlamaMLP", *fault.registers}, seen.patches
        assert set(seen.conversions) <= set(fault.converts), seen.conversions
        if raised_at == "enable":
            assert set(dict(plan_of(models[0]).packs)) == {"good"}  # the previous selection stays in force

    hfpatch_core.disable()
    snapshot.assert_unchanged()
    assert conversion_state() == conversions_before, "the conversion registry changed"

    if fault.check is not None and mode == "default":
        capsys.readouterr()
        code = cli.main(["check", "bad"])
        output = capsys.readouterr().out
        assert code == EXIT_PROBLEMS, output
        assert re.search(fault.check, output, re.S), output
        assert "FAIL" in output
        snapshot.assert_unchanged()
