"""Which packs made a checkpoint: a small file ``save_pretrained`` of a patched model writes beside
the weights (which stay in the original layout, so transformers and other tools ignore it).

``hfpatch explain DIR`` shows it, and a load of the directory with another selection logs what
differs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..plan import Plan

__all__ = ["FILE_NAME", "differences", "read", "record", "write"]

#: The file written beside a patched model's weights.
FILE_NAME = "hfpatch_provenance.json"


def _packs(plan: Plan) -> list[dict[str, str]]:
    """The packs that changed the model: a class replaced, a converter, a step installed (a pack that
    took part in the load and offered nothing for this model made nothing of the checkpoint)."""
    versions = dict(pack for inner in plan.all_plans() for pack in inner.packs)
    changed = {
        pack
        for inner in plan.all_plans()
        for pack in (
            *(claim.pack for claim in inner.entries),
            *(claim.pack for claim in inner.conversions.claims),
            *(claim.pack for claim in inner.installed_steps),
        )
    }
    return [{"name": name, "version": versions[name]} for name in sorted(changed & set(versions))]


def record(plan: Plan) -> dict[str, Any]:
    """What the file holds for a model loaded with ``plan``."""
    from importlib.metadata import version

    return {
        "about": "written by hfpatch: the packs whose patches the model was saved from; the weights are in "
        "the original layout and load without hfpatch",
        "model_class": plan.context.model_class_name if plan.context else None,
        "fingerprint": plan.fingerprint,
        "packs": _packs(plan),
        "replaced": {
            name: f"{claim.patch.replacement_name} [{claim.pack}]"
            for inner in plan.all_plans()
            for name, claim in sorted(inner.replaced.items())
        },
        # the steps were on the model that was saved; its weights are vanilla's either way
        **(
            {"steps": {claim.target: f"{claim.step.install_name} [{claim.pack}]" for claim in plan.installed_steps}}
            if plan.installed_steps
            else {}
        ),
        "hfpatch": version("hfpatch-core"),
        "transformers": plan.context.transformers_version if plan.context else None,
    }


def write(directory: str | Path, plan: Plan) -> Path:
    """Write ``plan``'s record into ``directory`` (a ``save_pretrained`` target)."""
    path = Path(directory) / FILE_NAME
    path.write_text(json.dumps(record(plan), indent=2) + "\n", encoding="utf-8")
    return path


def read(directory: str | Path) -> dict[str, Any] | None:
    """The record saved in ``directory``, or ``None`` when there is none (or it is unreadable)."""
    path = Path(directory) / FILE_NAME
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def differences(recorded: Mapping[str, Any], plan: Plan) -> list[str]:
    """How a load with ``plan`` differs from the one the checkpoint was saved from (empty: the same)."""
    then = {(p.get("name"), p.get("version")) for p in recorded.get("packs", []) if isinstance(p, dict)}
    now = {(p["name"], p["version"]) for p in _packs(plan)}
    found = []
    for name, version in sorted(then - now, key=str):
        other = next((v for n, v in now if n == name), None)
        found.append(f"pack {name!r} {version} made it; " + (f"{other} loads it" if other else "it is not selected"))
    found += [f"pack {name!r} {version} takes part now, not when it was saved" for name, version in sorted(now - then)]
    if not found and recorded.get("fingerprint") != plan.fingerprint:
        found.append(
            f"the plan differs (saved from plan {recorded.get('fingerprint')}, loaded with {plan.fingerprint})"
        )
    return found
