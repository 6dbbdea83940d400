"""The ``hfpatch`` command: list, explain, check and run patch packs.

Exit codes: 0 success; 1 a check found problems; 2 bad input (arguments,
``HF_PATCH_PACKS``, an unknown model); ``run`` exits with the program's own code.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
#: The reader of the output went away (``hfpatch list | head``): a shell's status for SIGPIPE.
EXIT_BROKEN_PIPE = 141


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def cmd_list(args: argparse.Namespace) -> int:
    from .._pipeline.discovery import discover
    from .._pipeline.selection import installed_transformers_version, parse_selection, select
    from ..settings import PACKS_ENV, packs_from_env

    discovery = discover()
    version = installed_transformers_version()
    selection = select(parse_selection(packs_from_env()), discovery, version)
    infos = [*discovery.packs.values(), *(info for infos in discovery.duplicates.values() for info in infos)]
    infos.sort(key=lambda info: (info.name, info.distribution))
    # a conflict needs two packs: with one enabled, list reads metadata only (no torch, no pack imported)
    conflicts = _conflicts(selection) if len(selection.packs) > 1 and not args.no_conflicts else None
    rows: list[dict[str, Any]] = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "enabled": selection.status.get(info.name) == "enabled",
            "status": selection.status.get(info.name, ""),
            "transformers": info.transformers_range or "any",
            "description": info.summary,
            **(
                {
                    "conflicts": [
                        {
                            "model_type": conflict.model_type,
                            "target": conflict.target,
                            "with": [pack for pack in conflict.packs if pack != info.name],
                        }
                        for conflict in conflicts.of(info.name)
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
            data["conflicts_checked_on"] = list(conflicts.model_types)
            data["settled_by"] = None if conflicts.selection is None else {PACKS_ENV: conflicts.selection}
        _print_json(data)
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
        _table(
            [
                [r["name"], r["distribution"], r["version"], r["status"], r["transformers"], r["description"]]
                for r in rows
            ],
            ["pack", "distribution", "version", "status", "transformers", "description"],
        )
    )
    if conflicts is not None and conflicts.conflicts:
        shown = selection.spec.text
        where = f"{PACKS_ENV}={shown}" if shown is not None else f"{PACKS_ENV} unset"
        print(f"\nConflicts: with {where}, every load of these model types raises PatchConflictError:")
        for conflict in conflicts.conflicts:
            print(f"  {conflict.model_type}: {conflict.message}")
        checked = ", ".join(conflicts.model_types)
        if conflicts.selection is not None:
            print(
                f"{PACKS_ENV}={conflicts.selection} settles every one: the resolver decided each model type two or "
                f"more enabled packs target ({checked}) with it and found no tie."
            )
        else:
            print(
                f"No selection settles every one among the {conflicts.checked} the resolver checked on {checked}; "
                f"choose the packs to run with {PACKS_ENV}=a,b."
            )
    elif conflicts is not None and conflicts.model_types:
        checked = ", ".join(conflicts.model_types)
        print(f"\nNo conflict on {checked} (the model types two or more enabled packs target).")
    if any(r["enabled"] for r in rows):
        print("\n'enabled' packs are selected; hfpatch check imports them and calls their hooks.")
    return EXIT_OK


def _conflicts(selection: Any) -> Any:
    """``inspection.find_conflicts`` of the selection, with the configs ``check`` asks packs with;
    warnings from building models' configs and importing packs are not list's to show."""
    import warnings

    from .inspection import find_conflicts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return find_conflicts(selection, config_for=_probe_config)


def cmd_explain(args: argparse.Namespace) -> int:
    from .._session.session import new_session
    from ..conversion import describe_transform
    from .inspection import explain

    explanation = explain(args.model, new_session())
    if args.json:
        _print_json(explanation.to_json())
        return EXIT_OK
    plan = explanation.plan
    packs = ", ".join(f"{name} {version}" for name, version in plan.packs) or "none"
    print(f"{explanation.model_class} (model_type {explanation.model_type}); packs: {packs}; plan {plan.fingerprint}")
    rows = []
    for report in explanation.classes:
        claim = report.replaced_by
        rows.append(
            [
                report.name,
                str(report.count),
                f"{claim.patch.replacement.__qualname__} [{claim.pack} {claim.version}]" if claim else "-",
            ]
        )
    print(_table(rows, ["class", "count", "replaced by"]))
    lost = [(report.name, text) for report in explanation.classes for text in report.lost]
    if lost:
        print("\nClaims that lost or are shadowed:")
        for name, text in lost:
            print(f"  {name}: {text}")
    for lost_claim in plan.lost:
        if lost_claim.class_name is None and not any(lost_claim.claim.describe() in text for _, text in lost):
            print(f"  {lost_claim.claim.describe()}: {lost_claim.reason}")
    if plan.refused:
        print("\nClasses a pack found and refused (left as they are):")
        for refused in plan.refused:
            print(f"  {refused.describe()}")
    if explanation.unused:
        print("\nClaims that match no class of this model:")
        for claim in explanation.unused:
            print(f"  {claim.describe()}")
    conversions = plan.conversions
    for key, entries in conversions.lists.items():
        print(f"\nConversions for {key!r} (first matching converter wins):")
        for entry in entries:
            print(f"  {entry.describe()}")
    for removal in conversions.removed:
        print(f"  removed by {removal.pack!r}: {describe_transform(removal.transform)} [transformers]")
    if conversions.lost and not conversions.lists:
        print("\nConverters not applied:")
    for converter, reason in conversions.lost:
        print(f"  not applied: {converter.describe()}: {reason}")
    for warning in explanation.warnings:
        print(f"\nwarning: {warning}")
    return EXIT_OK


@functools.cache
def _probe_config(model_type: str) -> Any:
    """The config check and verify call a pack's hooks with: the model type's tiny config (built
    once per process), else its default config, else ``None``."""
    from transformers.utils import logging as hf_logging

    from .._pipeline.model_types import default_config
    from ..testing import tiny_config

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.CRITICAL)  # some default configs log errors while they are shrunk
    try:
        return tiny_config(model_type)
    except Exception:  # a config that cannot be shrunk (or built) is asked as it is
        return default_config(model_type)
    finally:
        hf_logging.set_verbosity(verbosity)


def _check_model_types(model_types: Sequence[str] | None) -> None:
    from .._pipeline.model_types import unknown_model_type

    for model_type in model_types or ():
        unknown = unknown_model_type(model_type)
        if unknown is not None:
            raise _UsageError(f"--model-type {unknown}")


def cmd_check(args: argparse.Namespace) -> int:
    from .._pipeline.selection import current_selection
    from .._session.session import Session
    from ..errors import HfPatchError
    from .inspection import check_combination, check_pack, write_record

    _check_model_types(args.model_type)
    selection = current_selection(args.packs or None, origin="hfpatch check")
    session = Session(selection, strict=False)
    failed = False
    for error in selection.problems:
        print(f"FAIL  {error}")
        failed = True
    results = []
    for name in sorted(selection.packs):
        result = check_pack(session, name, args.model_type or (), config_for=_probe_config)
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
                    f"{_transformers_version()} in {path}"
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
        problems = check_combination(session, results, config_for=_probe_config)
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


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def cmd_verify(args: argparse.Namespace) -> int:
    from .._pipeline.selection import current_selection
    from .._session.session import Session
    from ..testing import Report, TinyCheckpointError, check_pack_equivalence, tiny_checkpoint
    from .demo import checkpoint_problem
    from .inspection import check_pack

    _check_model_types(args.model_type)
    if args.all_model_types:
        if args.model is not None or args.distributed or args.train_steps:
            raise _UsageError(
                "--all-model-types takes no --model, --distributed or --train: it verifies tiny checkpoints"
            )
        return _verify_every_model_type(args)
    distributed = _distributed_modes(args.distributed)
    if args.model is not None:
        problem = checkpoint_problem(args.model)
        if problem is not None:
            raise _UsageError(f"{problem} (or --model-type TYPE to verify on a tiny random model of that type)")
    selection = current_selection(args.packs or None, origin="hfpatch verify")
    session = Session(selection, strict=False)
    jobs: list[tuple[str, str]] = []
    unverified: dict[str, str] = {str(getattr(error, "pack", "")) or "?": str(error) for error in selection.problems}
    for name in sorted(selection.packs):
        if args.model:
            jobs.append((name, args.model))
            continue
        if args.model_type:
            jobs.extend((name, model_type) for model_type in args.model_type)
            continue
        result = check_pack(session, name, config_for=_probe_config)
        if not result.model_types:
            unverified[name] = "; ".join(result.problems) + " (or --model DIR)"
        jobs.extend((name, model_type) for model_type in result.model_types)
    if distributed:
        return _verify_distributed(jobs, distributed, unverified, args)
    reports: list[Report] = []
    with tempfile.TemporaryDirectory(prefix="hfpatch-verify-") as scratch:
        checkpoints: dict[str, str] = {}
        for index, (name, target) in enumerate(jobs, 1):
            print(f"[{index}/{len(jobs)}] verifying {name} on {target} ...", file=sys.stderr, flush=True)
            try:
                if not args.model and target not in checkpoints:
                    checkpoints[target] = str(tiny_checkpoint(target, os.path.join(scratch, target)))
                report = check_pack_equivalence(
                    name, checkpoints.get(target, target), apply_path=True, train_steps=args.train_steps
                )
            except Exception as exc:  # one model type that cannot be built is a FAIL row, not the end of the run
                message = str(exc) if isinstance(exc, TinyCheckpointError) else f"{type(exc).__name__}: {exc}"
                report = Report(pack=name, model_type=target, failures=[message])
            reports.append(report)
    if args.json:
        _print_json(
            {
                "reports": [report.to_json() for report in reports],
                "unverified": [{"pack": name, "reason": reason} for name, reason in unverified.items()],
            }
        )
    elif reports:
        rows = [
            [
                r.pack,
                r.model_type,
                ", ".join(f"{a}->{b}" for a, b in sorted(r.replaced.items())) or "-",
                "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}",
                {True: "match", False: "DIFFERS", None: "-"}[r.generation_match],
                {True: "ok", False: "FAILED", None: "-"}[r.round_trip],
                {True: "ok", False: "FAILED", None: "-"}[r.apply_path],
                *([_training_cell(r)] if args.train_steps else []),
                "PASS" if r.ok else "FAIL",
            ]
            for r in reports
        ]
        columns = ["pack", "model type", "replaced", "max abs diff", "generation", "round trip", "apply path"]
        print(_table(rows, [*columns, *(["training"] if args.train_steps else []), "verdict"]))
        for report in reports:
            for failure in report.failures:
                print(f"\n{report.pack} on {report.model_type}: {failure}")
    if not args.json:
        for name, reason in unverified.items():
            print(f"\n{name}: not verified: {reason}")
        if not reports and not unverified:
            print("No pack to verify.")
    return EXIT_OK if all(report.ok for report in reports) and not unverified else EXIT_PROBLEMS


def _verify_every_model_type(args: argparse.Namespace) -> int:
    """``verify --all-model-types``: each selected pack on every model type, one verdict each."""
    from .._pipeline.selection import current_selection
    from ..testing.zoo import VERDICTS, ZooRow, coverage, zoo

    selection = current_selection(args.packs or None, origin="hfpatch verify")
    if selection.problems:
        for error in selection.problems:
            print(f"hfpatch: error: {error}", file=sys.stderr)
        return EXIT_PROBLEMS

    def progress(row: ZooRow, number: int, total: int) -> None:
        print(f"[{number}/{total}] {row.pack} on {row.model_type}: {row.verdict}", file=sys.stderr, flush=True)

    rows = [row for name in sorted(selection.packs) for row in zoo(name, args.model_type, progress=progress)]
    if args.json:
        _print_json(
            {
                "rows": [row.to_json() for row in rows],
                "coverage": {name: coverage([r for r in rows if r.pack == name]) for name in sorted(selection.packs)},
            }
        )
    else:
        print(
            _table(
                [[r.pack, r.model_type, r.verdict, r.detail] for r in rows], ["pack", "model type", "verdict", "detail"]
            )
        )
        for name in sorted(selection.packs):
            counts = coverage([r for r in rows if r.pack == name])
            candidates = counts["exact"] + counts["failed"] + counts["refused"]
            summary = ", ".join(f"{counts[verdict]} {verdict}" for verdict in VERDICTS)
            share = f"; exact on {counts['exact']} of {candidates} candidates" if candidates else ""
            print(f"\n{name}: {summary}{share}")
    return EXIT_PROBLEMS if any(row.verdict == "failed" for row in rows) else EXIT_OK


def _distributed_modes(value: str | None) -> list[str]:
    """``--distributed tp,fsdp,ep`` as a list (empty without the option); bad input is a usage error."""
    if value is None:
        return []
    from ..testing.distributed import MODES

    modes = [mode.strip() for mode in value.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise _UsageError(f"--distributed takes parallelisms among {','.join(MODES)}, got {value!r}")
    return list(dict.fromkeys(modes))


def _verify_distributed(
    jobs: list[tuple[str, str]], modes: list[str], unverified: dict[str, str], args: argparse.Namespace
) -> int:
    """``verify --distributed``: one torchrun of 2 ranks per pack and model, a row per parallelism."""
    from ..testing import tiny_checkpoint
    from ..testing.distributed import ModeReport, verify_distributed

    reports: list[ModeReport] = []
    with tempfile.TemporaryDirectory(prefix="hfpatch-verify-") as scratch:
        for index, (name, target) in enumerate(jobs, 1):
            print(f"[{index}/{len(jobs)}] verifying {name} on {target} on 2 ranks ...", file=sys.stderr, flush=True)
            try:
                checkpoint = target if args.model else str(tiny_checkpoint(target, os.path.join(scratch, target)))
                reports.extend(verify_distributed(name, checkpoint, modes, model_type=target))
            except Exception as exc:  # a model type that cannot be built is a FAIL row, not the end of the run
                reports.extend(ModeReport(name, target, mode, "failed", detail=str(exc)) for mode in modes)
    if args.json:
        _print_json(
            {
                "distributed": [report.to_json() for report in reports],
                "unverified": [{"pack": name, "reason": reason} for name, reason in unverified.items()],
            }
        )
    else:
        rows = [
            [
                r.pack,
                r.model_type,
                r.mode,
                r.outcome,
                "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.2e}",
                {True: "match", False: "DIFFERS", None: "-"}[r.generation_match],
                "PASS" if r.ok else "FAIL",
            ]
            for r in reports
        ]
        if rows:
            print(_table(rows, ["pack", "model type", "mode", "outcome", "max abs diff", "generation", "verdict"]))
        for report in reports:
            if report.outcome in ("failed", "refused", "unavailable") and report.detail:
                print(f"\n{report.pack} on {report.model_type}, {report.mode}: {report.outcome}: {report.detail}")
        for name, reason in unverified.items():
            print(f"\n{name}: not verified: {reason}")
    return EXIT_OK if all(report.ok for report in reports) and not unverified else EXIT_PROBLEMS


def _training_cell(report: Any) -> str:
    """``verify --train``'s column: ``ok`` or where training first diverged, for each checkpointing setting."""
    if not report.training:
        return "-"
    if all(training.ok for training in report.training):
        return "ok"
    failed = [training for training in report.training if not training.ok]
    return ", ".join(
        f"DIVERGES at step {training.first_step}{' (checkpointing)' if training.gradient_checkpointing else ''}"
        for training in failed
    )


