"""``hfpatch list``: installed packs, enabled or not and why, which distribution required each, and the
conflicts between them."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from .exit_codes import EXIT_OK
from .output import print_json, table


def cmd_list(args: argparse.Namespace) -> int:
    from .._pipeline.discovery import discover, required_by
    from .._pipeline.selection import installed_transformers_version, select, spec_from_env
    from ..settings import PACKS_ENV, lock_from_env
    from .lock import locked_selection

    discovery = discover()
    version = installed_transformers_version()
    # as a load selects: under HF_PATCH_LOCK an unset HF_PATCH_PACKS is the lock's selection
    selection = select(spec_from_env(locked=locked_selection(lock_from_env())), discovery, version)
    infos = [*discovery.packs.values(), *(info for infos in discovery.duplicates.values() for info in infos)]
    infos.sort(key=lambda info: (info.name, info.distribution))
    requirers = required_by(info.distribution for info in infos)
    # a conflict needs two packs: with one enabled, list reads metadata only (no torch, no pack imported)
    conflicts = conflicts_of(selection) if len(selection.packs) > 1 and not args.no_conflicts else None
    rows: list[dict[str, Any]] = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "required_by": list(requirers.get(info.distribution, ())),
            "enabled": selection.status.get(info.name) == "enabled",
            "status": selection.status.get(info.name, ""),
            "transformers": info.transformers_range or "any",
            "description": info.summary,
            **(
                {
                    "conflicts": [
                        {
                            "model_type": conflict["model_type"],
                            "target": conflict["target"],
                            "with": [pack for pack in conflict["packs"] if pack != info.name],
                        }
                        for conflict in conflicts["conflicts"]
                        if info.name in conflict["packs"]
                    ]
                }
                if conflicts is not None
                else {}
            ),
        }
        for info in infos
    ]
    if args.json:
        data: dict[str, Any] = {"transformers_version": version, "packs": rows}
        if conflicts is not None:
            data["conflicts_checked_on"] = list(conflicts["model_types"])
            data["settled_by"] = None if conflicts["selection"] is None else {PACKS_ENV: conflicts["selection"]}
        print_json(data)
        return EXIT_OK
    if not rows:
        print("No pack is installed. Packs are distributions named hfpatch-pack-*; pip install one.")
        return EXIT_OK
    for row in rows:
        marks = [
            f"{', '.join(conflict['with']) or 'itself'} on {conflict['model_type']}"
            for conflict in row.get("conflicts", ())
        ]
        if marks:
            row["status"] += f", conflicts with {'; '.join(marks)}"
    print(
        table(
            [
                [
                    r["name"],
                    r["distribution"],
                    r["version"],
                    ", ".join(r["required_by"]) or "-",
                    r["status"],
                    r["transformers"],
                    r["description"],
                ]
                for r in rows
            ],
            ["pack", "distribution", "version", "required by", "status", "transformers", "description"],
        )
    )
    if conflicts is not None and conflicts["conflicts"]:
        shown = selection.spec.text
        where = f"{PACKS_ENV}={shown}" if shown is not None else f"{PACKS_ENV} unset"
        print(f"\nConflicts: with {where}, every load of these model types raises PatchConflictError:")
        for conflict in conflicts["conflicts"]:
            print(f"  {conflict['model_type']}: {conflict['message']}")
        checked = ", ".join(conflicts["model_types"])
        if conflicts["selection"] is not None:
            print(
                f"{PACKS_ENV}={conflicts['selection']} settles every one: the resolver decided each model type two "
                f"or more enabled packs target ({checked}) with it and found no tie."
            )
        else:
            print(
                f"No selection settles every one among the {conflicts['checked']} the resolver checked on "
                f"{checked}; choose the packs to run with {PACKS_ENV}=a,b."
            )
    elif conflicts is not None and conflicts["model_types"]:
        checked = ", ".join(conflicts["model_types"])
        print(f"\nNo conflict on {checked} (the model types two or more enabled packs target).")
    if any(r["enabled"] for r in rows):
        print("\n'enabled' packs are selected; hfpatch check imports them and calls their hooks.")
        if selection.spec.text is None and selection.spec.mode == "all":
            # the commands read an unset variable as enable() does, but nothing enables hfpatch in a program
            # run without it: the start-up hook waits for a selection
            print(
                f"{PACKS_ENV} is unset: they run under enable() or hfpatch run; a program that does neither loads "
                f"vanilla until {PACKS_ENV} names them (or all)."
            )
    return EXIT_OK


def conflicts_of(selection: Any) -> dict[str, Any]:
    """``conflicts.find_conflicts`` of the selection (with the configs ``check`` asks packs with) as
    JSON, from the cache when the installed versions and packs' files are those it was found
    with: finding them imports every enabled pack and plans every model type two of them target.
    Warnings from building models' configs and importing packs are not list's to show."""
    import json

    from .cache import Cache, environment_key

    cache = Cache("conflicts", environment_key())
    offsets = selection.spec.priority_offsets
    name = json.dumps(sorted([pack, offsets.get(pack, 0)] for pack in selection.packs))
    found = cache.get(name)
    if isinstance(found, dict):
        return found
    import dataclasses

    from .._pipeline.conflicts import find_conflicts
    from .output import Progress
    from .probes import answers_cache, hook_guard, probe_config

    progress = Progress(f"finding the conflicts between {len(selection.packs)} enabled packs", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conflicts = find_conflicts(
            selection, guard=hook_guard(), config_for=probe_config, cache=answers_cache(), progress=Progress
        )
    progress.step("every model type")
    progress.finish()
    value = dataclasses.asdict(conflicts)
    cache.put(name, value)
    return dict(cache.get(name) or value)
