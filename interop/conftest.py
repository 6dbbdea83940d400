"""What every interop suite shares: transformers 5.17's alias modules, defused."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest


def broken_alias_modules() -> list[str]:
    """transformers 5.17's alias modules whose ``dir()`` raises (torchvision missing)."""
    broken = []
    for name, module in list(sys.modules.items()):
        if type(module) is types.ModuleType and "__dir__" in vars(module) and name.startswith("transformers"):
            try:
                dir(module)
            except ImportError:
                broken.append(name)
    return broken


@pytest.fixture
def defused() -> Iterator[None]:
    """Give the alias modules an empty ``__dir__`` for one test, what a user without torchvision does:
    llm-compressor's own calls meet them (test_llmcompressor.py shows why); put back after it."""
    saved = {name: vars(sys.modules[name])["__dir__"] for name in broken_alias_modules()}
    for name in saved:
        sys.modules[name].__dir__ = list  # type: ignore[method-assign]
    yield
    for name, original in saved.items():
        sys.modules[name].__dir__ = original  # type: ignore[method-assign]
