"""hfpatch-core: installable patch packs for 🤗 Transformers.

Packs are distributions that declare an entry point in the ``hfpatch.packs`` group and
implement the hooks in ``hfpatch_core.hookspecs``.  ``enable()`` makes every model
load gather the packs ``HF_PATCH_PACKS`` selects, resolve their claims and apply the
winners for that load only; ``with enabled(packs=...)`` does the same for the loads of
one thread or asyncio task.

Names are imported on first use, so that ``import hfpatch_core`` (and ``hfpatch list``)
does not import torch.
"""

from __future__ import annotations

import importlib

# typing costs milliseconds to import, and hfpatch run's start-up path imports this package
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AdapterError": "errors",
    "ApplyError": "errors",
    "apply": "inplace",
    "revert": "inplace",
    "Claim": "plan",
    "Converter": "conversion",
    "ConverterConflictError": "errors",
    "SizedConcatenate": "conversion",
    "SizedSplit": "conversion",
    "WeightLayoutError": "errors",
    "DuplicatePackError": "errors",
    "HfPatchError": "errors",
    "InvalidPatchError": "errors",
    "LoadContext": "context",
    "Lost": "plan",
    "PackError": "errors",
    "PackInfo": "discovery",
    "PackWarning": "errors",
    "PatchConflictError": "errors",
    "Patch": "patches",
    "Plan": "plan",
    "SelectionError": "errors",
    "disable": "hooks",
    "discover": "discovery",
    "enable": "hooks",
    "enabled": "hooks",
    "hookimpl": "hookspecs",
    "hookspec": "hookspecs",
    "is_enabled": "hooks",
    "original_state_dict": "state_dicts",
    "patched": "manual",
    "plan_of": "plan",
}

__all__ = [
    "AdapterError",
    "ApplyError",
    "Claim",
    "Converter",
    "ConverterConflictError",
    "DuplicatePackError",
    "HfPatchError",
    "InvalidPatchError",
    "LoadContext",
    "Lost",
    "PackError",
    "PackInfo",
    "PackWarning",
    "Patch",
    "PatchConflictError",
    "Plan",
    "SelectionError",
    "SizedConcatenate",
    "SizedSplit",
    "WeightLayoutError",
    "__version__",
    "apply",
    "disable",
    "discover",
    "enable",
    "enabled",
    "hookimpl",
    "hookspec",
    "is_enabled",
    "original_state_dict",
    "patched",
    "plan_of",
    "revert",
]

if TYPE_CHECKING:
    from .context import LoadContext
    from .conversion import Converter, SizedConcatenate, SizedSplit
    from .discovery import PackInfo, discover
    from .errors import (
        AdapterError,
        ApplyError,
        ConverterConflictError,
        DuplicatePackError,
        HfPatchError,
        InvalidPatchError,
        PackError,
        PackWarning,
        PatchConflictError,
        SelectionError,
        WeightLayoutError,
    )
    from .hooks import disable, enable, enabled, is_enabled
    from .hookspecs import hookimpl, hookspec
    from .inplace import apply, revert
    from .manual import patched
    from .patches import Patch
    from .plan import Claim, Lost, Plan, plan_of
    from .state_dicts import original_state_dict


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hfpatch_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
