"""``hfpatch run``: start a program with hfpatch enabled in it and in its children.

``hfpatch run -- CMD`` is on the start-up path of every training job, so it imports
nothing beyond what Python has already loaded at start: it checks what can be checked
cheaply, sets ``HFPATCH_AUTORUN`` and replaces itself with ``CMD`` (the start-up hook
then enables hfpatch in ``CMD`` and every process it starts).  The console script
(``hfpatch_core.console``) comes here for ``run`` without importing ``hfpatch_core.cli``.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import NoReturn

_HOOK_MODULE = "_hfpatch_autorun.py"


class LaunchError(Exception):
    """``hfpatch run`` cannot start the command; the message says why and what to do."""


def launch(command: Sequence[str]) -> NoReturn:
    """Replace this process with ``command``, hfpatch enabled in it and its children.

    Fails here, once, rather than in every child: on a malformed ``HF_PATCH_PACKS`` or
    ``HF_PATCH_STRICT``, on a pack name that is not installed (package metadata is read
    only when the choice names a pack: it costs tens of milliseconds), on a missing
    start-up hook or command.

    Raises:
        LaunchError: the command cannot be started; nothing was run.
    """
    from .errors import HfPatchError
    from .settings import AUTORUN_ENV, PACKS_ENV, strict_from_env

    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise LaunchError("hfpatch run needs a command: hfpatch run -- python train.py")
    if not any(os.path.isfile(os.path.join(entry or ".", _HOOK_MODULE)) for entry in sys.path):
        raise LaunchError("hfpatch's start-up hook is not installed; reinstall hfpatch-core with pip")
    choice = os.environ.get(PACKS_ENV)
    try:
        if choice is not None:
            from .selection import current_selection, parse_selection

            if parse_selection(choice).named:
                current_selection()
        strict_from_env()
    except (HfPatchError, ValueError) as exc:  # a bad choice, a pack installed twice, a bad HF_PATCH_STRICT
        raise LaunchError(str(exc)) from None
    executable = _which(command[0])
    if executable is None:
        raise LaunchError(f"command not found: {command[0]}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, command, {**os.environ, AUTORUN_ENV: "1"})


def _which(name: str) -> str | None:
    # shutil.which, without importing shutil (and what it imports) on the start-up path
    if os.path.dirname(name):
        return name if os.access(name, os.X_OK) and not os.path.isdir(name) else None
    for directory in os.get_exec_path():
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None
