"""Wall time of the ``hfpatch`` commands a new user waits on, cold and warm cache, in one run.

Every command runs in a fresh process (as from a shell), with the packs the environment
selects (the four first-party ones with ``PYTHONPATH=.venv/first-party-packs`` and
``HF_PATCH_PACKS`` unset), and ``HF_PATCH_CACHE`` a temporary directory: *cold* is its first
run there (nothing cached: transformers and the packs imported, the model types planned),
*warm* a later one (median of ``--rounds``).  Measured:

* ``hfpatch list`` (with two or more packs enabled it finds their conflicts);
* ``hfpatch lock`` and ``hfpatch lock --check`` (cold: ``--no-cache``);
* ``hfpatch explain`` with bad input: an unknown model type (its names cached per transformers
  version, so cold imports transformers once), a pack that is not installed, a ``--model``
  that does not exist;
* ``hfpatch check`` and ``check --record`` of the project ``hfpatch new --structural`` generates
  (installed with ``pip install --no-deps --target``): a pack that declares no model type, asked
  with a tiny config of every model type (cold: nothing cached; warm: its answers cached);
* ``hfpatch verify fused-dense --all-model-types``: the full sweep (cold: no verdict cached);
* where a new user first meets the command (``--only first``, issue 52.5), each cold run with a cache
  of its own (a new process, nothing cached): ``hfpatch list`` with every first-party pack enabled,
  ``hfpatch explain CHECKPOINT`` (a tiny Qwen2-MoE checkpoint saved by ``testing.tiny_checkpoint``),
  ``hfpatch verify qwen-moe --model-type llama`` ("not applicable") and ``hfpatch check`` of every
  first-party pack.

Goals: ``list`` and ``lock --check`` under 5 s warm, bad input reported in well under a second
warm (issue 40); ``check`` of the structural project at most 60 s (issues 44.5, 46.7); cold, on a
fresh cache: ``list`` <= 10 s, ``explain CHECKPOINT`` <= 15 s, a not-applicable verdict <= 10 s,
``check`` of every first-party pack <= 3 min (issue 52.5; the ratio to the goal is printed).  Also
whether each run imported transformers (``python -X importtime``), and the CPU time (user +
system) of each run beside its wall time: on a shared machine the wall time is the load's.

    PYTHONPATH=.venv/first-party-packs .venv/bin/python bench/cli_timings.py  # ~8-12 min cold; --rounds
    .venv/bin/python bench/cli_timings.py --only check                        # the structural project only
    .venv/bin/python bench/cli_timings.py --only verify                       # the full sweep of fused-dense
    PYTHONPATH=.venv/first-party-packs .venv/bin/python bench/cli_timings.py --only first --rounds 1  # 52.5
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, machine_info, table, verdict

HFPATCH = str(Path(sys.executable).with_name("hfpatch"))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(args: list[str], cache: Path, lock_dir: Path, **env: str) -> tuple[float, int, bool, float]:
    """Seconds, exit code, whether transformers was imported, and CPU seconds, of ``hfpatch ARGS``."""
    # the commands run in a scratch directory: PYTHONPATH entries are made absolute first
    path = os.pathsep.join(
        os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry
    )
    environment = {**os.environ, "PYTHONPATH": path, "HF_PATCH_CACHE": str(cache), "USE_HUB_KERNELS": "0", **env}
    started, cpu = time.perf_counter(), _children_cpu()
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", HFPATCH, *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=lock_dir,
        check=False,
    )
    elapsed, cpu = time.perf_counter() - started, _children_cpu() - cpu
    # -X importtime: "import time: self | cumulative | <indent>module", one line per module imported
    imported = any(
        line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == "transformers"
        for line in completed.stderr.splitlines()
    )
    return elapsed, completed.returncode, imported, cpu


#: issue 40's goals for the warm runs: list and lock --check under 5 s, bad input under a second
_GOALS = {"list": 5.0, "lock --check": 5.0, "explain": 1.0, "lock --model": 1.0}
#: issues 44.5 and 46.7: check (and check --record) of a structural pack at most 60 s, cold included
_CHECK_GOAL = 60.0
#: issue 46.7: the full sweep of one pack over every model type at most 8 minutes, cold included
_SWEEP_GOAL = 480.0
#: issue 52.5: the cold runs (a fresh cache each) where a new user first meets the commands
_FIRST_GOALS = {"first: list": 10.0, "first: explain": 15.0, "first: verify": 10.0, "first: check": 180.0}


def _goal(row: list[str]) -> str:
    for prefix, limit in _FIRST_GOALS.items():
        if row[0].startswith(prefix):
            cold = float(row[1])
            return f"cold <= {limit:g} s: {cold / limit:.2f} of it, {verdict(cold, limit)}"
    for prefix, limit in (("check", _CHECK_GOAL), ("verify", _SWEEP_GOAL)):
        if row[0].startswith(prefix):
            cold, warm = float(row[1]), float(row[4])
            return f"<= {limit:g} s: cold {verdict(cold, limit)}, warm {verdict(warm, limit)}"
    for prefix, goal in _GOALS.items():
        if row[0].startswith(prefix):
            return f"< {goal:g} s: {verdict(float(row[4]), goal)}"
    return "-"


def _structural_project(work: Path) -> tuple[str, Path]:
    """``hfpatch new bench-norms --structural --no-input``, installed into ``work/site``: its pack name and site."""
    name = "bench-norms"
    subprocess.run([HFPATCH, "new", name, "--structural", "--no-input", "-o", str(work / "projects")], check=True)
    project = work / "projects" / f"hfpatch-pack-{name}"
    install = ["install", "--no-deps", "--no-build-isolation", "--disable-pip-version-check", "-q"]
    subprocess.run([sys.executable, "-m", "pip", *install, "--target", str(work / "site"), str(project)], check=True)
    return name, work / "site"


def _checkpoint(work: Path) -> Path:
    """A tiny random Qwen2-MoE checkpoint in ``work`` (built in a child process: this one stays light)."""
    directory = work / "tiny-qwen2-moe"
    code = "import sys; from hfpatch_core.testing import tiny_checkpoint; tiny_checkpoint('qwen2_moe', sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, env={**os.environ, "USE_HUB_KERNELS": "0"})
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="warm runs per command (median)")
    parser.add_argument("--only", help="measure only the commands whose name starts with this (e.g. check)")
    options = parser.parse_args()
    for line in machine_info(torch_and_transformers=False):
        print(line)
    packs = subprocess.run([HFPATCH, "--version"], capture_output=True, text=True, check=True).stdout
    print(packs.strip())
    print(f"HF_PATCH_PACKS={os.environ.get('HF_PATCH_PACKS', '<unset>')}\n")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        cache, here = Path(work) / "cache", Path(work)
        lock = str(here / "hfpatch.lock")

        def measure(
            name: str, args: list[str], cold_args: list[str] | None = None, *, fresh: bool = False, **env: str
        ) -> None:
            if options.only and not name.startswith(options.only):
                return
            # fresh: a cache of its own, so that the cold run finds nothing another command kept
            where = Path(tempfile.mkdtemp(dir=work, prefix="cache-")) if fresh else cache
            cold = timed(cold_args or args, where, here, **env)
            print(f"  {name}: cold {cold[0]:.1f} s, cpu {cold[3]:.1f} s (exit {cold[1]})", file=sys.stderr, flush=True)
            samples = [timed(args, where, here, **env) for _ in range(options.rounds)]
            median = statistics.median(sample[0] for sample in samples)
            median_cpu = statistics.median(sample[3] for sample in samples)
            codes = "/".join(sorted({str(cold[1]), *(str(sample[1]) for sample in samples)}))
            warm_imports = "yes" if any(sample[2] for sample in samples) else "no"
            rows.append(
                [
                    name,
                    f"{cold[0]:.2f}",
                    f"{cold[3]:.2f}",
                    "yes" if cold[2] else "no",
                    f"{median:.2f}",
                    f"{median_cpu:.2f}",
                    warm_imports,
                    codes,
                ]
            )

        if not options.only or options.only.startswith("first") or "first".startswith(options.only):
            # issue 52.5: every first-party pack enabled (HF_PATCH_PACKS unset), each cold run on a fresh cache
            checkpoint = _checkpoint(here)
            measure("first: list", ["list"], fresh=True)
            measure("first: explain CHECKPOINT (tiny qwen2_moe)", ["explain", str(checkpoint)], fresh=True)
            measure(
                "first: verify qwen-moe --model-type llama (not applicable)",
                ["verify", "qwen-moe", "--model-type", "llama"],
                fresh=True,
            )
            measure("first: check (every first-party pack)", ["check"], fresh=True)
        # bad input first, while nothing is cached: the cold column is a new user's first run
        measure("explain lama (unknown model type)", ["explain", "lama"])
        measure("explain llama, HF_PATCH_PACKS=nosuch", ["explain", "llama"], HF_PATCH_PACKS="nosuch")
        measure("lock --model ./absent", ["lock", "--model", "./absent"])
        measure("list", ["list"])
        measure("lock", ["lock", "-o", lock])
        measure("lock --check (cold: --no-cache)", ["lock", "--check", lock], ["--no-cache", "lock", "--check", lock])
        if not options.only or options.only.startswith("check") or "check".startswith(options.only):
            pack, site = _structural_project(here)
            # the structural pack alone: its own HF_PATCH_PACKS, its site first on the path
            path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
            alone = {"PYTHONPATH": path, "HF_PATCH_PACKS": pack}
            measure("check (the structural template's project)", ["check", pack], **alone)
            measure(
                "check --record (the same; cold: --no-cache)",
                ["check", "--record", pack],
                ["--no-cache", "check", "--record", pack],
                **alone,
            )
        # the zoo's sweep for one pack (fused-dense, first party: PYTHONPATH=.venv/first-party-packs)
        measure("verify fused-dense --all-model-types", ["verify", "fused-dense", "--all-model-types", "--json"])
    header = ["command", "cold s", "cold cpu s", "imports transformers", f"warm s (median of {options.rounds})"]
    header += ["warm cpu s", "imports transformers", "exit", "goal (warm; check: cold and warm; first: cold)"]
    print(table(header, [[*row, _goal(row)] for row in rows]))
    print(f"\nrepository: {REPO}")


if __name__ == "__main__":
    main()
