"""Classes of a model replaced outside hfpatch, found when its load is planned.

Another library may swap a class in a transformers modeling module (Liger-Kernel assigns
``modeling_llama.LlamaRMSNorm = LigerRMSNorm``) or register it in transformers' patch
registry.  A pack that replaces the same class for a load would silently take its place;
planning lists such classes (``Plan.foreign``) so that the load can say so.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

from ..errors import ForeignPatchError
from ..plan import Claim, Foreign, Plan
from .resolution import matches

__all__ = ["changed_registry_error", "foreign_replacements", "registry_changes"]


@functools.cache
def _defined_classes(path: str) -> frozenset[str]:
    """The classes a module's source defines at its top level (parsed once per file)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    return frozenset(node.name for node in tree.body if isinstance(node, ast.ClassDef))


def _qualified(value: object) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"


def _swapped(module: ModuleType, registry_values: set[int]) -> list[tuple[str, type]]:
    """The classes ``module``'s source defines whose attribute now holds another class
    (one transformers' registry put there is not counted: it is listed as a registry entry)."""
    path = getattr(module, "__file__", None)
    if path is None:
        return []
    swapped = []
    namespace = vars(module)
    for name in _defined_classes(path):
        value = namespace.get(name)
        if not isinstance(value, type) or id(value) in registry_values:
            continue
        if value.__module__ != module.__name__ or value.__qualname__ != name:
            swapped.append((name, value))
    return sorted(swapped)


def foreign_replacements(
    modeling: ModuleType | None,
    class_names: Iterable[str],
    *,
    registered: Mapping[str, type],
    overridable: Iterable[str],
    replaced: Mapping[str, Claim],
) -> tuple[Foreign, ...]:
    """The classes of a load replaced outside hfpatch.

    Args:
        modeling: the load's modeling module (``None`` when not imported: nothing to inspect).
        class_names: the module classes the load meets.
        registered: transformers' patch registry before the load registers anything.
        overridable: the registry keys hfpatch registered for an enclosing load (its own).
        replaced: the plan's winning claim for each class name.
    """
    names = set(class_names)
    owned = frozenset(overridable)
    # transformers' own entries (5.24 registers its fused modules for good) are no foreign patch
    others = {
        key: value
        for key, value in registered.items()
        if key not in owned and not str(getattr(value, "__module__", "")).startswith("transformers.")
    }
    found: list[Foreign] = []
    if modeling is not None:
        for name, value in _swapped(modeling, {id(v) for v in registered.values()}):
            if name in names:
                claim = replaced.get(name)
                found.append(
                    Foreign(name, _qualified(value), "module", modeling.__name__, claim.pack if claim else None)
                )
    for key, value in others.items():
        hit = sorted(name for name in names if matches(key, name))
        if hit:
            packs = sorted({replaced[name].pack for name in hit if name in replaced})
            found.append(Foreign(key, _qualified(value), "registry", overridden_by=", ".join(packs) or None))
    return tuple(found)


def registry_changes(mapping: Mapping[str, type], registry: Mapping[str, type]) -> tuple[Foreign, ...]:
    """The entries of a load's ``mapping`` that ``registry`` no longer holds as registered: code run
    by the load (a library's linearize path, say) cleared or overwrote them."""
    return tuple(
        Foreign(key, _qualified(registry[key]) if key in registry else "removed", "changed during the load")
        for key, value in mapping.items()
        if registry.get(key) is not value
    )


def changed_registry_error(plan: Plan, changed: Iterable[Foreign]) -> list[ForeignPatchError]:
    """One error per registry entry of ``plan`` that code run by its load changed."""
    owners = {claim.target: claim.pack for claim in plan.entries}
    return [
        ForeignPatchError(
            f"{found.situation}; pack {owners.get(found.name, '?')!r} registered it for this load, so the "
            "model may be built without that pack's class.",
            "Apply the other library's patch before or after loading, not inside the load.",
            packs=(owners.get(found.name, "?"),),
            target=found.name,
        )
        for found in changed
    ]
