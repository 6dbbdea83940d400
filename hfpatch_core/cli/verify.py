"""``hfpatch verify``: packs proven on tiny checkpoints (or a checkpoint), one row per pack and model."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from .._session.session import Session
from . import EXIT_OK, EXIT_PROBLEMS
from .output import UsageError, print_json, table


def cmd_verify(args: argparse.Namespace) -> int:
    from .._pipeline.selection import current_selection
    from ..testing import Report, TinyCheckpointError, check_pack_equivalence, tiny_checkpoint
    from .check import check_model_types, check_pack, probe_config
    from .demo import checkpoint_problem

    check_model_types(args.model_type)
    if args.all_model_types:
        if args.model is not None or args.distributed or args.train_steps:
            raise UsageError(
                "--all-model-types takes no --model, --distributed or --train: it verifies tiny checkpoints"
            )
        return _verify_every_model_type(args)
    distributed = _distributed_modes(args.distributed)
    if args.model is not None:
        problem = checkpoint_problem(args.model)
        if problem is not None:
            raise UsageError(f"{problem} (or --model-type TYPE to verify on a tiny random model of that type)")
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
        result = check_pack(session, name, config_for=probe_config)
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
        print_json(
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
        print(table(rows, [*columns, *(["training"] if args.train_steps else []), "verdict"]))
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
        print_json(
            {
                "rows": [row.to_json() for row in rows],
                "coverage": {name: coverage([r for r in rows if r.pack == name]) for name in sorted(selection.packs)},
            }
        )
    else:
        print(
            table(
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
        raise UsageError(f"--distributed takes parallelisms among {','.join(MODES)}, got {value!r}")
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
        print_json(
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
            print(table(rows, ["pack", "model type", "mode", "outcome", "max abs diff", "generation", "verdict"]))
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
