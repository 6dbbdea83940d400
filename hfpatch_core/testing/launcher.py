"""One ``torchrun`` of 2 CPU ranks on this machine, each rank writing its results as JSON: how
``distributed`` (sharded loads) and ``deepspeed`` (ZeRO-3 training) run their ranks.

The caller's side: ``torchrun(module, arguments, environment=..., timeout=...)`` runs
``python -m torch.distributed.run --standalone --nproc_per_node 2 -m MODULE ARGUMENTS... OUT`` and
returns what each rank wrote, in rank order, or raises ``TorchrunFailed``; ``rank_environment``
is the ranks' environment.  The rank's side (``MODULE``'s ``main``): ``start_rank()`` before the
work, ``write_rank(out, results)`` after it, and ``run_rank(main)`` as the module's ``__main__``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

#: The ranks of every torchrun: two processes on this machine (gloo, CPU).
RANKS = 2


class TorchrunFailed(RuntimeError):
    """The torchrun timed out, exited with an error, or a rank wrote no results.

    Attributes:
        timeout: the seconds it was given, where it ran past them (``None`` otherwise).
        returncode: torchrun's exit status (``None`` where it timed out).
        stdout: what it printed.
        stderr: what it printed on standard error.
    """

    def __init__(self, timeout: float | None, returncode: int | None, stdout: str, stderr: str) -> None:
        ended = f"timed out after {timeout:g} s" if timeout is not None else f"exited {returncode}"
        super().__init__(f"torchrun {ended}: {(stderr or stdout)[-2000:]}")
        self.timeout = timeout
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def rank_environment(extra_path: Sequence[str | os.PathLike[str]] = ()) -> dict[str, str]:
    """This process's environment, for the ranks: this interpreter's ``sys.path`` (after ``extra_path``)
    on ``PYTHONPATH``, so that they import what this process imports, and one intra-op thread unless
    ``OMP_NUM_THREADS`` says otherwise (two ranks share the machine)."""
    path = [str(entry) for entry in extra_path] + [entry for entry in sys.path if entry]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def torchrun(
    module: str,
    arguments: Sequence[str] = (),
    *,
    environment: Mapping[str, str],
    timeout: float,
    inputs: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``module``'s ``main`` on ``RANKS`` ranks and return what each wrote with ``write_rank``.

    Args:
        module: the module the ranks run (``python -m``).
        arguments: its arguments; the output directory ``OUT`` follows them.
        environment: the ranks' environment (``rank_environment``).
        timeout: seconds before the torchrun is stopped.
        inputs: file name -> text, written into ``OUT`` before the start, for the ranks to read.

    Returns:
        Each rank's results, in rank order.

    Raises:
        TorchrunFailed: it timed out, exited with an error, or a rank wrote nothing.
    """
    with tempfile.TemporaryDirectory(prefix="hfpatch-torchrun-") as out:
        for name, text in (inputs or {}).items():
            (Path(out) / name).write_text(text)
        command = [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS)),
            *("-m", module, *arguments, out),
        ]
        try:
            done = subprocess.run(command, env=dict(environment), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            # (on a timeout, what was captured comes undecoded)
            raise TorchrunFailed(timeout, None, _text(exc.stdout), _text(exc.stderr)) from exc
        ranks = [_results(out, rank) for rank in range(RANKS)]
        if done.returncode != 0 or not all(path.exists() for path in ranks):
            raise TorchrunFailed(None, done.returncode, done.stdout, done.stderr)
        return [json.loads(path.read_text()) for path in ranks]


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def _results(out: str | os.PathLike[str], rank: int) -> Path:
    return Path(out) / f"rank{rank}.json"


def start_rank() -> None:
    """Before a rank's work: transformers' logging at errors only, without progress bars, and
    hfpatch's announcement silenced (the check reports what the pack did)."""
    import transformers

    from .._session.announcement import silence

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    silence()


def write_rank(out: str | os.PathLike[str], results: Any) -> None:
    """This rank's results (JSON values), for ``torchrun`` to return: after ``init_process_group``."""
    import torch.distributed as dist

    _results(out, dist.get_rank()).write_text(json.dumps(results))


def run_rank(main: Callable[[], None]) -> NoReturn:
    """A rank module's ``__main__``: ``main()``, then out without the interpreter's finalization.

    Each rank's results are written by then.  At finalization, gloo's worker threads can still hold
    collectives' tensors that then need the GIL of a dying interpreter, and the rank aborts after
    its work is done (SIGABRT, "terminate called without an active exception"; seen in CI after DDP
    and FSDP2 runs, pytorch/pytorch#179291).
    """
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
