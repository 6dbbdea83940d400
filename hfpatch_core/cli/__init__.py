"""The ``hfpatch`` command, one module per command.

``console`` is the console script (``hfpatch run`` goes straight to ``launch``, which imports
almost nothing); ``parser`` parses and dispatches the others: ``listing`` (list),
``explain``, ``check`` (with ``drift``, the drift record), ``lock``, ``verify``, ``demo``, ``scaffold``
(new).  Each computes a value and then shows it through ``output``.

The exit codes live in ``exit_codes`` (a command module importing them from this package
would import it back while it dispatches).  Importing this package imports nothing else:
``hfpatch run`` starts every job.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hfpatch`` command with ``argv`` (default: ``sys.argv[1:]``); its exit status."""
    from .parser import main as parse_and_run

    return parse_and_run(argv)
