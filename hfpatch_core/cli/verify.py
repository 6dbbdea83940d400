"""``hfpatch verify``: packs proven on tiny checkpoints (or a checkpoint), one row per pack and model."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .exit_codes import EXIT_OK, EXIT_PROBLEMS
from .output import UsageError, print_json, quiet_transformers, table


def cmd_verify(args: argparse.Namespace) -> int:
    from .._pipeline.selection import current_selection
    from .demo import checkpoint_problem
    from .inputs import check_model_types

    check_model_types(args.model_type)
    dtype = _dtype(args.dtype)
    if args.all_model_types and (args.model is not None or args.distributed):
        raise UsageError("--all-model-types takes no --model or --distributed: it verifies tiny checkpoints")
    if args.jobs is not None and not args.all_model_types:
        raise UsageError("--jobs sets the worker processes of --all-model-types: add it, or leave --jobs out")
    distributed = _distributed_modes(args.distributed)
    if distributed and (args.train_steps or dtype is not None):
        raise UsageError("--distributed takes no --train or --dtype: it compares float32 logits across ranks")
    if args.model is not None:
        problem = checkpoint_problem(args.model)
        if problem is not None:
            raise UsageError(f"{problem} (or --model-type TYPE to verify on a tiny random model of that type)")
    selection = current_selection(args.packs or None, origin="hfpatch verify")
    if args.all_model_types:
        return _verify_every_model_type(args, selection, dtype)
    jobs: list[tuple[str, str]] = []
    unverified: dict[str, str] = {str(getattr(error, "pack", "")) or "?": str(error) for error in selection.problems}
    for name in sorted(selection.packs):
        if args.model:
            jobs.append((name, args.model))
            continue
        if args.model_type:
            jobs.extend((name, model_type) for model_type in args.model_type)
            continue
        result = _targets(selection, name)
        if not result.model_types:
            unverified[name] = "; ".join(result.problems) + " (or --model DIR)"
        jobs.extend((name, model_type) for model_type in result.model_types)
    if distributed:
        with contextlib.redirect_stdout(sys.stderr):  # as in _verdicts: stdout holds the table or the JSON only
            outcome = _distributed_outcome(_run(jobs, args, _on_two_ranks(modes=distributed)), unverified)
    else:
        outcome = _verdict_outcome(_verdicts(jobs, args, dtype), unverified, args.train_steps)
    if args.json:
        print_json(outcome.to_json())
    else:
        print(outcome.text())
    return EXIT_OK if outcome.ok else EXIT_PROBLEMS


def _targets(selection: Any, name: str) -> Any:
    """``check_pack`` of pack ``name``: the model types it targets (its problems when none). Here: it
    imports torch and transformers, which a cached sweep never needs."""
    from .._pipeline.checking import check_pack
    from .probes import hook_guard, probe_config

    return check_pack(selection, name, guard=hook_guard(), config_for=probe_config)


def _dtype(name: str | None) -> Any:
    """``--dtype``'s torch dtype (``None``: float32, the default everywhere)."""
    if name is None or name == "float32":
        return None
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one ``hfpatch verify`` run found, computed before anything is shown.

    Attributes:
        key: the JSON key of the rows (``reports``, or ``distributed`` for ``--distributed``).
        header: the table's columns.
        rows: one table row per report.
        details: a line per failure (or refusal) the table cannot hold.
        records: the reports as JSON.
        unverified: the packs that could not be verified, with the reason.
        ok: every report passed and every pack was verified.
    """

    key: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    details: tuple[str, ...]
    records: tuple[dict[str, Any], ...]
    unverified: Mapping[str, str]
    ok: bool

    @classmethod
    def of(
        cls,
        key: str,
        reports: Sequence[Any],
        header: tuple[str, ...],
        rows: tuple[tuple[str, ...], ...],
        details: tuple[str, ...],
        unverified: Mapping[str, str],
    ) -> Outcome:
        """The outcome of ``reports`` (each with ``ok`` and ``to_json()``), shown as ``rows``."""
        records = tuple(report.to_json() for report in reports)
        return cls(key, header, rows, details, records, unverified, all(r.ok for r in reports) and not unverified)

    def to_json(self) -> dict[str, Any]:
        return {
            self.key: list(self.records),
            "unverified": [{"pack": name, "reason": reason} for name, reason in self.unverified.items()],
        }

    def text(self) -> str:
        parts = [table(self.rows, self.header)] if self.rows else []
        parts += [f"\n{line}" for line in self.details]
        parts += [f"\n{name}: not verified: {reason}" for name, reason in self.unverified.items()]
        return "\n".join(parts) if parts else "No pack to verify."


@dataclasses.dataclass(frozen=True)
class _Verifier:
    """How a verify run proves a pack on one checkpoint (``verify(pack, checkpoint, model type)``), the
    rows of a model it could not build (``failed(pack, model type, message)``), and where it runs."""

    verify: Callable[[str, str, str], list[Any]]
    failed: Callable[[str, str, str], list[Any]]
    where: str = ""


def _run(jobs: Sequence[tuple[str, str]], args: argparse.Namespace, verifier: _Verifier) -> list[Any]:
    """Run ``verifier`` on every (pack, model) job with progress on stderr; a model type whose tiny
    checkpoint cannot be built is a failed row, not the end of the run."""
    from ..testing import TinyCheckpointError, tiny_checkpoint

    reports: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="hfpatch-verify-") as scratch:
        checkpoints: dict[str, str] = {}
        for index, (name, target) in enumerate(jobs, 1):
            print(
                f"[{index}/{len(jobs)}] verifying {name} on {target}{verifier.where} ...", file=sys.stderr, flush=True
            )
            try:
                if not args.model and target not in checkpoints:
                    checkpoints[target] = str(tiny_checkpoint(target, os.path.join(scratch, target)))
                reports.extend(verifier.verify(name, checkpoints.get(target, target), target))
            except Exception as exc:
                message = str(exc) if isinstance(exc, TinyCheckpointError) else f"{type(exc).__name__}: {exc}"
                reports.extend(verifier.failed(name, target, message))
    return reports


def _verdicts(jobs: Sequence[tuple[str, str]], args: argparse.Namespace, dtype: Any) -> list[Any]:
    """One verdict per (pack, model) job (``testing.zoo.verdict_of``: the zoo's), progress on stderr."""
    from ..testing.zoo import verdict_of

    rows: list[Any] = []
    with (
        tempfile.TemporaryDirectory(prefix="hfpatch-verify-") as scratch,
        quiet_transformers(),
        contextlib.redirect_stdout(sys.stderr),  # as in _verify_every_model_type
    ):
        for index, (name, target) in enumerate(jobs, 1):
            print(f"[{index}/{len(jobs)}] verifying {name} on {target} ...", file=sys.stderr, flush=True)
            checkpoint = Path(target) if args.model else None
            model_type = _model_type_of(checkpoint) if checkpoint is not None else target
            row = verdict_of(
                name,
                model_type,
                Path(scratch) / name,
                checkpoint=checkpoint,
                dtype=dtype,
                train_steps=args.train_steps,
                generate_tokens=20,
            )
            rows.append(row)
            print(f"[{index}/{len(jobs)}] {name} on {model_type}: {row.verdict}", file=sys.stderr, flush=True)
    return rows


def _model_type_of(checkpoint: Path) -> str:
    import json

    try:
        return str(json.loads((checkpoint / "config.json").read_text()).get("model_type", checkpoint.name))
    except (OSError, ValueError):
        return checkpoint.name


def _on_two_ranks(modes: Sequence[str]) -> _Verifier:
    from ..testing.distributed import ModeReport, verify_distributed

    def verify(name: str, checkpoint: str, target: str) -> list[Any]:
        return list(verify_distributed(name, checkpoint, list(modes), model_type=target))

    def failed(name: str, target: str, message: str) -> list[Any]:
        return [ModeReport(name, target, mode, "failed", detail=message) for mode in modes]

    return _Verifier(verify, failed, " on 2 ranks")


_MATCH = {True: "match", False: "DIFFERS", None: "-"}
_DONE = {True: "ok", False: "FAILED", None: "-"}


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _verdict_outcome(rows: Sequence[Any], unverified: Mapping[str, str], train_steps: int) -> Outcome:
    """The table of verdicts: the checks' measurements where the pack changed the model, the verdict (a
    refusal with its reasons), and under the table each failure and missing checkpoint with its reason."""
    table_rows = []
    for row in rows:
        # measurements only where the pack changed the model: a refused (or not applicable) pack replaced
        # nothing, so its load equals vanilla's trivially and "0.00e+00 match ok ok" would read as a pass
        r = row.report if row.verdict in _MEASURED else None
        cells = (
            (
                ", ".join([*(f"{a}->{b}" for a, b in sorted(r.replaced.items())), *(f"step {s}" for s in r.steps)])
                or "-",
                _diff(r.max_abs_diff),
                _MATCH[r.generation_match],
                _DONE[r.round_trip],
                _DONE[r.apply_path],
                *((_training_cell(r),) if train_steps else ()),
            )
            if r is not None
            else ("-",) * (6 if train_steps else 5)
        )
        verified = row.verified if row.verified and not row.verified.endswith(f"({row.model_type})") else ""
        label = f"{row.model_type} as {verified}" if verified else row.model_type
        verdict = _VERDICT[row.verdict]
        table_rows.append(
            (row.pack, label, *cells, f"{verdict}: {row.detail}" if row.verdict == "refused" else verdict)
        )
    header = (
        "pack",
        "model type",
        "replaced",
        "max abs diff",
        "generation",
        "round trip",
        "apply path",
        *(("training",) if train_steps else ()),
        "verdict",
    )
    details: list[str] = []
    for row in rows:
        failures = row.report.failures if row.verdict == "failed" and row.report is not None else [row.detail]
        if row.verdict in ("failed", "no checkpoint"):
            details += [f"{row.pack} on {row.model_type}: {row.verdict}: {failure}" for failure in failures]
    return Outcome.of("rows", rows, header, tuple(table_rows), tuple(details), unverified)


#: The verdicts whose rows show the checks' measurements: the pack replaced something (or its load failed).
_MEASURED = frozenset({"exact", "failed"})

#: How the table writes each verdict: a failure stands out; a refusal is followed by its reasons.
_VERDICT = {
    "exact": "exact",
    "failed": "FAILED",
    "refused": "refused",
    "not applicable": "not applicable",
    "no checkpoint": "no checkpoint",
}


def _distributed_outcome(reports: Sequence[Any], unverified: Mapping[str, str]) -> Outcome:
    rows = tuple(
        (
            r.pack,
            r.model_type,
            r.mode,
            r.outcome,
            _diff(r.max_abs_diff),
            _MATCH[r.generation_match],
            "PASS" if r.ok else "FAIL",
        )
        for r in reports
    )
    header = ("pack", "model type", "mode", "outcome", "max abs diff", "generation", "verdict")
    details = tuple(
        f"{r.pack} on {r.model_type}, {r.mode}: {r.outcome}: {r.detail}"
        for r in reports
        if r.outcome in ("failed", "refused", "unavailable") and r.detail
    )
    return Outcome.of("distributed", reports, header, rows, details, unverified)


def _verify_every_model_type(args: argparse.Namespace, selection: Any, dtype: Any) -> int:
    """``verify --all-model-types``: each selected pack on every model type, one verdict each
    (``testing.zoo.sweep``: one tiny checkpoint per model type for every pack, ``--jobs``
    worker processes), a (pack, model type) verified before under the same versions read from
    the cache (``_sweep_caches``)."""
    import time

    from ..testing.zoo import VERDICTS, ZooRow, coverage, sweep

    if selection.problems:
        for error in selection.problems:
            print(f"hfpatch: error: {error}", file=sys.stderr)
        return EXIT_PROBLEMS
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs takes a number of worker processes, at least 1, got {args.jobs}")
    packs = sorted(selection.packs)
    dtype_name = args.dtype or "float32"
    model_types = list(dict.fromkeys(args.model_type or _zoo_model_types()))
    # a worker imports torch and transformers (seconds): for a few model types one process is faster
    jobs = args.jobs if args.jobs is not None else 2 if len(model_types) >= _WORKERS_FROM else 1
    caches = _sweep_caches(packs, dtype_name)
    known = {
        name: {model_type: _cached_row(row) for model_type in model_types if (row := cache.get(model_type))}
        for name, cache in caches.items()
    }
    start = time.perf_counter()

    def progress(rows: Sequence[ZooRow], number: int, total: int) -> None:
        for row in rows:
            cached = row.model_type in known.get(row.pack, {})
            if not cached:
                caches[row.pack].put(row.model_type, row.to_json())
            print(
                f"[{number}/{total}] {row.pack} on {row.model_type}: {row.verdict}"
                f"{' (cached)' if cached else f' ({row.seconds:.1f} s)'}",
                file=sys.stderr,
                flush=True,
            )

    cached = sum(len(rows) for rows in known.values())
    if cached:
        print(f"hfpatch: {cached} verdicts from the cache (--no-cache verifies again)", file=sys.stderr, flush=True)
    # some models print from their forward or generation (reformer): stdout holds the table or the JSON only
    with quiet_transformers(), contextlib.redirect_stdout(sys.stderr):
        rows = sweep(packs, model_types, dtype=dtype_name, jobs=jobs, known=known, progress=progress)
    print(f"hfpatch: verified in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if args.json:
        print_json(
            {
                "rows": [row.to_json() for row in rows],
                "coverage": {name: coverage([r for r in rows if r.pack == name]) for name in packs},
            }
        )
    else:
        # the detail is the last column and is written whole (a refusal's reason is the answer)
        print(
            table(
                [[r.pack, r.model_type, r.verdict, r.detail] for r in rows], ["pack", "model type", "verdict", "detail"]
            )
        )
        for name in packs:
            counts = coverage([r for r in rows if r.pack == name])
            candidates = counts["exact"] + counts["failed"] + counts["refused"]
            summary = ", ".join(f"{counts[verdict]} {verdict}" for verdict in VERDICTS)
            share = f"; exact on {counts['exact']} of {candidates} candidates" if candidates else ""
            print(f"\n{name}: {summary}{share}")
    return EXIT_PROBLEMS if any(row.verdict == "failed" for row in rows) else EXIT_OK


#: From how many model types ``verify --all-model-types`` verifies in two worker processes by default.
_WORKERS_FROM = 8


class _StoredReport(dict[str, Any]):
    """A cached row's report, as its JSON: ``verify --json`` writes it back as it was."""

    def to_json(self) -> dict[str, Any]:
        return dict(self)


def _cached_row(data: Mapping[str, Any]) -> Any:
    from ..testing.zoo import ZooRow

    row = ZooRow.from_json(data)
    report = data.get("report")
    return dataclasses.replace(row, report=_StoredReport(report)) if isinstance(report, dict) else row


def _zoo_model_types() -> list[str]:
    """``testing.zoo.zoo_model_types``, kept in the cache by transformers' version: a run whose
    verdicts are all cached imports neither torch nor transformers' modeling code."""
    from .._pipeline.selection import installed_transformers_version
    from .cache import Cache

    def names() -> list[str]:
        from ..testing.zoo import zoo_model_types

        return zoo_model_types()

    cache = Cache("zoo-model-types", {"transformers": installed_transformers_version()})
    return list(cache.value("names", names))


def _sweep_caches(packs: Sequence[str], dtype: str) -> dict[str, Any]:
    """One cache of verdicts per pack (``cli.cache``): valid while the pack's distribution (name,
    version, a hash of its installed files), transformers, torch and hfpatch-core (version and
    files) are those that verified it, so a re-run verifies only what changed."""
    import importlib_metadata

    from .cache import Cache, environment_key

    environment = environment_key()
    caches = {}
    for name in packs:
        key = {
            **{field: value for field, value in environment.items() if field != "packs"},
            "torch": importlib_metadata.version("torch"),
            "dtype": dtype,
            "pack": [entry for entry in environment["packs"] if entry[0] == name],
        }
        caches[name] = Cache(f"verify-{name}-{dtype}", key)
    return caches


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
