"""The drift record: what a pack's replacements were built against, and how to compare.

A pack's record lists, per transformers release it was recorded on, every class its
patches replace (per model type, every class a pattern matched) with the signatures of
its ``forward`` and ``__init__``.  ``hfpatch check --record`` writes it after the pack
passed its check; ``hfpatch check`` compares it with the installed transformers: an
installed class whose signature none of the recorded releases had, a replaced class no
record lists, or a recorded class the pack no longer finds is *drift*.

The record is a JSON file that ships with the pack, beside the module its entry point
names (``record_path``): ``hfpatch-record.json`` inside a package, ``<module>.hfpatch-
record.json`` next to a single-file module.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ..errors import HfPatchError

#: The format number written in every record; a record of another format is refused.
FORMAT = 1
#: The record's file name inside a package.
RECORD_NAME = "hfpatch-record.json"
#: The methods whose signatures are recorded.
METHODS = ("forward", "__init__")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class RecordError(HfPatchError, ValueError):
    """A drift record file cannot be read: not JSON, another format, or a malformed entry."""


def record_path(module_file: str | Path) -> Path:
    """Where the record of the pack whose entry point names the module at ``module_file`` lives.

    Args:
        module_file: the module's file (its ``__file__``/spec origin).

    Returns:
        For a package's ``__init__.py``, the package directory's ``hfpatch-record.json``
        (a wheel of the package ships it as package data); for any other module file
        ``name.py``, ``name.hfpatch-record.json`` next to it (so single-module packs in
        one ``site-packages`` never share a file).
    """
    path = Path(module_file)
    if path.stem == "__init__":
        return path.parent / RECORD_NAME
    return path.with_name(f"{path.stem}.{RECORD_NAME}")


def signature_text(function: Callable[..., Any], name: str | None = None) -> str:
    """``function``'s parameters as written, without annotations: ``(self, x, scale=1.0, **kwargs)``.

    Annotations are left out: how they print differs between Python versions and they do
    not change how a call binds.  A default whose repr holds a memory address is shown
    by its type.  A pass-through wrapper is seen through (``_unwrapped``), so that the
    text does not depend on whether ``kernels`` is installed.
    """
    try:
        signature = inspect.signature(_unwrapped(function, name or function.__name__))
    except (TypeError, ValueError):  # a builtin without a signature
        return "(?)"
    parts = []
    for parameter in signature.parameters.values():
        plain = parameter.replace(annotation=inspect.Parameter.empty)
        if parameter.default is not inspect.Parameter.empty and _ADDRESS.search(repr(parameter.default)):
            plain = plain.replace(default=_Shown(f"<{type(parameter.default).__qualname__}>"))
        parts.append(plain)
    return str(signature.replace(parameters=parts, return_annotation=inspect.Signature.empty))


def _unwrapped(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    """The function a decorator wrapped: through ``__wrapped__``, and through a
    ``(self, *args, **kwargs)`` closure that holds one function called ``name`` (the
    method's name: ``"__init__"``).

    transformers' ``use_kernelized_func`` replaces an attention's ``__init__`` with such a
    wrapper (without ``functools.wraps``) when ``kernels`` is installed, and leaves it
    alone otherwise: the recorded signature must be the class's own either way.
    """
    for _ in range(8):  # a few decorators deep at most
        function = inspect.unwrap(function)
        try:
            names = [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]
        except (TypeError, ValueError):
            return function
        if [kind for _, kind in names] != [_POSITIONAL, _VAR_POSITIONAL, _VAR_KEYWORD]:
            return function
        inner = [
            cell.cell_contents
            for cell in getattr(function, "__closure__", None) or ()
            if callable(getattr(cell, "cell_contents", None)) and getattr(cell.cell_contents, "__name__", None) == name
        ]
        if len(inner) != 1:
            return function
        function = inner[0]
    return function


_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_VAR_POSITIONAL = inspect.Parameter.VAR_POSITIONAL
_VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD


class _Shown:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True, order=True)
class Target:
    """One class a pack's patches replace, as found on one transformers release.

    Attributes:
        model_type: the model type whose modeling module holds the class.
        class_name: the class's name.
        forward: ``signature_text`` of its ``forward``.
        init: ``signature_text`` of its ``__init__``.
    """

    model_type: str
    class_name: str
    forward: str
    init: str

    @classmethod
    def of(cls, model_type: str, module_class: type) -> Target:
        """The target for ``module_class`` of ``model_type``, with its signatures read now."""
        return cls(
            model_type,
            module_class.__name__,
            signature_text(module_class.forward, "forward"),  # type: ignore[attr-defined]
            signature_text(module_class.__init__, "__init__"),  # type: ignore[misc]
        )

    @property
    def key(self) -> tuple[str, str]:
        return (self.model_type, self.class_name)

    def signature(self, method: str) -> str:
        return self.forward if method == "forward" else self.init


@dataclasses.dataclass(frozen=True)
class Drift:
    """One difference between a pack's record and the installed transformers.

    Attributes:
        pack: the pack.
        model_type, class_name: the class.
        change: ``"forward"`` or ``"__init__"`` (signature changed), ``"new"`` (the pack
            replaces a class no record lists) or ``"gone"`` (a recorded class the pack no
            longer replaces).
        recorded_on: the recorded release compared with.
        installed: the installed transformers version.
        recorded, now: the recorded and the installed signature (empty for new/gone).
    """

    pack: str
    model_type: str
    class_name: str
    change: str
    recorded_on: str
    installed: str
    recorded: str = ""
    now: str = ""

    def describe(self) -> str:
        where = f"{self.class_name} ({self.model_type})"
        versions = f"recorded on transformers {self.recorded_on}, installed {self.installed}"
        if self.change == "new":
            return f"drift: {where} is replaced by the pack but not in its record ({versions})"
        if self.change == "gone":
            return f"drift: {where} is in the record but the pack no longer replaces it ({versions})"
        return f"drift: {where} {self.change} changed ({versions}): was {self.recorded}, is now {self.now}"


@dataclasses.dataclass(frozen=True)
class DriftRecord:
    """A pack's record: for each transformers release it was recorded on, its targets.

    Attributes:
        pack: the pack's name.
        releases: transformers version -> the targets found there, sorted.
    """

    pack: str
    releases: Mapping[str, tuple[Target, ...]]

    def __post_init__(self) -> None:
        for version in self.releases:
            _version(version, f"the record of pack {self.pack!r}")

    def with_release(self, version: str, targets: Iterable[Target]) -> DriftRecord:
        """This record with ``version``'s targets set to ``targets`` (others kept)."""
        return DriftRecord(self.pack, {**self.releases, version: tuple(sorted(set(targets)))})

    def to_json(self) -> dict[str, Any]:
        """The file's content: releases in version order, targets sorted (a re-record of the
        same release writes the same bytes)."""
        return {
            "format": FORMAT,
            "pack": self.pack,
            "releases": {
                version: [
                    {"model_type": t.model_type, "class": t.class_name, "forward": t.forward, "__init__": t.init}
                    for t in sorted(self.releases[version])
                ]
                for version in sorted(self.releases, key=Version)
            },
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: object, source: str) -> DriftRecord:
        """Validate the parsed content of ``source``.

        Raises:
            RecordError: it is not a record of format ``FORMAT``, or an entry is malformed.
        """
        fix = "write it again with `hfpatch check --record PACK`"
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise RecordError(f"{source}: not an hfpatch record of format {FORMAT} (found {found!r}); {fix}")
        pack, releases = data.get("pack"), data.get("releases")
        if not isinstance(pack, str) or not isinstance(releases, dict):
            raise RecordError(f"{source}: needs a string 'pack' and an object 'releases'; {fix}")
        parsed: dict[str, tuple[Target, ...]] = {}
        for version, entries in releases.items():
            _version(version, source)
            if not isinstance(entries, list):
                raise RecordError(f"{source}: release {version!r} must list its classes; {fix}")
            targets = []
            for entry in entries:
                fields = ("model_type", "class", "forward", "__init__")
                if not isinstance(entry, dict) or not all(isinstance(entry.get(f), str) for f in fields):
                    raise RecordError(f"{source}: release {version}: entry {entry!r:.120} needs {fields}; {fix}")
                targets.append(Target(entry["model_type"], entry["class"], entry["forward"], entry["__init__"]))
            parsed[version] = tuple(sorted(targets))
        return cls(pack, parsed)


def _version(text: object, source: str) -> Version:
    try:
        return Version(str(text))
    except InvalidVersion:
        raise RecordError(
            f"{source}: {text!r} is not a transformers version; write it again with `hfpatch check --record PACK`"
        ) from None


def read_record(path: Path) -> DriftRecord | None:
    """The record at ``path``, or ``None`` when there is no such file.

    Raises:
        RecordError: the file exists but is not a valid record.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RecordError(f"{path}: not JSON ({exc}); write it again with `hfpatch check --record PACK`") from None
    return DriftRecord.from_json(data, str(path))


def nearest_release(record: DriftRecord, installed: str) -> str:
    """The recorded release to compare ``installed`` with: itself if recorded, else the
    newest recorded before it, else the oldest recorded."""
    versions = sorted(record.releases, key=Version)
    if not versions:
        raise RecordError(f"the record of pack {record.pack!r} lists no release; record one")
    below = [v for v in versions if Version(v) <= Version(installed)]
    return below[-1] if below else versions[0]


def compare(record: DriftRecord, installed: Iterable[Target], version: str) -> tuple[Drift, ...]:
    """What changed between ``record`` and the targets found on transformers ``version``.

    A method signature is fine when any recorded release had it (the pack was built and
    tested against it); otherwise it is compared with the nearest recorded release
    (``nearest_release``).  A target no release lists is ``new``; a target of the nearest
    release, of a model type still targeted, that is not found now is ``gone``.

    Returns:
        The differences, sorted by model type and class; empty when there is none.
    """
    nearest = nearest_release(record, version)
    known: dict[tuple[str, str], dict[str, set[str]]] = {}
    for targets in record.releases.values():
        for target in targets:
            seen = known.setdefault(target.key, {method: set() for method in METHODS})
            for method in METHODS:
                seen[method].add(target.signature(method))
    reference = {target.key: target for target in record.releases[nearest]}
    found = {target.key: target for target in installed}
    drifts = []
    for key, target in sorted(found.items()):
        if key not in known:
            drifts.append(Drift(record.pack, *key, "new", nearest, version))
            continue
        for method in METHODS:
            now = target.signature(method)
            if now in known[key][method]:
                continue
            was = reference[key].signature(method) if key in reference else sorted(known[key][method])[0]
            drifts.append(Drift(record.pack, *key, method, nearest, version, was, now))
    model_types = {model_type for model_type, _ in found}
    for key in sorted(reference):
        if key not in found and key[0] in model_types:
            drifts.append(Drift(record.pack, *key, "gone", nearest, version))
    return tuple(drifts)
