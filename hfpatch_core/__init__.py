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

#: Every public name -> the module that defines it: the one table ``__all__``, the lazy
#: ``__getattr__`` and (kept equal by tests/test_layers.py) the TYPE_CHECKING imports read.
_EXPORTS = {
    # values a pack builds or a user reads
    "Patch": "patches",
    "Refusal": "patches",
    "ModelStep": "patches",
    "Converter": "conversion",
    "LoadContext": "context",
    "Claim": "plan",
    "Lost": "plan",
    "Refused": "plan",
    "StepClaim": "plan",
    "Foreign": "plan",
    "Plan": "plan",
    "plan_of": "plan",
    "hookimpl": "hookspecs",
    "SizedConcatenate": "authoring.sized",
    "SizedSplit": "authoring.sized",
    # errors, by how a caller reacts (errors.py)
    "HfPatchError": "errors",
    "ConfigurationError": "errors",
    "SelectionError": "errors",
    "DuplicatePackError": "errors",
    "LockError": "errors",
    "ConflictError": "errors",
    "PatchConflictError": "errors",
    "ConverterConflictError": "errors",
    "ForeignPatchError": "errors",
    "PackError": "errors",
    "ModelError": "errors",
    "WeightLayoutError": "errors",
    "ApplyError": "errors",
    "AdapterError": "errors",
    "InvalidPatchError": "errors",
    "PackWarning": "errors",
    # discovering packs
    "PackInfo": "_pipeline.discovery",
    "discover": "_pipeline.discovery",
    # turning hfpatch on for loads, and patching models
    "enable": "_session.loaders",
    "enabled": "_session.loaders",
    "disable": "_session.loaders",
    "is_enabled": "_session.loaders",
    "patched": "_session.manual",
    "apply": "_session.inplace",
    "revert": "_session.inplace",
    "original_state_dict": "_runtime.state_dicts",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from ._pipeline.discovery import PackInfo, discover
    from ._runtime.state_dicts import original_state_dict
    from ._session.inplace import apply, revert
    from ._session.loaders import disable, enable, enabled, is_enabled
    from ._session.manual import patched
    from .authoring.sized import SizedConcatenate, SizedSplit
    from .context import LoadContext
    from .conversion import Converter
    from .errors import (
        AdapterError,
        ApplyError,
        ConfigurationError,
        ConflictError,
        ConverterConflictError,
        DuplicatePackError,
        ForeignPatchError,
        HfPatchError,
        InvalidPatchError,
        LockError,
        ModelError,
        PackError,
        PackWarning,
        PatchConflictError,
        SelectionError,
        WeightLayoutError,
    )
    from .hookspecs import hookimpl
    from .patches import ModelStep, Patch, Refusal
    from .plan import Claim, Foreign, Lost, Plan, Refused, StepClaim, plan_of


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hfpatch_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
