"""``hfpatch check``: each pack's targets, problems and drift, alone and together
(``_pipeline.checking`` computes them), then shown."""

from __future__ import annotations

import argparse

from .exit_codes import EXIT_OK, EXIT_PROBLEMS
from .output import transformers_version


def cmd_check(args: argparse.Namespace) -> int:
    from .._pipeline.checking import check_combination, check_pack, write_record
    from .._pipeline.selection import current_selection
    from ..errors import HfPatchError
    from .inputs import check_model_types
    from .output import Progress
    from .probes import answers_cache, hook_guard, probe_config

    check_model_types(args.model_type)
    selection = current_selection(args.packs or None, origin="hfpatch check")
    guard = hook_guard()
    failed = False
    for error in selection.problems:
        print(f"FAIL  {error}")
        failed = True
    results = []
    for name in sorted(selection.packs):
        result = check_pack(
            selection,
            name,
            args.model_type or (),
            guard=guard,
            config_for=probe_config,
            cache=answers_cache(),
            progress=Progress,
        )
        results.append(result)
        targets = ", ".join(result.model_types) or "no model type"
        # --record refreshes the record: the drift it replaces is not a failure
        ok = not result.problems and (args.record or not result.drift)
        failed = failed or not ok
        print(f"{'ok   ' if ok else 'FAIL '} {name} {result.version}: targets {targets}")
        for problem in result.problems:
            print(f"      - {problem}")
        for refused in result.refused:
            print(f"      refused (left as it is): {refused}")
        if args.record:
            try:
                path = write_record(result)
            except (HfPatchError, OSError) as exc:
                failed = True
                print(f"      not recorded: {exc}")
            else:
                classes = len(result.targets)
                print(
                    f"      recorded {classes} class{'es' if classes != 1 else ''} on transformers "
                    f"{transformers_version()} in {path}"
                )
            continue
        for drift in result.drift:
            print(f"      - {drift.describe()}")
        if result.drift:
            print(f"      verify the pack on this release, then `hfpatch check --record {name}` adds it to the record")
        elif not result.recorded and not result.problems:
            print(f"      no drift record: `hfpatch check --record {name}` writes one (not a failure)")
    if len(results) > 1:
        together = ", ".join(result.pack for result in results)
        problems = check_combination(selection, results, guard=guard, config_for=probe_config)
        if problems:
            failed = True
            print(f"FAIL  together: {together}")
            for problem in problems:
                print(f"      - {problem}")
        else:
            print(f"ok    together: {together}")
    if not selection.packs and not selection.problems:
        print("No pack to check.")
    return EXIT_PROBLEMS if failed else EXIT_OK
