"""What every command prints through: tables, JSON, usage errors, one-line warnings, quiet loads."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


class UsageError(Exception):
    pass


def transformers_version() -> str:
    # from the distribution's metadata: importing transformers imports torch, and `hfpatch list` must not
    from .._pipeline.selection import installed_transformers_version

    return installed_transformers_version()


def show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A warning as one line, ``hfpatch: warning: ...``: where in hfpatch's code it was raised
    (``sys.exit(main())``, for a pack's) tells a command-line user nothing."""
    from ..errors import PackWarning

    kind = "" if issubclass(category, PackWarning | UserWarning) else f"{category.__name__}: "
    stream = sys.stderr if file is None else file
    with contextlib.suppress(OSError):  # as warnings' own: a warning never stops the command
        stream.write(f"hfpatch: warning: {kind}{message}\n")


@contextlib.contextmanager
def without_progress_bars() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", for every tiny model a command loads)
    off while the command runs: they bury its output on stderr and say nothing of the packs."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """``model_types.transformers_notices_off`` and Python warnings off while ``verify`` loads hundreds of tiny
    models ("falling back to its reference PyTorch implementation", "add `is_decoder=True`"): verdicts'
    noise; what matters of them is in the rows (a load that fails is a failed or no-checkpoint row)."""
    import warnings

    from .._pipeline.model_types import transformers_notices_off

    with transformers_notices_off(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Progress:
    """Progress of a long step on stderr (stdout stays the command's result): a line when it
    starts, one per item at most every ``every`` seconds, and one when it ends with the time taken.

    Used by the steps that import transformers and the packs and plan many model types
    (``hfpatch lock``, ``lock --check``, ``list``'s conflicts) when nothing is cached.
    """

    def __init__(self, what: str, total: int, *, every: float = 2.0, cached: bool = True) -> None:
        import time

        self._clock = time.monotonic
        self.what = what
        self.total = total
        self.every = every
        self.done = 0
        self.started = self._clock()
        self._shown = self.started
        count = f"{total} to do" if total > 1 else ""
        kept = "kept in the cache for the next run" if cached else ""
        said = "; ".join(part for part in (count, kept) if part)
        _progress(f"{what} ({said})..." if said else f"{what}...")

    def step(self, item: str) -> None:
        """One item is about to be computed (``item`` names it)."""
        self.done += 1
        now = self._clock()
        # on a terminal one line is rewritten in place (every item); in a log, a line every ``every`` s
        if _terminal() or now - self._shown >= self.every:
            self._shown = now
            _progress(f"{self.what}: {self.done}/{self.total} ({item})", in_place=True)

    def finish(self) -> None:
        """The step is over."""
        count = f"{self.done} " if self.total > 1 else ""
        _progress(f"{self.what}: done, {count}in {self._clock() - self.started:.1f} s")


def _terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def _progress(line: str, *, in_place: bool = False) -> None:
    with contextlib.suppress(OSError):  # progress never stops the command
        if _terminal():
            # rewritten in place: carriage return, the line, erase what a longer line left
            sys.stderr.write(f"\r\x1b[Khfpatch: {line}" + ("" if in_place else "\n"))
        else:
            sys.stderr.write(f"hfpatch: {line}\n")
        sys.stderr.flush()
