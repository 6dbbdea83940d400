"""pytest fixtures for pack authors (registered through the ``pytest11`` entry point).

Kept free of heavy imports: torch and transformers load only when a fixture is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint("llama", num_hidden_layers=1)``: a small random checkpoint directory."""
    from .testing import tiny_checkpoint as build

    def factory(model_type_or_config: Any, *, seed: int = 0, **overrides: Any) -> Path:
        name = model_type_or_config if isinstance(model_type_or_config, str) else "config"
        return build(model_type_or_config, tmp_path_factory.mktemp(f"tiny-{name}"), seed=seed, **overrides)

    return factory


@pytest.fixture
def hfpatch_disabled() -> Iterator[None]:
    """Make sure hfpatch is disabled around the test."""
    from .session import disable

    disable()
    yield
    disable()