def cmd_run(args: argparse.Namespace) -> int:
    from .launch import LaunchError, launch

    try:
        launch(args.command)
    except LaunchError as exc:
        raise _UsageError(str(exc)) from None


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    report = run_demo(args.model, args.packs)
    return EXIT_OK if report is None or report.ok else EXIT_PROBLEMS


def cmd_new(args: argparse.Namespace) -> int:
    from .scaffold import new_pack

    try:
        project = new_pack(
            args.name,
            model_type=args.model_type,
            target=args.target,
            no_input=args.no_input,
            output_dir=args.output_dir,
        )
    except EOFError:
        print()
        raise _UsageError("standard input ended before every question was answered; pass --no-input") from None
    relative = os.path.relpath(project)
    shown = str(project) if relative.startswith("..") else relative
    print(f"Created {shown}. Next:")
    print(f"  cd {shown}")
    print('  pip install -e ".[test]"   # the pack, hfpatch-core, transformers, torch and pytest')
    print("                             # (hfpatch-core not on your index: add --find-links, see README.md)")
    print("  pytest                     # the generated equivalence test")
    return EXIT_OK


class _UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfpatch",
        description="List, explain, check and run 🤗 Transformers patch packs.",
        epilog="Exit codes: 0 ok, 1 problems found, 2 bad input. HF_PATCH_PACKS chooses the packs.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    listing = commands.add_parser("list", help="installed packs and whether they are enabled")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.add_argument(
        "--no-conflicts",
        action="store_true",
        help="read metadata only: do not import the enabled packs to find the model types they conflict on",
    )
    listing.set_defaults(handler=cmd_list)

    explaining = commands.add_parser("explain", help="what the enabled packs would replace in a model")
    explaining.add_argument("model", help="a local checkpoint directory or a model_type")
    explaining.add_argument("--json", action="store_true", help="machine-readable output")
    explaining.set_defaults(handler=cmd_explain)

    checking = commands.add_parser("check", help="import packs and validate what their hooks return")
    checking.add_argument("packs", nargs="*", metavar="PACK", help="packs to check (default: all installed)")
    checking.add_argument(
        "--model-type",
        action="append",
        metavar="TYPE",
        help="check on these model types (repeatable) instead of those the pack claims when asked without a config",
    )
    checking.add_argument(
        "--record",
        action="store_true",
        help="add the installed transformers release to each passing pack's drift record (beside its module)",
    )
    checking.set_defaults(handler=cmd_check)

    verifying = commands.add_parser("verify", help="prove packs keep models correct on tiny checkpoints")
    verifying.add_argument("packs", nargs="*", metavar="PACK", help="packs to verify (default: all installed)")
    verifying.add_argument("--model-type", action="append", help="model types to verify on (repeatable)")
    verifying.add_argument("--model", help="a local checkpoint directory to verify on")
    verifying.add_argument(
        "--all-model-types",
        action="store_true",
        help="verify on a tiny checkpoint of every causal-LM model type (or of each --model-type): one verdict each "
        "(exact, failed, refused, not applicable, no checkpoint), the coverage table of docs/zoo.md",
    )
    verifying.add_argument("--json", action="store_true", help="machine-readable output")
    verifying.add_argument(
        "--distributed",
        metavar="MODES",
        help="also shard as transformers does on 2 local ranks (torchrun, gloo): tp,fsdp,ep",
    )
    verifying.add_argument(
        "--train",
        dest="train_steps",
        action="store_const",
        const=5,
        default=0,
        help="also train with and without each pack for 5 AdamW steps and compare losses, gradients and weights",
    )
    verifying.set_defaults(handler=cmd_verify)

    demo = commands.add_parser("demo", help="load a tiny model with and without packs and compare")
    demo.add_argument("--model", help="a local checkpoint directory (default: a tiny random Qwen2-MoE)")
    demo.add_argument(
        "--packs",
        metavar="SPEC",
        help="the packs, as HF_PATCH_PACKS writes them (default: HF_PATCH_PACKS; when it is unset, qwen-moe, "
        "else the built-in example)",
    )
    demo.set_defaults(handler=cmd_demo)

    creating = commands.add_parser("new", help="create a pack project from the template")
    creating.add_argument("name", nargs="?", help="the pack's name, what HF_PATCH_PACKS selects (default: my-pack)")
    creating.add_argument(
        "--model-type", metavar="TYPE", help="config.model_type the example patch applies to (default: llama)"
    )
    creating.add_argument(
        "--target", metavar="CLASS", help="the transformers class to replace (default: the model type's MLP class)"
    )
    creating.add_argument("--no-input", action="store_true", help="ask nothing: use the values given and the defaults")
    creating.add_argument(
        "-o", "--output-dir", default=".", metavar="DIR", help="where to create the project (default: .)"
    )
    creating.set_defaults(handler=cmd_new)

    running = commands.add_parser(
        "run",
        help="run a program (and its children) with hfpatch enabled",
        description="Run CMD with hfpatch enabled in it and in every Python process it starts. "
        "'python' or 'python3' as CMD is this environment's interpreter (" + sys.executable + "), not the "
        "first Python on PATH; in a virtual environment, CMD's PATH starts with the environment's scripts "
        "directory, as if it were activated, so 'python' and 'hfpatch' in CMD's children are this environment's.",
        usage="hfpatch run -- CMD [ARG ...]",
    )
    running.add_argument("command", nargs=argparse.REMAINDER, help="-- program and arguments")
    running.set_defaults(handler=cmd_run)
    return parser


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A warning as one line, ``hfpatch: warning: ...``: where in hfpatch's code it was raised
    (``sys.exit(main())``, for a pack's) tells a command-line user nothing."""
    from ..errors import PackWarning

    kind = "" if issubclass(category, PackWarning | UserWarning) else f"{category.__name__}: "
    stream = sys.stderr if file is None else file
    with contextlib.suppress(OSError):  # as warnings' own: a warning never stops the command
        stream.write(f"hfpatch: warning: {kind}{message}\n")


@contextlib.contextmanager
def _without_progress_bars() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", for every tiny model a command loads)
    off while the command runs: they bury its output on stderr and say nothing of the packs."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


#: The commands that load models: transformers' progress bars are off while they run.
_LOADING_COMMANDS = frozenset({"verify", "demo", "explain"})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            # installed here, by the command, never on import: a program using the library keeps its own
            warnings.showwarning = _show_warning
            if args.command_name in _LOADING_COMMANDS:
                stack.enter_context(_without_progress_bars())
            code: int = args.handler(args)
        sys.stdout.flush()  # here, so that a reader gone away is caught below and not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # what is left to write goes nowhere, quietly, as for a program killed by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        from ..errors import HfPatchError

        if args.debug:
            raise
        if isinstance(exc, _UsageError | HfPatchError | OSError | ValueError):
            print(f"hfpatch: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"hfpatch: error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
