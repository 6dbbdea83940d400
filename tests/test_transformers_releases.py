"""What differs between the transformers releases hfpatch supports, held to each.

A test here runs on every release: it checks the behaviour where the release has it, and
on the others what those releases do instead (see ``hfpatch_core._compat``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch.nn as nn

from hfpatch_core import application
from hfpatch_core.application import apply_mapping, attribute_names


class Probe(nn.Module):
    pass


class Replacement(Probe):
    pass


class _Unlisted(types.ModuleType):
    def __dir__(self) -> list[str]:
        raise RuntimeError("this module cannot list its names")


def _alias_module(name: str) -> types.ModuleType:
    """A module like transformers 5.6-5.17's legacy aliases (``..._fast``): its ``__dir__`` and
    ``__getattr__`` import the target, here one that needs a package that is not installed."""
    module = types.ModuleType(name)

    def _import(*_: object) -> object:
        raise ModuleNotFoundError("No module named 'torchvision'")

    module.__getattr__ = _import  # type: ignore[method-assign]
    module.__dir__ = _import  # type: ignore[method-assign]
    module.Probe = Probe  # type: ignore[attr-defined]
    return module


def test_listing_a_module_imports_nothing_and_never_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    alias = _alias_module("transformers.hfpatch_alias_probe")
    unlisted = _Unlisted("transformers.hfpatch_unlisted_probe")
    unlisted.Probe = Probe  # type: ignore[attr-defined]
    for module in (alias, unlisted):
        monkeypatch.setitem(sys.modules, module.__name__, module)
        assert "Probe" in attribute_names(module)
    with apply_mapping({"Probe": Replacement}) as replaced:
        assert alias.Probe is Replacement and unlisted.Probe is Replacement
        assert {(module.__name__, name) for module, name, _ in replaced} >= {
            (alias.__name__, "Probe"),
            (unlisted.__name__, "Probe"),
        }
    assert alias.Probe is Probe and unlisted.Probe is Probe
    assert application.attribute_names(alias) == list(vars(alias))


def test_a_name_that_fails_to_resolve_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            raise RuntimeError(f"Failed to import {name}")  # transformers' wrapping of an import error

    module = Failing("transformers.hfpatch_failing_probe")
    module.__all__ = ["Probe"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(Failing, "__dir__", lambda self: ["Probe"])
    with apply_mapping({"Probe": Replacement}) as replaced:
        assert all(owner is not module for owner, _, _ in replaced)
