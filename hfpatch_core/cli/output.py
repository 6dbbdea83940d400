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
    """transformers' load reports and fallback notices ("falling back to its reference PyTorch
    implementation", "add `is_decoder=True`") and Python warnings off while ``verify`` loads
    hundreds of tiny models: they interleave with its progress lines and are verdicts' noise;
    what matters of them is in the rows (a load that fails is a failed or no-checkpoint row)."""
    import warnings

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
