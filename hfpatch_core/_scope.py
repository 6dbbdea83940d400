"""The one lock every hfpatch-managed load holds, and blocks whose loads stay vanilla.

transformers' patch registry and the module attributes it patches are process-wide:
a load that has its replacements registered changes what any model built meanwhile
gets.  So every load hfpatch manages (and every application of the registry) holds
``LOAD_LOCK``; ``vanilla()`` blocks, which build models hfpatch must leave alone (the
reference side of an equivalence check, the layout a save is compared with), hold it
too, so that they never see another thread's replacements.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Serialises every hfpatch-managed load, every application of the registry and every
#: call of a pack's hook (``snapshot.HOOK_GUARD`` holds it for gathering).  Re-entrant, so
#: that a sub-model built inside a load (a composite model's text model) can load on the
#: same thread.
LOAD_LOCK = threading.RLock()

#: Inside ``vanilla()`` on this thread or asyncio task.
_vanilla: contextvars.ContextVar[bool] = contextvars.ContextVar("hfpatch_vanilla", default=False)


@contextmanager
def vanilla() -> Iterator[None]:
    """Build vanilla models inside the block: loads here skip hfpatch, and no other thread's load
    (patched or not) runs meanwhile."""
    with LOAD_LOCK:
        token = _vanilla.set(True)
        try:
            yield
        finally:
            _vanilla.reset(token)


def in_vanilla_block() -> bool:
    """Whether this thread or asyncio task is inside ``vanilla()``."""
    return _vanilla.get()
