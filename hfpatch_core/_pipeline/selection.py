"""Choosing which installed packs run, before any of them is imported.

The choice is written the same way in ``HF_PATCH_PACKS`` and in ``enable(packs=...)``:

=====================  ===========================================================
``HF_PATCH_PACKS``     meaning
=====================  ===========================================================
unset                  every installed pack; none with ``HF_PATCH_AUTOLOAD=0`` or a lock
``none`` or empty      no pack
``a,b``                only ``a`` and ``b``
``-a`` / ``all,-a``    every pack but ``a``
``a@+10``              ``a`` (only), its claims' priorities raised by 10
``all,a@-5``           every pack, ``a``'s priorities lowered by 5
=====================  ===========================================================

Items are separated by commas; whitespace around them is ignored.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from ..errors import HfPatchError, PackError, SelectionError
from ..settings import PACKS_ENV, UNSET

if TYPE_CHECKING:  # parsing a choice (hfpatch run) must not pay for reading metadata
    from .discovery import Discovery, PackInfo

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_ITEM = re.compile(rf"(?P<minus>-)?(?P<name>{_NAME})(?:@(?P<offset>[+-]?[0-9]{{1,9}}))?", re.ASCII)
_RESERVED = frozenset({"all", "none"})


@dataclasses.dataclass(frozen=True)
class SelectionSpec:
    """A parsed pack choice.

    Attributes:
        mode: ``"all"`` (every pack but ``excluded``), ``"none"`` or ``"only"`` (``included``).
        included: the packs listed by name.
        excluded: the packs listed as ``-name``.
        priority_offsets: ``name@N`` items: added to each claim priority of that pack.
        source: the text as the user wrote it, quoted in messages.
        origin: where the text came from, as messages name it: a variable or parameter
            (``HF_PATCH_PACKS``, quoted as ``HF_PATCH_PACKS='a,b'``) or a command line
            (``hfpatch verify``, quoted as ``hfpatch verify 'a,b'``).
    """

    mode: Literal["all", "none", "only"]
    included: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()
    priority_offsets: Mapping[str, int] = dataclasses.field(default_factory=dict)
    source: str = ""
    origin: str = PACKS_ENV
    #: why an unset ``HF_PATCH_PACKS`` selects no pack (``HF_PATCH_AUTOLOAD=0``, a lock); ``""`` otherwise
    unset_none: str = ""

    @property
    def quoted(self) -> str:
        """The text with where it came from, as messages quote it: ``HF_PATCH_PACKS='a,b'``."""
        glue = "=" if self.origin.isidentifier() else " "
        return f"{self.origin}{glue}{self.source!r}"

    @property
    def text(self) -> str | None:
        """The choice as ``enable(packs=...)`` takes it again; ``None`` when ``HF_PATCH_PACKS`` was unset."""
        return None if self.source == UNSET else self.source

    @property
    def named(self) -> tuple[str, ...]:
        """Every pack name the spec mentions."""
        return tuple(dict.fromkeys([*self.included, *self.excluded, *self.priority_offsets]))


def _error(spec: SelectionSpec, problem: str) -> SelectionError:
    return SelectionError(
        f"{spec.quoted}: {problem}. Write a comma-separated list such as 'a,b', '-a', 'all,-a', 'a@+10' or 'none'."
    )


def _join(spec: object) -> str:
    """The items of ``enable(packs=[...])`` as one text; anything but strings is an error, not a TypeError."""
    items = list(spec) if isinstance(spec, Iterable) and not isinstance(spec, bytes | Mapping) else None
    if items is None or not all(isinstance(item, str) for item in items):
        raise SelectionError(
            f"packs={spec!r} is not a pack choice: pass a string in {PACKS_ENV} syntax ('a,b', '-a', "
            "'all,-a', 'a@+10', 'none'), a list of such items, or None for the variable's value."
        )
    return ",".join(items)


def unset_selection(*, locked: str | None = None) -> SelectionSpec:
    """What an unset ``HF_PATCH_PACKS`` selects: the selection of the lock in force (``locked``,
    the lock's ``selection``: the lock is the explicit choice), else every installed pack, or
    none when ``HF_PATCH_AUTOLOAD`` is off.

    Raises:
        ValueError: ``HF_PATCH_AUTOLOAD`` is not a boolean.
        SelectionError: the lock's selection is malformed.
    """
    from ..settings import AUTOLOAD_ENV, LOCK_ENV, autoload_from_env

    autoload = autoload_from_env()
    if locked is not None:
        return parse_selection(locked, origin=f"the selection of the lock ({LOCK_ENV})")
    if not autoload:
        return SelectionSpec(mode="none", source=UNSET, unset_none=f"{PACKS_ENV} unset and {AUTOLOAD_ENV}=0")
    return SelectionSpec(mode="all", source=UNSET)


def spec_from_env(*, locked: str | None = None) -> SelectionSpec:
    """The choice ``HF_PATCH_PACKS`` makes (``unset_selection`` when it is unset).

    Raises:
        SelectionError: the value is malformed.
        ValueError: ``HF_PATCH_AUTOLOAD`` is not a boolean.
    """
    from ..settings import autoload_from_env, packs_from_env

    autoload_from_env()  # a malformed value is an error whether or not it decides
    raw = packs_from_env()
    return unset_selection(locked=locked) if raw is None else parse_selection(raw)


def parse_selection(spec: str | Iterable[str] | None, *, origin: str = PACKS_ENV) -> SelectionSpec:
    """Parse a pack choice; ``None`` (the variable unset) means every pack (see ``unset_selection``
    for when it means none).

    ``origin`` says where the choice came from (``SelectionSpec.origin``): messages about
    it name that, not ``HF_PATCH_PACKS``, when the user wrote it elsewhere.

    Raises:
        SelectionError: the text does not follow the grammar in this module's docstring, or
            ``spec`` is neither a string nor an iterable of strings.
    """
    if spec is None:
        return SelectionSpec(mode="all", source=UNSET)
    source = spec if isinstance(spec, str) else _join(spec)
    written = SelectionSpec(mode="none", source=source, origin=origin)  # what messages quote
    items = [item.strip() for item in source.split(",") if item.strip()]
    if not items or items == ["none"]:
        return written
    if "none" in items:
        raise _error(written, "'none' cannot be combined with other items")
    everything = "all" in items
    included: list[str] = []
    excluded: list[str] = []
    offsets: dict[str, int] = {}
    for item in items:
        if item == "all":
            continue
        match = _ITEM.fullmatch(item)
        if match is None:
            raise _error(written, f"{item!r} is not a pack name, '-name' or 'name@N'")
        name, offset = match["name"], match["offset"]
        if name in _RESERVED:
            raise _error(written, f"{item!r} uses {name!r}, which is a keyword, not a pack name")
        if match["minus"]:
            if offset is not None:
                raise _error(written, f"{item!r} both disables a pack and sets its priority")
            excluded.append(name)
            continue
        if offset is not None:
            if offsets.get(name, int(offset)) != int(offset):
                raise _error(written, f"pack {name!r} is given two priority offsets")
            offsets[name] = int(offset)
        included.append(name)
    clash = sorted(set(included) & set(excluded))
    if clash:
        raise _error(written, f"{clash[0]!r} is both enabled and disabled")
    if excluded and included and not everything:
        raise _error(
            written,
            f"'-{excluded[0]}' disables a pack while {included[0]!r} lists the only packs to enable; "
            f"start with 'all' to mean every pack but some",
        )
    if everything or excluded:
        return SelectionSpec(
            "all", tuple(dict.fromkeys(included)), tuple(dict.fromkeys(excluded)), offsets, source, origin
        )
    return SelectionSpec("only", tuple(dict.fromkeys(included)), (), offsets, source, origin)


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which discovered packs run in this process, and why the others do not.

    Attributes:
        spec: the parsed choice.
        packs: the packs that run, by name (selected, compatible, unambiguous).
        status: for every installed pack, ``"enabled"`` or why not.
        problems: incompatible or duplicate packs that the choice would have run;
            reported as warnings, or raised in strict mode.
    """

    spec: SelectionSpec
    packs: Mapping[str, PackInfo]
    status: Mapping[str, str]
    problems: tuple[HfPatchError, ...] = ()

    def priority_offset(self, name: str) -> int:
        """The priority offset the choice gives pack ``name`` (0 when none)."""
        return self.spec.priority_offsets.get(name, 0)


def _unknown(name: str, installed: Sequence[str], spec: SelectionSpec) -> SelectionError:
    listing = "no pack is installed" if not installed else "installed packs: " + ", ".join(installed)
    import difflib

    close = difflib.get_close_matches(name, installed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if name.lower() in _RESERVED:
        hint = f"; did you mean the keyword {name.lower()!r}? (keywords are lower case)"
    return SelectionError(f"{spec.quoted} names pack {name!r}, which is not installed ({listing}){hint}")


def select(spec: SelectionSpec, discovery: Discovery, transformers_version: str) -> Selection:
    """Apply a parsed choice to the installed packs.

    Raises:
        SelectionError: the choice names a pack that is not installed.
    """
    installed = discovery.names
    for name in spec.named:
        if name not in installed:
            raise _unknown(name, installed, spec)

    packs: dict[str, PackInfo] = {}
    status: dict[str, str] = {}
    problems: list[HfPatchError] = []
    for name in installed:
        if spec.mode == "none" and spec.unset_none:
            status[name] = f"disabled: {spec.unset_none}"
            continue
        if spec.mode == "none":
            status[name] = f"disabled: {spec.origin}=none" if spec.origin.isidentifier() else f"disabled: {spec.quoted}"
            continue
        if spec.mode == "only" and name not in spec.included:
            status[name] = f"disabled: not listed in {spec.quoted}"
            continue
        if name in spec.excluded:
            status[name] = f"disabled: excluded by {spec.quoted}"
            continue
        if name in discovery.duplicates:
            error = discovery.duplicate_error(name)
            status[name] = f"error: {error}"
            problems.append(error)
            continue
        info = discovery.packs[name]
        if not info.supports(transformers_version):
            status[name] = f"skipped: needs transformers{info.transformers_range}, installed {transformers_version}"
            problems.append(
                PackError(
                    name,
                    f"pack {name!r} ({info.distribution} {info.version}) supports transformers"
                    f"{info.transformers_range} but {transformers_version} is installed; it is skipped. "
                    f"Install a release of {info.distribution} made for transformers {transformers_version}, "
                    f"or disable it with {PACKS_ENV}=all,-{name}.",
                    stage="selection",
                )
            )
            continue
        packs[name] = info
        status[name] = "enabled"
    return Selection(spec=spec, packs=packs, status=status, problems=tuple(problems))


def installed_transformers_version() -> str:
    """The installed transformers version, read from its metadata (no import)."""
    import importlib_metadata

    try:
        return str(importlib_metadata.version("transformers"))
    except importlib_metadata.PackageNotFoundError:
        return "0"


def current_selection(
    packs: str | Iterable[str] | None = None, *, origin: str = PACKS_ENV, locked: str | None = None
) -> Selection:
    """Discover the installed packs and apply ``packs`` (``None``: ``HF_PATCH_PACKS``) to them.

    ``origin`` names where ``packs`` came from in messages (``parse_selection``); when
    ``packs`` is ``None`` the choice is the variable's, and its being unset means what
    ``unset_selection`` says (``locked``: the selection of the lock in force).

    Imports neither torch, transformers nor any pack.
    """
    from .discovery import discover

    spec = spec_from_env(locked=locked) if packs is None else parse_selection(packs, origin=origin)
    return select(spec, discover(), installed_transformers_version())
