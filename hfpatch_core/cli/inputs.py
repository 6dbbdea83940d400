"""The ``hfpatch`` commands' input, checked before a command imports torch, transformers or a pack.

A misspelt pack or model type, a ``--model`` directory that is not there or an
``HF_PATCH_LOCK`` naming no file is reported in a moment, not after the tens of seconds
those imports take.  Pack names come from the distributions' metadata; model type names
from the cache (``cache.model_types``: transformers is imported once per installed version).
``verify`` may call ``check_input`` on its own arguments too (it reads ``packs``,
``model_type``, ``model`` and ``command_name`` from the namespace).
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Iterable, Sequence

from ..settings import LOCK_ENV, lock_from_env
from .output import UsageError

#: The commands whose packs come from ``HF_PATCH_PACKS`` (or a lock's selection), checked here.
_SELECTING = frozenset({"list", "explain", "lock", "demo"})


def given_as_path(text: str) -> bool:
    """Whether ``text`` is written as a path (``./llama``, ``models/llama``): only then is a model
    type's name read as a directory (``model_types.load_config``'s rule, without importing it)."""
    return os.sep in text or "/" in text or text.startswith(".")


def _close(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


def unknown_model_type(model_type: str, known: Iterable[str]) -> str | None:
    """Why ``model_type`` is not one of ``known`` (the installed transformers' model types), with
    the closest names, worded as ``model_types.unknown_model_type``; ``None`` when it is one."""
    from .._pipeline.selection import installed_transformers_version

    names = list(known)
    if model_type in names:
        return None
    version = installed_transformers_version()
    return f"{model_type!r} is not a model type of transformers {version}{_close(model_type, names)}"


def _lock_file(args: argparse.Namespace) -> None:
    lock = lock_from_env()
    if lock is None or os.path.isfile(lock):
        return
    writing = args.command_name == "lock" and args.check is None
    if writing and os.path.abspath(args.output) == os.path.abspath(lock):
        return  # `hfpatch lock` writing the lock HF_PATCH_LOCK names
    raise UsageError(f"{LOCK_ENV}={lock!r} names no file; write it with `hfpatch lock -o {lock}`, or unset it")


def _selection(args: argparse.Namespace) -> None:
    from .._pipeline.selection import current_selection, parse_selection

    command = args.command_name
    packs = getattr(args, "packs", None)
    if command in {"check", "verify"} and packs:
        current_selection(packs, origin=f"hfpatch {command}")
    elif command == "demo" and packs:
        if parse_selection(packs, origin="hfpatch demo --packs").named:
            current_selection(packs, origin="hfpatch demo --packs")
    elif command in _SELECTING | {"check", "verify"}:
        current_selection()  # HF_PATCH_PACKS: a name not installed or a malformed value


def _directory(flag: str, path: str, *, otherwise: str = "") -> None:
    from .demo import checkpoint_problem  # demo's own check, so that every command words it alike

    problem = checkpoint_problem(path)
    if problem is not None:
        raise UsageError(problem.replace("--model", flag, 1) + otherwise)


def check_model_types(model_types: Sequence[str] | None) -> None:
    """Each ``--model-type`` is a model type of the installed transformers (imported to tell).

    Raises:
        UsageError: one is not, with the closest names.
    """
    from .._pipeline.model_types import unknown_model_type

    for model_type in model_types or ():
        unknown = unknown_model_type(model_type)
        if unknown is not None:
            raise UsageError(f"--model-type {unknown}")


def check_input(args: argparse.Namespace) -> None:
    """Check ``args`` of any command, and the environment it reads, before the command runs.

    Raises:
        UsageError: ``HF_PATCH_LOCK`` names no file, a ``--model`` directory is missing, or a
            model type is unknown.
        SelectionError: a pack named (``HF_PATCH_PACKS`` or the command's ``PACK`` arguments)
            is not installed, or the choice is malformed.
    """
    _lock_file(args)
    command = args.command_name
    if command == "run":
        return
    if command != "new":
        _selection(args)
    models = getattr(args, "model", None)
    if command == "explain":
        models = None
        if given_as_path(args.model):
            _directory("explain", args.model)
        else:
            from .._pipeline.selection import installed_transformers_version
            from .cache import model_types as known_types

            names = known_types()
            if args.model not in names and os.path.isdir(args.model):  # a model type's name is the type
                _directory("explain", args.model)
            elif args.model not in names:
                # worded as model_types.load_config says it once transformers is imported
                raise UsageError(
                    f"{args.model!r} is neither a checkpoint directory nor a model type known to transformers "
                    f"{installed_transformers_version()}{_close(args.model, names)}"
                )
    if command == "verify" and args.all_model_types:
        models = None  # verify refuses --model with --all-model-types, which says more than a missing directory
    otherwise = " (or --model-type TYPE to verify on a tiny random model of that type)" if command == "verify" else ""
    for model in [models] if isinstance(models, str) else models or ():
        _directory("--model", model, otherwise=otherwise)
    asked = getattr(args, "model_type", None)
    if command != "new" and asked:
        from .cache import model_types as known_types

        names = known_types()
        for model_type in [asked] if isinstance(asked, str) else asked:
            unknown = unknown_model_type(model_type, names)
            if unknown is not None:
                raise UsageError(f"--model-type {unknown}")
