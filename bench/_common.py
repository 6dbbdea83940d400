"""Helpers shared by the benchmark scripts: timing, medians, tables, machine info.

Every script measures its variants *interleaved* (one sample of each variant per round,
the order rotated from round to round), so that a slow phase of the machine (another
process, a frequency change, the page cache warming up) hits every variant alike, and
reports the median of the rounds.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def use_test_helpers() -> None:
    """Make ``tests/packs.py`` importable (it writes real pack distributions)."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def commit_description() -> str:
    """The checkout's short commit, and whether tracked files differ from it: what a written table was run at."""

    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], capture_output=True, text=True, cwd=REPO, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(*, torch_and_transformers: bool = True) -> list[str]:
    """One line per fact: CPU, Python, and (optionally) torch / transformers versions."""
    lines = [
        f"machine: {cpu_model()}, os.cpu_count()={os.cpu_count()}, "
        f"sched_getaffinity={len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}",
        f"python: {platform.python_version()} ({sys.executable})",
        f"platform: {platform.platform()}",
    ]
    if torch_and_transformers:
        import torch
        import transformers

        lines.append(
            f"torch: {torch.__version__} (threads {torch.get_num_threads()}), transformers: {transformers.__version__}"
        )
    import importlib.metadata

    try:
        lines.append(f"hfpatch-core: {importlib.metadata.version('hfpatch-core')}")
    except importlib.metadata.PackageNotFoundError:
        lines.append("hfpatch-core: not installed")
    return lines


def interleaved(
    variants: Mapping[str, Callable[[], float]], rounds: int, *, collect: bool = True
) -> dict[str, list[float]]:
    """Run each variant once per round, the order rotated each round.

    A variant returns the seconds it measured itself, so that set-up and checks it does
    around the measured region are left out.
    """
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if collect:
                gc.collect()
            samples[name].append(variants[name]())
    return samples


def timed(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def repeat(function: Callable[[], object], count: int) -> list[float]:
    """``count`` timings of ``function``, back to back (for sub-millisecond work)."""
    return [timed(function) for _ in range(count)]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def spread(samples: Sequence[float]) -> str:
    """Interquartile range as ``q1..q3`` in ms, to show how noisy a median is."""
    if len(samples) < 4:
        return "-"
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return f"{q1 * 1e3:.2f}..{q3 * 1e3:.2f}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def verdict(value: float, goal: float) -> str:
    return "met" if value <= goal else "MISSED"


def ratio_interval(top: Sequence[float], bottom: Sequence[float], *, iterations: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of ``median(top) / median(bottom)`` (each resampled on its own)."""
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(top, k=len(top))) / statistics.median(rng.choices(bottom, k=len(bottom)))
        for _ in range(iterations)
    )
    return ratios[int(0.025 * iterations)], ratios[int(0.975 * iterations) - 1]


def ratio_verdict(top: Sequence[float], bottom: Sequence[float], goal: float) -> str:
    """``met`` / ``MISSED`` when the whole interval is on one side of the goal, else ``within noise``."""
    low, high = ratio_interval(top, bottom)
    ratio = median(top) / median(bottom)
    if high <= goal:
        return "met"
    if low > goal:
        return "MISSED"
    return f"{'met' if ratio <= goal else 'missed'} by the median, within noise"


def paired_ratio_interval(
    top: Sequence[float], bottom: Sequence[float], *, iterations: int = 2000
) -> tuple[float, float, float]:
    """The median of the per-round ratios ``top[i] / bottom[i]`` and its 95% bootstrap interval.

    ``interleaved`` samples each variant once per round, so round ``i`` of both saw the
    same phase of the machine: the ratio within a round cancels a slow phase that the
    unpaired interval (``ratio_interval``) counts as noise, and on a shared host decides
    with far fewer rounds."""
    ratios = [a / b for a, b in zip(top, bottom, strict=True)]
    rng = random.Random(0)
    resampled = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(iterations))
    return statistics.median(ratios), resampled[int(0.025 * iterations)], resampled[int(0.975 * iterations) - 1]


def paired_verdict(top: Sequence[float], bottom: Sequence[float], goal: float) -> str:
    """``met`` / ``MISSED`` when the paired interval is on one side of the goal, else ``within noise``."""
    ratio, low, high = paired_ratio_interval(top, bottom)
    if high <= goal:
        return "met"
    if low > goal:
        return "MISSED"
    return f"{'met' if ratio <= goal else 'missed'} by the median, within noise"


def describe_paired(top: Sequence[float], bottom: Sequence[float]) -> str:
    ratio, low, high = paired_ratio_interval(top, bottom)
    return f"{ratio:.3f} (95% CI {low:.3f}..{high:.3f})"


def describe_ratio(top: Sequence[float], bottom: Sequence[float]) -> str:
    low, high = ratio_interval(top, bottom)
    difference = (median(top) - median(bottom)) * 1e3
    return f"{median(top) / median(bottom):.3f} (95% CI {low:.3f}..{high:.3f}; {difference:+.2f} ms)"


def load_causal_lm(path: Path, packs: str | None) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)`` in fp32, eval mode; with ``packs`` (strict) when given."""
    from transformers import AutoModelForCausalLM

    import hfpatch_core

    if packs is not None:
        hfpatch_core.enable(packs, strict=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    finally:
        hfpatch_core.disable()
    return model.eval()
