"""The one line a process prints when packs first apply, as pytest prints its plugins.

Without it nothing says that a model is not vanilla transformers' unless the program asked
(``HF_PATCH_LOG=info`` logs every load's plan).  So the first load in a process whose packs
replaced, converted or installed anything prints its plan's summary to stderr (stdout stays
the program's), and no later load does.  ``HF_PATCH_LOG`` set (to any level) stands in for
it: ``info`` logs every load, ``warning`` and ``error`` say nothing more; a program whose own
logging shows the ``hfpatch`` logger's ``info`` gets the line there instead.  The ``hfpatch``
command and its workers, and pytest (the plugin), say it themselves or not at all:
``silence()``.  Imports nothing heavy: the pytest plugin calls ``silence`` at start-up.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..settings import log_level_from_env

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..plan import Plan

_lock = threading.Lock()
_said = False


def silence() -> None:
    """No line in this process (the ``hfpatch`` command's workers report what applied
    themselves; under pytest, a test that reads stderr would get it in whichever test loads first)."""
    global _said
    _said = True


@contextmanager
def silenced() -> Iterator[None]:
    """No line from the loads of the block (an ``hfpatch`` command run in the program's own
    process, which reports what applied itself); a load after it may still say it."""
    global _said
    with _lock:
        before, _said = _said, True
    try:
        yield
    finally:
        with _lock:
            _said = before


def applied(plan: Plan) -> bool:
    """Whether a load with ``plan`` changed the model: a pack replaced a class, converts weights
    or installed a model step, in the model or a sub-model built inside it."""
    return plan.touches_weights or any(inner.installed_steps for inner in plan.all_plans())


def announce(plan: Plan) -> None:
    """Print ``plan``'s summary to stderr if it is the first load in this process that packs
    changed and nothing else says it (see the module)."""
    global _said
    if _said or not applied(plan):
        return
    with _lock:
        if _said:
            return
        _said = True
    try:
        chosen = log_level_from_env() is not None
    except ValueError:  # enable() said so already
        chosen = True
    if chosen or logging.getLogger("hfpatch").isEnabledFor(logging.INFO):
        return
    with contextlib.suppress(OSError, ValueError):  # a closed or broken stderr: the line is a courtesy
        print(plan.summary(), file=sys.stderr, flush=True)
