"""The ``hfpatch`` command, one module per command.

``console`` is the console script (``hfpatch run`` goes straight to ``launch``, which imports
almost nothing); ``parser`` parses and dispatches the others: ``listing`` (list),
``explain``, ``check`` (with ``drift``, the drift record), ``lock``, ``verify``, ``demo``, ``scaffold``
(new).  Each computes a value and then shows it through ``output``.

Exit codes: 0 success; 1 a check found problems; 2 bad input (arguments,
``HF_PATCH_PACKS``, an unknown model); ``run`` exits with the program's own code.
Importing this package imports nothing else: ``hfpatch run`` starts every job.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
#: The reader of the output went away (``hfpatch list | head``): a shell's status for SIGPIPE.
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hfpatch`` command with ``argv`` (default: ``sys.argv[1:]``); its exit status."""
    from .parser import main as parse_and_run

    return parse_and_run(argv)
