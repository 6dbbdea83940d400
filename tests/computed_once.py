"""A module fixture's result computed by one pytest-xdist worker and read by the others.

Under ``-n 2`` the tests of one module are shared out between the workers, and each worker
that runs one of them builds the module's fixtures itself: a fixture that runs a torchrun of
every case (20-30 s on both cores) ran twice.  xdist's ``--dist loadgroup``, which would keep
such a module on one worker, groups nothing under pytest 9 (xdist 3.8 renames the tests by
setting a node id attribute pytest no longer reads), so the worker that comes second waits for
the first one's result instead of computing it again.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def computed_once(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], T]) -> T:
    """``compute()``, run by the first worker of this pytest run that asks for ``name``; the
    others wait for it and get its result (pickled in the folder the run's workers share).

    Without xdist it is ``compute()``.  A failed ``compute()`` keeps nothing: the next worker
    computes it again and fails, as each would have.  The result must pickle, and its paths
    are the first worker's (which the run keeps until it ends).
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    # under xdist each worker's base temporary folder is <run>/popen-gwN: <run> is shared
    folder = tmp_path_factory.getbasetemp().parent / "computed-once"
    folder.mkdir(exist_ok=True)
    result = folder / f"{name}.pickle"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return pickle.loads(result.read_bytes())
        value = compute()
        result.write_bytes(pickle.dumps(value))
        return value
