"""The ``hfpatch`` console script.

``hfpatch run`` goes straight to ``hfpatch_core.cli.launch``, which imports almost nothing
(it is on the start-up path of every job); every other command goes to
``hfpatch_core.cli.parser``.
"""

from __future__ import annotations

import sys

from .exit_codes import EXIT_USAGE

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The ``hfpatch`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["run"] and not {"-h", "--help"} & set(args[1:2]):
        from .launch import LaunchError, launch

        try:
            launch(args[1:])
        except LaunchError as exc:
            print(f"hfpatch: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    from .parser import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
