"""``hfpatch_core.authoring.runtime_class``: replacement classes built at runtime pickle as the call
that builds them, and unpickle in a fresh process (issue 38.9)."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers.models.llama import modeling_llama

from conftest import tiny_llama_config
from hfpatch_core.authoring import RuntimeClassMeta, runtime_class

#: A pack-like module: a builder that caches its runtime classes, as a pack's hook would call it.
PACK_MODULE = '''
import torch.nn as nn

from hfpatch_core.authoring import runtime_class


class Scaled:
    """Multiplies the original's output by the class's factor."""

    factor = 1.0

    def forward(self, *args, **kwargs):
        return self.factor * super().forward(*args, **kwargs)


_classes = {}


def scaled_class(original, factor=2.0):
    key = (original, factor)
    if key not in _classes:
        _classes[key] = runtime_class(
            f"Scaled{original.__name__}",
            (Scaled, original),
            {"factor": factor},
            module=__name__,
            rebuild=scaled_class,
            arguments=(original,),
            keywords={"factor": factor},
        )
    return _classes[key]


class Meta(type):
    """A metaclass of the original's own."""


class WithMeta(metaclass=Meta):
    pass


class Named(scaled_class(nn.Linear)):
    """Derived in source from a runtime class: pickled by its name, as any class."""
'''


@pytest.fixture
def pack(tmp_path: Path) -> Iterator[ModuleType]:
    (tmp_path / "runtime_pack.py").write_text(textwrap.dedent(PACK_MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("runtime_pack")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("runtime_pack", None)


def _fresh(code: str, site: Path, *arguments: str) -> str:
    """``code`` run by a new interpreter that has ``site`` on its path; its stdout."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    found = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *arguments],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr
    return found.stdout.strip()


def test_a_patched_model_unpickles_in_a_fresh_process(pack: ModuleType, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = modeling_llama.LlamaForCausalLM(tiny_llama_config())
    model.model.layers[0].mlp.__class__ = pack.scaled_class(modeling_llama.LlamaMLP, factor=3.0)
    torch.save(model, tmp_path / "model.pt")
    hidden = torch.randn(2, 5, 32)
    torch.save(hidden, tmp_path / "hidden.pt")
    expected = model.model.layers[0].mlp(hidden)
    torch.save(expected, tmp_path / "expected.pt")
    # nothing in the new process has built the class: unpickling builds it through the pack's builder
    probe = """
        import sys, torch
        import runtime_pack
        from transformers.models.llama.modeling_llama import LlamaMLP

        assert LlamaMLP not in {original for original, _ in runtime_pack._classes}
        model = torch.load(sys.argv[1] + "/model.pt", weights_only=False)
        mlp = model.model.layers[0].mlp
        hidden = torch.load(sys.argv[1] + "/hidden.pt")
        print(type(mlp).__name__, type(mlp).__module__, type(mlp) is runtime_pack.scaled_class(LlamaMLP, factor=3.0))
        print(isinstance(mlp, LlamaMLP), mlp.factor)
        print(torch.equal(mlp(hidden), torch.load(sys.argv[1] + "/expected.pt")))
        print(torch.equal(mlp(hidden), 3.0 * LlamaMLP.forward(mlp, hidden)))
    """
    assert _fresh(probe, tmp_path, str(tmp_path)).splitlines() == [
        "ScaledLlamaMLP runtime_pack True",
        "True 3.0",
        "True",
        "True",
    ]


def test_in_the_building_process_the_same_class_comes_back(pack: ModuleType) -> None:
    built = pack.scaled_class(modeling_llama.LlamaMLP)
    assert isinstance(built, RuntimeClassMeta)
    assert pickle.loads(pickle.dumps(built)) is built
    # the module does not hold it under its name, so pickle could not have found it by name
    assert not hasattr(pack, built.__name__)


def test_a_plain_runtime_class_does_not_even_pickle() -> None:
    """What ``runtime_class`` is for: ``type(...)`` in a hook gives a class pickle cannot name."""
    plain = type("PlainLlamaMLP", (modeling_llama.LlamaMLP,), {"__module__": __name__})
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(plain)


def test_a_class_derived_in_source_pickles_by_its_name(pack: ModuleType, tmp_path: Path) -> None:
    assert isinstance(pack.Named, RuntimeClassMeta)
    assert pickle.loads(pickle.dumps(pack.Named)) is pack.Named
    found = _fresh(
        "import pickle, sys; print(pickle.loads(bytes.fromhex(sys.argv[1])).__qualname__)",
        tmp_path,
        pickle.dumps(pack.Named).hex(),
    )
    assert found == "Named"


def test_an_original_with_a_metaclass_of_its_own(pack: ModuleType, tmp_path: Path) -> None:
    built = pack.scaled_class(pack.WithMeta)
    assert isinstance(built, RuntimeClassMeta) and isinstance(built, pack.Meta)
    assert pickle.loads(pickle.dumps(built)) is built
    probe = """
        import pickle, sys
        cls = pickle.loads(bytes.fromhex(sys.argv[1]))
        print(cls.__name__, [base.__name__ for base in cls.__bases__], cls.factor)
    """
    assert _fresh(probe, tmp_path, pickle.dumps(built).hex()) == "ScaledWithMeta ['Scaled', 'WithMeta'] 2.0"


def test_the_class_is_what_type_would_build() -> None:
    built = runtime_class(
        "Renamed",
        (modeling_llama.LlamaMLP,),
        {"marker": 1},
        module="somewhere",
        rebuild=runtime_class,
    )
    assert (built.__name__, built.__qualname__, built.__module__, built.marker) == (
        "Renamed",
        "Renamed",
        "somewhere",
        1,
    )
    assert built.__mro__[1] is modeling_llama.LlamaMLP
