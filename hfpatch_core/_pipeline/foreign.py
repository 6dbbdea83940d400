"""Classes of a model replaced outside hfpatch, found when its load is planned.

Another library may swap a class in a transformers modeling module (Liger-Kernel assigns
``modeling_llama.LlamaRMSNorm = LigerRMSNorm``) or register it in transformers' patch
registry (transformers' own ``KernelConfig`` fusion, ``register_kernel_replacements_and_fusions``,
registers its fused classes with ``overwrite=True``; so do axolotl's model profiles).  Either
way the model is not what the selected packs alone make of it: a pack's claim may take the
class's place (``Foreign.overridden_by``), or lose to it, or the pack may refuse the class it
finds (``Foreign.displaced``).  Planning lists such classes (``Plan.foreign``) so that the load
says so, and ``displacements`` / ``overrides`` are the warnings (errors in strict mode).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType

from ..errors import ForeignPatchError
from ..plan import Claim, Foreign, Lost, Plan, Refused
from .resolution import matches

__all__ = ["changed_registry_error", "displacements", "foreign_replacements", "registry_changes", "transformers_own"]

#: The module of the classes transformers builds for a load's ``fusion_config`` (the load asked
#: for them; 5.24 leaves them registered after it): no other library's patch.  Every other
#: registry entry no pack made is foreign, transformers' ``KernelConfig`` fusion among them (its
#: ``Fused<Class>`` is built in ``transformers.integrations.hub_kernels`` around a hub kernel).
_FUSION_MODULE = "transformers.fusion_mapping"


def transformers_own(value: object) -> bool:
    """Whether a patch registry value is transformers' own ``fusion_config`` class."""
    return getattr(value, "__module__", None) == _FUSION_MODULE


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


def _joined(packs: Iterable[str]) -> str | None:
    return ", ".join(sorted(set(packs))) or None


def _refusers(names: Iterable[str], refused: Iterable[Refused]) -> list[str]:
    """The packs that refused a class of ``names`` (a pack may name the class it found, the
    foreign one, or the name it replaced)."""
    wanted = set(names)
    return [refusal.pack for refusal in refused if refusal.target in wanted]


def foreign_replacements(
    modeling: ModuleType | None,
    class_names: Iterable[str],
    *,
    registered: Mapping[str, type],
    overridable: Iterable[str],
    replaced: Mapping[str, Claim],
    lost: Iterable[Lost] = (),
    refused: Iterable[Refused] = (),
) -> tuple[Foreign, ...]:
    """The classes of a load replaced outside hfpatch.

    Args:
        modeling: the load's modeling module (``None`` when not imported: nothing to inspect).
        class_names: the module classes the load meets.
        registered: transformers' patch registry before the load registers anything.
        overridable: the registry keys hfpatch registered for an enclosing load (its own).
        replaced: the plan's winning claim for each class name.
        lost: the plan's lost claims: one beaten by a registry entry (no winning claim) was
            displaced by it.
        refused: the classes packs found and refused: a pack that refused a foreign class (by
            its name or the name it replaced) was displaced by it.
    """
    names = set(class_names)
    owned = frozenset(overridable)
    lost, refused = tuple(lost), tuple(refused)
    others = {key: value for key, value in registered.items() if key not in owned and not transformers_own(value)}
    found: list[Foreign] = []
    if modeling is not None:
        for name, value in _swapped(modeling, {id(v) for v in registered.values()}):
            if name in names:
                claim = replaced.get(name)
                displaced = _joined(_refusers((name, value.__name__), refused))
                found.append(
                    Foreign(
                        name,
                        _qualified(value),
                        "module",
                        modeling.__name__,
                        claim.pack if claim else None,
                        displaced,
                    )
                )
    for key, value in others.items():
        hit = sorted(name for name in names if matches(key, name))
        if hit:
            packs = sorted({replaced[name].pack for name in hit if name in replaced})
            beaten = [
                item.claim.pack
                for item in lost
                if item.winner is None
                and (item.claim.target == key if item.class_name is None else matches(key, item.class_name))
            ]
            refusers = _refusers([*hit, getattr(value, "__name__", "")], refused)
            found.append(
                Foreign(
                    key,
                    _qualified(value),
                    "registry",
                    overridden_by=_joined(packs),
                    displaced=_joined([*beaten, *refusers]),
                )
            )
    return tuple(found)


def overrides(found: Foreign) -> ForeignPatchError:
    """The report of a pack's claim taking a foreign class's place for a load."""
    pack = found.overridden_by or "?"
    return ForeignPatchError(
        f"pack {pack!r} replaces {found.name} for this load, but {found.situation}: the pack's "
        "class is used instead, and the other one is put back when the load ends.",
        f"To keep the other library's class, leave {pack!r} out of HF_PATCH_PACKS for this load, or apply "
        "that library's patch after loading.",
        packs=(pack,),
        target=found.name,
    )


def displacements(foreign: Iterable[Foreign]) -> list[ForeignPatchError]:
    """One report per foreign class that keeps a selected pack from replacing it: the pack's
    claim lost to it, or the pack refused it; the foreign class is what the model gets."""
    errors = []
    for found in foreign:
        if not found.displaced:
            continue
        packs = tuple(found.displaced.split(", "))
        named = ", ".join(repr(pack) for pack in packs)
        errors.append(
            ForeignPatchError(
                f"pack{'s' if len(packs) > 1 else ''} {named} {'do' if len(packs) > 1 else 'does'} not replace "
                f"{found.name} for this load: {found.situation}, and that class is used instead "
                + (
                    "(the pack found it and refused it)."
                    if found.source == "module"
                    else "(an entry no pack made outranks a claim without overwrite=True, or the pack refused the "
                    "class it found)."
                ),
                "To use the pack's class, apply the other library's patch after loading (or undo it before); "
                f"to keep the other library's class, leave {named} out of HF_PATCH_PACKS for this model.",
                packs=packs,
                target=found.name,
            )
        )
    return errors


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
