"""The ``hfpatch`` command's exit codes, in a module of their own: every command module imports
them, and the package ``__init__`` (which dispatches to ``parser`` lazily) must not be imported back.

0 success; 1 a check found problems; 2 bad input (arguments, ``HF_PATCH_PACKS``, an unknown
model, a lock file that cannot be read); ``run`` exits with the program's own code.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
#: The reader of the output went away (``hfpatch list | head``): a shell's status for SIGPIPE.
EXIT_BROKEN_PIPE = 141
