"""Enable hfpatch in a process whose environment selects packs, or that ``hfpatch run`` started.

Imported at interpreter start-up by ``hfpatch_autorun.pth`` only when ``HF_PATCH_PACKS`` selects
something (set, and neither empty nor ``none``), ``HF_PATCH_LOCK`` names a lock, or
``HFPATCH_AUTORUN`` is set (``hfpatch run``); it imports nothing heavy itself.  A program
that never imports transformers' modeling code never pays for torch or transformers.

Once ``transformers.modeling_utils`` has been imported, ``PreTrainedModel.from_pretrained``
and ``PreTrainedModel._from_config`` (which every Auto class and ``from_config`` end in) are
replaced by stand-ins that call ``hfpatch_core.enable()`` on the first load and then load.
hfpatch is not enabled inside the import itself: that import may be hfpatch_core's own
(``import hfpatch_core`` first, then transformers), whose modules are then half-initialised,
and an error in the selection would surface as transformers' "Could not import module
'PreTrainedModel'" instead of the selection's own message, at the first load.
``hfpatch_core``'s ``enable``, ``enabled``, ``disable`` and ``is_enabled`` settle a pending
enable first (``settle``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_TARGET = "transformers.modeling_utils"
#: the loaders that get a stand-in until hfpatch is enabled
_LOADERS = ("from_pretrained", "_from_config")
#: name -> (transformers' loader, its stand-in) while the stand-ins are in place; empty once settled
_replaced: dict[str, tuple[Any, Any]] = {}
#: held while settling, so a second thread's first load waits for the first's enable; reentrant,
#: as enable() itself settles
_settling = threading.RLock()


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
            _stand_in(module)

        loader.exec_module = exec_module
        return spec


def _stand_in(modeling_utils: ModuleType) -> None:
    """Put the stand-ins in front of transformers' loaders."""
    model_class = modeling_utils.PreTrainedModel
    with _settling:
        for name in _LOADERS:
            original = model_class.__dict__[name]
            stand_in = classmethod(_enabling(name))
            _replaced[name] = (original, stand_in)
            setattr(model_class, name, stand_in)


def _enabling(name: str) -> Any:
    def load(cls: type, *args: Any, **kwargs: Any) -> Any:
        settle(enable=True)
        return getattr(cls, name)(*args, **kwargs)

    load.__name__ = name
    load.__doc__ = "hfpatch enables itself on the first load, then this is transformers' own loader."
    return load


def original_of(name: str, value: Any) -> Any:
    """Transformers' loader ``name`` if ``value`` is its stand-in, else ``value``.

    ``hfpatch_core.enable()`` wraps what it finds on ``PreTrainedModel``: a stand-in is replaced
    by the wrapper of the loader it stands in for, in one assignment, so that no other thread's
    load ever finds transformers' own loader between the two.
    """
    original, stand_in = _replaced.get(name, (None, None))
    return original if stand_in is not None and value is stand_in else value


def settle(*, enable: bool) -> None:
    """Finish what start-up began: enable hfpatch now if that is still pending (``enable``),
    or drop the pending enable (the program chose for itself: ``enable()`` with its own
    choice, ``disable()``, or the ``hfpatch`` command).  A no-op once settled; with
    ``enable`` before transformers' modeling code is imported, it stays pending."""
    if not pending():
        return
    with _settling:
        if not enable:
            sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _EnableAfterImport)]
        elif _replaced:
            import hfpatch_core

            hfpatch_core.enable()  # its hook takes the stand-ins' places (original_of)
        model_class = sys.modules[_TARGET].PreTrainedModel if _replaced else None
        for name, (original, stand_in) in _replaced.items():
            if model_class.__dict__.get(name) is stand_in:
                setattr(model_class, name, original)
        _replaced.clear()


def pending() -> bool:
    """Whether hfpatch will enable itself (at transformers' import or its first load)."""
    return bool(_replaced) or any(isinstance(finder, _EnableAfterImport) for finder in sys.meta_path)


def _wanted() -> bool:
    """What the ``.pth`` line approximates: ``hfpatch run``, a lock, or a selection of at least one item
    that is not ``none`` (``HF_PATCH_PACKS=","`` selects nothing, as ``enable()`` reads it)."""
    environ = os.environ
    items = [item.strip() for item in environ.get("HF_PATCH_PACKS", "").split(",") if item.strip()]
    launched_or_locked = bool(environ.get("HFPATCH_AUTORUN") or environ.get("HF_PATCH_LOCK", "").strip())
    return launched_or_locked or items not in ([], ["none"])


def install() -> None:
    """Enable hfpatch on the first load once transformers' modeling code is imported."""
    if not _wanted():
        return
    modeling_utils = sys.modules.get(_TARGET)
    if modeling_utils is not None:
        if not _replaced:
            _stand_in(modeling_utils)
    elif not any(isinstance(finder, _EnableAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EnableAfterImport())


install()
