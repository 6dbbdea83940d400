"""The one lock every hfpatch-managed load holds, and blocks whose loads stay vanilla.

transformers' patch registry and the module attributes it patches are process-wide:
a load that has its replacements registered changes what any model built meanwhile
gets.  So every load hfpatch manages (and every application of the registry) holds
``LOAD_LOCK``; ``vanilla()`` blocks, which build models hfpatch must leave alone (the
reference side of an equivalence check, the layout a save is compared with), hold it
too, so that they never see another thread's replacements.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Serialises every hfpatch-managed load and every application of the registry.
#: Re-entrant, so that a sub-model built inside a load (a composite model's text
#: model) can load on the same thread.
LOAD_LOCK = threading.RLock()

_vanilla = threading.local()


@contextmanager
def vanilla() -> Iterator[None]:
    """Build vanilla models inside the block: loads on this thread skip hfpatch, and none runs meanwhile."""
    previous = getattr(_vanilla, "active", False)
    with LOAD_LOCK:
        _vanilla.active = True
        try:
            yield
        finally:
            _vanilla.active = previous


def in_vanilla_block() -> bool:
    """Whether this thread is inside ``vanilla()``."""
    return bool(getattr(_vanilla, "active", False))
