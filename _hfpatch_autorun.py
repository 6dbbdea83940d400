"""Enable hfpatch in a process started by ``hfpatch run`` (and in its children).

Imported at interpreter start-up by ``hfpatch_autorun.pth`` only when ``HFPATCH_AUTORUN``
is set; it imports nothing heavy itself.  hfpatch is enabled right after
``transformers.modeling_utils`` has been imported, so a program that never loads a
model never pays for torch or transformers.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_TARGET = "transformers.modeling_utils"


def _enable() -> None:
    import hfpatch_core

    hfpatch_core.enable()


class _EnableAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _enable()

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Enable hfpatch now if transformers' modeling code is loaded, else right after it is."""
    if _TARGET in sys.modules:
        _enable()
    elif not any(isinstance(finder, _EnableAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EnableAfterImport())


install()
