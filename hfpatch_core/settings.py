"""Every name a user sets or a pack author declares, in one place.

The entry-point group says where packs are found; the environment variables say which
of them run and how failures are treated.  Nothing else in hfpatch reads the environment.
"""

from __future__ import annotations

import os

#: Entry-point group under which a distribution declares its packs.
ENTRY_POINT_GROUP = "hfpatch.packs"

#: Which packs run: unset (all), ``none``, ``a,b``, ``-a``, ``all,-a``, ``a@+10`` ...
#: See ``hfpatch_core._pipeline.selection.parse_selection`` for the grammar.
PACKS_ENV = "HF_PATCH_PACKS"

#: ``1``/``true``/``yes``/``on`` turns every pack failure into an error raised before
#: anything is registered.
STRICT_ENV = "HF_PATCH_STRICT"

#: ``debug``, ``info``, ``warning`` or ``error``: the level of the ``hfpatch`` logger, with a
#: stderr handler when the program configured none, so that ``info`` logs each patched
#: load's plan (which packs replaced what).  Unset: logging is left to the program, and the
#: first load in a process that packs change prints its plan's summary to stderr, once (as
#: pytest names its plugins); set to any level (``warning`` says nothing more), no such line.
LOG_ENV = "HF_PATCH_LOG"

#: ``0``/``false``/``no``/``off`` makes an unset ``HF_PATCH_PACKS`` mean no pack (as pytest's
#: ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``): in production, only the packs named run.  Unset: ``1``.
AUTOLOAD_ENV = "HF_PATCH_AUTOLOAD"

#: A lock file written by ``hfpatch lock``: every load checks its packs and plan against it
#: before any weight is read (``LockError``); an unset ``HF_PATCH_PACKS`` then means the lock's
#: selection (the lock is the explicit choice).
LOCK_ENV = "HF_PATCH_LOCK"

#: The file ``hfpatch lock`` writes by default.
LOCK_FILE = "hfpatch.lock"

#: Where the ``hfpatch`` command keeps what it computes slowly and what only the installed
#: versions decide (``hfpatch list``'s conflicts, the plans ``hfpatch lock --check`` compares,
#: the model type names): a directory; ``off`` (or ``0``, ``none``) keeps nothing.  Unset or
#: empty: ``$XDG_CACHE_HOME/hfpatch``, else ``~/.cache/hfpatch``.
CACHE_ENV = "HF_PATCH_CACHE"

#: Set by ``hfpatch run``; makes every Python process that inherits it enable hfpatch
#: when transformers' modeling code is first imported.
AUTORUN_ENV = "HFPATCH_AUTORUN"

#: The module of the start-up hook (``_hfpatch_autorun.py``, imported by the ``hfpatch_autorun.pth``
#: that hfpatch-core installs in site-packages when one of ``HF_PATCH_PACKS`` (set, not ``none``),
#: ``HF_PATCH_LOCK`` or ``HFPATCH_AUTORUN`` is set): hfpatch enables itself at the first load.
AUTORUN_MODULE = "_hfpatch_autorun"

#: The ``source`` of a selection made while ``HF_PATCH_PACKS`` is unset.
UNSET = "<unset>"

# logging's numeric levels, without importing logging on hfpatch run's start-up path
_LOG_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def packs_from_env() -> str | None:
    """The raw ``HF_PATCH_PACKS`` value, or ``None`` when it is unset."""
    return os.environ.get(PACKS_ENV)


def _boolean(name: str, *, default: bool, meaning: str) -> bool:
    raw = os.environ.get(name)
    value = (raw or "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use one of {sorted(_TRUE)} {meaning}, or unset it.")


def strict_from_env() -> bool:
    """Whether ``HF_PATCH_STRICT`` asks for strict mode.

    Raises:
        ValueError: the variable holds something that is neither true nor false.
    """
    return _boolean(STRICT_ENV, default=False, meaning="to turn strict mode on")


#: The attribute a load in strict mode (``enable(strict=True)`` or ``HF_PATCH_STRICT=1`` then) sets,
#: ``True``, on the model it returns; ``strict_for`` reads it.
STRICT_MODEL_ATTRIBUTE = "_hfpatch_strict"


def strict_for(model: object) -> bool:
    """Whether strict mode holds for what ``model`` does after its load (its save, its calibration):
    its load ran in strict mode, or ``HF_PATCH_STRICT`` asks for it now.

    Raises:
        ValueError: ``HF_PATCH_STRICT`` holds something that is neither true nor false.
    """
    return getattr(model, STRICT_MODEL_ATTRIBUTE, False) is True or strict_from_env()


def autoload_from_env() -> bool:
    """Whether an unset ``HF_PATCH_PACKS`` means every installed pack (``HF_PATCH_AUTOLOAD``, default on).

    Raises:
        ValueError: the variable holds something that is neither true nor false.
    """
    return _boolean(AUTOLOAD_ENV, default=True, meaning="(or 0 to run only the packs HF_PATCH_PACKS names)")


def lock_from_env() -> str | None:
    """The lock file ``HF_PATCH_LOCK`` names, or ``None`` when it is unset or empty."""
    return os.environ.get(LOCK_ENV, "").strip() or None


def log_level_from_env() -> int | None:
    """The logging level ``HF_PATCH_LOG`` asks for, or ``None`` when it is unset or empty.

    Raises:
        ValueError: the variable holds something that is not a level name.
    """
    raw = os.environ.get(LOG_ENV, "").strip().lower()
    if not raw:
        return None
    if raw in _LOG_LEVELS:
        return _LOG_LEVELS[raw]
    raise ValueError(
        f"{LOG_ENV}={os.environ[LOG_ENV]!r} is not a log level; use one of {', '.join(_LOG_LEVELS)} "
        "(info logs which packs each load applied), or unset it."
    )


def cache_dir_from_env() -> str | None:
    """The directory ``HF_PATCH_CACHE`` names (default ``$XDG_CACHE_HOME/hfpatch``, else
    ``~/.cache/hfpatch``), or ``None`` when it turns the cache off (``off``, ``0``, ``none``...)."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    if raw.lower() in _FALSE - {""} or raw.lower() == "none":
        return None
    if raw:
        return os.path.expanduser(raw)
    # the XDG base directory spec: a relative XDG_CACHE_HOME is invalid and ignored
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hfpatch")
