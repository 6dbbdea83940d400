"""``hfpatch run``: start a program with hfpatch enabled in it and in its children.

``hfpatch run -- CMD`` is on the start-up path of every training job, so it imports
nothing beyond what Python has already loaded at start: it checks what can be checked
cheaply, sets ``HFPATCH_AUTORUN`` and replaces itself with ``CMD`` (the start-up hook
then enables hfpatch in ``CMD`` and every process it starts).  The console script
(``hfpatch_core.cli.console``) comes here for ``run`` without importing ``hfpatch_core.cli.parser``.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import NoReturn

#: Commands that mean this environment's interpreter, not the first one on ``PATH``: a
#: Python of another environment would not have hfpatch's start-up hook.
PYTHON_NAMES = frozenset({"python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"})


class LaunchError(Exception):
    """``hfpatch run`` cannot start the command; the message says why and what to do."""


def launch(command: Sequence[str]) -> NoReturn:
    """Replace this process with ``command``, hfpatch enabled in it and its children.

    ``python`` / ``python3`` as the command is this environment's interpreter
    (``sys.executable``), not the first Python on ``PATH``; in a virtual environment, the
    command's ``PATH`` starts with the environment's scripts directory (as if it were
    activated), so ``hfpatch`` and ``python`` in the program and its children are this
    environment's too.

    Fails here, once, rather than in every child: on a malformed ``HF_PATCH_PACKS``,
    ``HF_PATCH_STRICT``, ``HF_PATCH_AUTOLOAD`` or ``HF_PATCH_LOG``, on a missing
    ``HF_PATCH_LOCK`` file, on a pack name that is not installed (package metadata is
    read only when the choice names a pack: it costs tens of milliseconds), on a missing
    start-up hook or command.

    Raises:
        LaunchError: the command cannot be started; nothing was run.
    """
    from ..errors import HfPatchError
    from ..settings import (
        AUTORUN_ENV,
        AUTORUN_MODULE,
        LOCK_ENV,
        PACKS_ENV,
        autoload_from_env,
        lock_from_env,
        log_level_from_env,
        strict_from_env,
    )

    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise LaunchError("hfpatch run needs a command: hfpatch run -- python train.py")
    if not any(os.path.isfile(os.path.join(entry or ".", f"{AUTORUN_MODULE}.py")) for entry in sys.path):
        raise LaunchError("hfpatch's start-up hook is not installed; reinstall hfpatch-core with pip")
    choice = os.environ.get(PACKS_ENV)
    try:
        if choice is not None:
            from .._pipeline.selection import current_selection, parse_selection

            if parse_selection(choice).named:
                current_selection()
        strict_from_env()
        autoload_from_env()
        log_level_from_env()
        lock = lock_from_env()
        if lock is not None and not os.path.isfile(lock):
            raise LaunchError(f"{LOCK_ENV}={lock!r} names no file; write it with `hfpatch lock -o {lock}`, or unset it")
    except (HfPatchError, ValueError) as exc:  # a bad choice, a pack installed twice, a bad variable
        raise LaunchError(str(exc)) from None
    environment = {**os.environ, AUTORUN_ENV: "1"}
    scripts = os.path.dirname(sys.executable)
    path = environment.get("PATH", os.defpath)
    if sys.prefix != sys.base_prefix and scripts and path.split(os.pathsep)[0] != scripts:
        # as in an activated virtual environment: python, hfpatch and the environment's
        # other commands, in the program and in every process it starts, are this one's
        environment["PATH"] = scripts + os.pathsep + path
    if command[0] in PYTHON_NAMES and sys.executable:
        executable: str | None = sys.executable
        command[0] = sys.executable  # the child's sys.executable, found from argv[0]
    else:
        executable = _which(command[0], environment.get("PATH"))
    if executable is None:
        raise LaunchError(f"command not found: {command[0]}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, command, environment)


def _which(name: str, path: str | None) -> str | None:
    # shutil.which, without importing shutil (and what it imports) on the start-up path
    if os.path.dirname(name):
        return name if os.access(name, os.X_OK) and not os.path.isdir(name) else None
    for directory in os.get_exec_path(None if path is None else {"PATH": path}):
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None
