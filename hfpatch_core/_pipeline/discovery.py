"""Finding installed packs from distribution metadata, without importing them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import importlib_metadata
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..errors import DuplicatePackError
from ..settings import ENTRY_POINT_GROUP


@dataclasses.dataclass(frozen=True)
class PackInfo:
    """An installed pack, as its distribution's metadata describes it.

    Attributes:
        name: the entry point's name, which is the pack's name (``"qwen-moe"``).
        value: the entry point's value, the module or object holding the hookimpls.
        distribution: the distribution that declares it (``"hfpatch-pack-qwen-moe"``).
        version: that distribution's version.
        summary: its one-line description (``Summary`` metadata).
        transformers_range: the specifier of its own ``Requires-Dist: transformers``
            (``">=5.3,<6"``), or ``""`` when it declares none.
    """

    name: str
    value: str
    distribution: str
    version: str
    summary: str = ""
    transformers_range: str = ""
    entry_point: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """``name==version``, as shown in plans and fingerprints."""
        return f"{self.name}=={self.version}"

    def supports(self, transformers_version: str) -> bool:
        """Whether the pack's declared transformers range admits ``transformers_version``."""
        if not self.transformers_range:
            return True
        try:
            version = Version(transformers_version)
        except InvalidVersion:
            return True
        return SpecifierSet(self.transformers_range).contains(version, prereleases=True)

    def load(self) -> object:
        """Import the pack and return the object holding its hookimpls."""
        if self.entry_point is None:
            raise RuntimeError(f"pack {self.name!r} was not discovered from an entry point")
        return self.entry_point.load()


@dataclasses.dataclass(frozen=True)
class Discovery:
    """Every pack installed in this environment.

    Attributes:
        packs: the usable packs by name, in name order.
        duplicates: pack names declared by more than one distribution, with every
            declaration; such a name is left out of ``packs``.
    """

    packs: Mapping[str, PackInfo]
    duplicates: Mapping[str, tuple[PackInfo, ...]] = dataclasses.field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """Every installed pack name, duplicates included, sorted."""
        return tuple(sorted({*self.packs, *self.duplicates}))

    def duplicate_error(self, name: str) -> DuplicatePackError:
        """The error for a pack name that several distributions declare."""
        infos = self.duplicates[name]
        where = " and ".join(f"{info.distribution} {info.version} ({info.value})" for info in infos)
        return DuplicatePackError(
            f"pack name {name!r} is declared by {where}; uninstall all but one of these "
            f"distributions (pip uninstall {infos[-1].distribution})."
        )


def _transformers_range(requires: list[str] | None) -> str:
    for line in requires or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) != "transformers":
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        return str(requirement.specifier)
    return ""


def _pack_info(entry_point: Any) -> PackInfo:
    dist = entry_point.dist
    metadata = dist.metadata if dist is not None else None
    return PackInfo(
        name=entry_point.name,
        value=entry_point.value,
        distribution=(metadata["Name"] if metadata is not None else None) or "<unknown>",
        version=(dist.version if dist is not None else None) or "0",
        summary=(metadata.get("Summary") if metadata is not None else None) or "",
        transformers_range=_transformers_range(dist.requires if dist is not None else None),
        entry_point=entry_point,
    )


def discover() -> Discovery:
    """Read the ``hfpatch.packs`` entry points of every installed distribution.

    Nothing is imported: names, versions, summaries and compatibility ranges all come
    from the distributions' metadata.
    """
    found: dict[str, list[PackInfo]] = {}
    for entry_point in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        info = _pack_info(entry_point)
        found.setdefault(info.name, []).append(info)
    packs = {name: infos[0] for name, infos in sorted(found.items()) if len(infos) == 1}
    duplicates = {name: tuple(infos) for name, infos in sorted(found.items()) if len(infos) > 1}
    return Discovery(packs=packs, duplicates=duplicates)


def required_by(distributions: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """For each of ``distributions``, the installed distributions whose ``Requires-Dist`` names it:
    what pulled a pack in.  A requirement under an extra reads ``name[extra]`` (whether that extra
    was installed is not recorded).  Reads metadata only.
    """
    wanted = {canonicalize_name(name): name for name in distributions}
    found: dict[str, dict[str, None]] = {name: {} for name in wanted.values()}
    for dist in importlib_metadata.distributions():
        requirer = dist.metadata["Name"] if dist.metadata is not None else None
        if not requirer:
            continue
        for line in dist.requires or ():
            try:
                requirement = Requirement(line)
            except InvalidRequirement:
                continue
            target = wanted.get(canonicalize_name(requirement.name))
            if target is None or canonicalize_name(requirer) == canonicalize_name(target):
                continue
            marker = requirement.marker
            if marker is None or marker.evaluate({"extra": ""}):
                found[target][requirer] = None
                continue
            for extra in dist.metadata.get_all("Provides-Extra") or ():
                if marker.evaluate({"extra": extra}):
                    found[target][f"{requirer}[{extra}]"] = None
    return {name: tuple(sorted(requirers)) for name, requirers in found.items()}
