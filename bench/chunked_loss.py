"""Peak memory and time of one causal-LM training step: vanilla, the chunked-loss pack, TRL's fused LM head, CCE.

A small-hidden llama (hidden 64, one layer) built from a config, so the step's memory and time are
the loss's: vocabularies of 32,000, 128,256 and 151,936 tokens, 2,048 and 4,096 tokens of one
sequence, fp32 on CPU (bf16 with ``--dtype bfloat16``; on a GPU when CUDA is available).  Four sides
compute the same loss on the same model and batch:

* ``vanilla``: ``model(input_ids, labels=...).loss``, transformers' own;
* ``chunked-loss``: the same call after ``hfpatch_pack_chunked_loss.install(model, chunk=--chunk)``;
* ``trl``: after TRL's ``trl.trainer.utils.add_fused_lm_head(model)``, ``model(..., fused_lm_head=True).loss``
  (SFTTrainer's default loss; on CPU its torch tiles, Triton being for CUDA and XPU);
* ``cce``: Cut Cross-Entropy's ``linear_cross_entropy(hidden, head.weight, labels, shift=True,
  impl="torch_compile")`` on the decoder's hidden states (its CPU path: the ``cce`` impl is a Triton
  kernel for CUDA).

Every (vocabulary, tokens, side) runs in a fresh process, ``--repeats`` rounds, the sides' order
rotated each round: the process builds the model and batch, installs its side (timed: the pack's
install runs its probe), runs a first step (timed: CCE compiles there, with inductor's cache in a
directory fresh for the run), records its resident set (``VmRSS``; on CUDA the allocated bytes),
runs one step and reports its peak (``VmHWM``; on CUDA ``max_memory_allocated``) minus that
baseline: the memory the step added.  It then runs ``--steps`` more steps and reports the median of
their CPU time (``time.process_time``, one intra-op thread per process: on a shared machine the work
done, not the wait for a core) and of their wall time.  A row's figures are the medians over rounds,
each side's loss is checked against vanilla's, and ratios are to vanilla's.

``--write`` puts the tables, with the run's date, commit, versions and load average, between the
``<!-- bench:chunked-loss -->`` markers of docs/benchmarks.md and docs/chunked-loss.md, so both pages
show the one run (tests/test_doc_numbers.py keeps them equal).

Run (after ``make venv bench-libraries``): ``PYTHONPATH=.venv/first-party-packs:.venv/pack-test-libraries:``
``.venv/bench-libraries .venv/bin/python bench/chunked_loss.py`` (``--vocab``, ``--tokens``, ``--sides``,
``--repeats``, ``--steps``, ``--chunk``, ``--dtype``, ``--write``); Linux only (``/proc/self/status``);
vanilla's 152k x 4k step needs about 10 GB.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import commit_description

REPO = Path(__file__).resolve().parents[1]
SIDES = ("vanilla", "chunked-loss", "trl", "cce")
TITLES = {"vanilla": "vanilla", "chunked-loss": "chunked-loss", "trl": "TRL fused head", "cce": "CCE torch_compile"}
#: The pages that show the run, between these markers (written by ``--write``).
DOCS = (REPO / "docs" / "benchmarks.md", REPO / "docs" / "chunked-loss.md")
MARKER = re.compile(r"(<!-- bench:chunked-loss -->\n)(.*?)(<!-- /bench -->)", re.DOTALL)
#: docs/benchmarks.md's summary row: one line read from the tables (``summary``).
SUMMARY_MARKER = re.compile(r"(<!-- bench:chunked-loss-summary -->)(.*?)(<!-- /bench -->)", re.DOTALL)
_CELL = re.compile(r"^([\d,.]+)(?: \(([\d.]+)x\))?$")
#: A side whose loss differs from vanilla's by more than this (relative) computes another loss: the
#: run stops.  fp32 losses of a few units summed over thousands of tokens in another order differ
#: by a few ulps of the sum; bf16 logits round at 2**-8.
LOSS_AGREEMENT = {"float32": 1e-5, "bfloat16": 2e-2}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _worker(vocab: int, tokens: int, side: str, chunk: int, steps: int, dtype_name: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=tokens,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device)
    model.train()
    input_ids = torch.randint(0, vocab, (1, tokens), device=device)

    if side == "chunked-loss":
        import hfpatch_pack_chunked_loss

        start = time.perf_counter()
        hfpatch_pack_chunked_loss.install(model, chunk=chunk)
        install = time.perf_counter() - start
    elif side == "trl":
        from trl.trainer.utils import add_fused_lm_head

        start = time.perf_counter()
        add_fused_lm_head(model)
        install = time.perf_counter() - start
    elif side == "cce":
        from cut_cross_entropy import linear_cross_entropy

        install = 0.0
    else:
        install = 0.0

    def loss() -> Any:
        if side == "trl":
            return model(input_ids=input_ids, labels=input_ids, fused_lm_head=True).loss
        if side == "cce":
            hidden = model.model(input_ids=input_ids).last_hidden_state
            return linear_cross_entropy(hidden, model.lm_head.weight, input_ids, shift=True, impl="torch_compile")
        return model(input_ids=input_ids, labels=input_ids).loss

    def step() -> float:
        model.zero_grad(set_to_none=False)
        value = loss()
        value.backward()
        if cuda:
            torch.cuda.synchronize()
        return float(value.detach())

    # the gradients' buffers exist before the baseline on every side: the step's own memory is measured
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    model.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = _status_bytes("VmRSS")
        # VmHWM is the process's peak so far: reset it to now (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    value = step()
    peak = (torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")) - baseline
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    result = {
        "peak": peak,
        "cpu": statistics.median(cpu),
        "wall": statistics.median(wall),
        "first": first,
        "install": install,
        "loss": value,
        "device": device,
    }
    print(json.dumps(result))


def _run_side(vocab: int, tokens: int, side: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", str(vocab), str(tokens), side]
    command += ["--chunk", str(args.chunk), "--steps", str(args.steps), "--dtype", args.dtype]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        hint = ""
        if side in ("trl", "cce") and "ModuleNotFoundError" in done.stderr:
            hint = (
                "\n(TRL is in .venv/pack-test-libraries (make venv), Cut Cross-Entropy in .venv/bench-libraries "
                "(make bench-libraries): put both on PYTHONPATH, or leave the side out with --sides)"
            )
        sys.exit(f"{side} {vocab} x {tokens} failed:\n{done.stderr[-4000:]}{hint}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "peak": statistics.median(s["peak"] for s in samples),
        "cpu": statistics.median(s["cpu"] for s in samples),
        "wall": statistics.median(s["wall"] for s in samples),
        # the first round's: the first process of the run to compile finds inductor's cache cold
        "first": samples[0]["first"],
        "install": statistics.median(s["install"] for s in samples),
        "loss": samples[0]["loss"],
        "device": samples[0]["device"],
    }


def _load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference else "-"


def _number(value: int) -> str:
    return f"{value:,}"


def render(rows: list[tuple[int, int, dict[str, dict[str, Any]]]], sides: list[str], context: dict[str, str]) -> str:
    """The markdown the docs show between the markers: the run's context and its three tables."""
    device = rows[0][2]["vanilla"]["device"] if rows else "cpu"
    clock = "cpu" if device == "cpu" else "wall"
    header = "| vocabulary | tokens | " + " | ".join(TITLES[side] for side in sides) + " |"
    rule = "|---:|---:|" + "---:|" * len(sides)
    peak = [header, rule]
    seconds = [header, rule]
    once_sides = [side for side in sides if side != "vanilla"]
    once = [
        "| vocabulary | tokens | vanilla's first step | "
        + " | ".join(
            {"chunked-loss": "chunked-loss install (probe)", "trl": "TRL add_fused_lm_head", "cce": "CCE first step"}[s]
            for s in once_sides
        )
        + " |",
        "|---:|---:|---:|" + "---:|" * len(once_sides),
    ]
    deviation = 0.0
    for vocab, tokens, measured in rows:
        base = measured["vanilla"]
        cells_peak, cells_seconds = [], []
        for side in sides:
            mib = measured[side]["peak"] / 2**20
            sec = measured[side][clock]
            if side == "vanilla":
                cells_peak.append(f"{mib:,.0f}")
                cells_seconds.append(f"{sec:.2f}")
            else:
                cells_peak.append(f"{mib:,.0f} ({_ratio(measured[side]['peak'], base['peak'])})")
                cells_seconds.append(f"{sec:.2f} ({_ratio(sec, base[clock])})")
                deviation = max(deviation, abs(measured[side]["loss"] - base["loss"]) / abs(base["loss"]))
        prefix = f"| {_number(vocab)} | {_number(tokens)} | "
        peak.append(prefix + " | ".join(cells_peak) + " |")
        seconds.append(prefix + " | ".join(cells_seconds) + " |")
        firsts = [f"{base['first']:.2f}"]
        for side in once_sides:
            firsts.append(f"{measured[side]['install' if side != 'cce' else 'first']:.2f}")
        once.append(prefix + " | ".join(firsts) + " |")
    what = "CPU seconds" if clock == "cpu" else "seconds"
    return "\n".join(
        [
            f"`{context['command']}`: {context['when']}, commit `{context['commit']}`, transformers "
            f"{context['transformers']}, torch {context['torch']}, {context['machine']}; load average "
            f"{context['load_start']} at the start and {context['load_end']} at the end (`/proc/loadavg`).",
            "",
            "Peak memory the step adds (MiB; x vanilla's):",
            "",
            *peak,
            "",
            f"{what} per step (median; x vanilla's):",
            "",
            *seconds,
            "",
            "Once per model (seconds): the install outside the step, and the first step (CCE compiles there):",
            "",
            *once,
            "",
            f"Every side's loss is within {deviation:.1e} (relative) of vanilla's on every row.",
            "",
        ]
    )


def parse(block: str) -> dict[str, Any]:
    """What ``render`` wrote: the sides, and per table (``peak``, ``seconds``, ``once``) and row
    ``(vocabulary, tokens)`` the cells as ``(value, ratio or None)``."""
    tables: list[dict[tuple[int, int], list[tuple[float, float | None]]]] = []
    sides: list[str] = []
    for line in block.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[:2] == ["vocabulary", "tokens"]:
            tables.append({})
            if not sides:
                sides = [next(side for side, title in TITLES.items() if title == cell) for cell in cells[2:]]
        elif tables and line.startswith("| ") and cells[0][:1].isdigit():
            parsed = []
            for cell in cells[2:]:
                match = _CELL.match(cell)
                if match is None:
                    raise ValueError(f"a cell of the chunked-loss tables is not a number (x ratio): {cell!r}")
                ratio = None if match.group(2) is None else float(match.group(2))
                parsed.append((float(match.group(1).replace(",", "")), ratio))
            tables[-1][(int(cells[0].replace(",", "")), int(cells[1].replace(",", "")))] = parsed
    if len(tables) != 3:
        raise ValueError(f"the chunked-loss block has {len(tables)} tables, not 3 (peak, seconds, once)")
    return {"sides": sides, "peak": tables[0], "seconds": tables[1], "once": tables[2]}


def summary(parsed: dict[str, Any]) -> str:
    """docs/benchmarks.md's summary row, its last two cells: the largest row's ratios, the pack's worst
    over the rows, and the verdict (at most vanilla's, and at most every other side's, on every row)."""
    sides = parsed["sides"]
    pack = sides.index("chunked-loss")
    largest = max(parsed["peak"], key=lambda row: row[0] * row[1])
    missed = []
    for row in parsed["peak"]:
        for name in ("peak", "seconds"):
            cells = parsed[name][row]
            # ratios to vanilla's: at most 1.0, and at most each other side's
            if cells[pack][1] > 1.0 or any(cells[pack][1] > cell[1] for cell in cells if cell[1] is not None):
                missed.append(f"{name} at {row[0]:,} x {row[1]:,}")
    others = [
        f"{TITLES[side]} {parsed['peak'][largest][i][1]:.2f}x / {parsed['seconds'][largest][i][1]:.2f}x"
        for i, side in enumerate(sides)
        if side not in ("vanilla", "chunked-loss")
    ]
    worst_peak = max(cells[pack][1] for cells in parsed["peak"].values())
    worst_time = max(cells[pack][1] for cells in parsed["seconds"].values())
    measured = (
        f"at {largest[0]:,} x {largest[1]:,}: peak **{parsed['peak'][largest][pack][1]:.2f}x**, time "
        f"**{parsed['seconds'][largest][pack][1]:.2f}x** of vanilla's"
        + (f" (peak / time: {', '.join(others)})" if others else "")
        + f"; every row at most {worst_peak:.2f}x peak, {worst_time:.2f}x time"
    )
    verdict = "**met** on every row" if not missed else f"**missed**: {', '.join(missed)}"
    return f"{measured} | {verdict}"


def update_markers(text: str, block: str) -> str:
    """``text`` with every ``<!-- bench:chunked-loss -->`` region holding ``block`` (and every summary
    marker its ``summary``)."""
    text = MARKER.sub(lambda match: match.group(1) + block + match.group(3), text)
    line = summary(parse(block))
    return SUMMARY_MARKER.sub(lambda match: match.group(1) + line + match.group(3), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 151936])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--repeats", type=int, default=3, help="rounds: fresh processes per side and row")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--write", action="store_true", help="write the tables into the docs' markers")
    parser.add_argument("--worker", nargs=3, metavar=("VOCAB", "TOKENS", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        vocab, tokens, side = args.worker
        _worker(int(vocab), int(tokens), side, args.chunk, args.steps, args.dtype)
        return
    sides = ["vanilla", *[side for side in SIDES[1:] if side in args.sides]]
    import torch
    import transformers

    context = {
        "command": "bench/chunked_loss.py " + " ".join(sys.argv[1:]).replace("--write", "").strip(),
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit_description(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "machine": f"{os.cpu_count()} cores, one intra-op thread per process, {args.dtype}, chunk {args.chunk}, "
        f"median of {args.repeats} rounds x {args.steps} steps",
        "load_start": _load_average(),
    }
    context["command"] = context["command"].rstrip()
    print(f"one training step of a hidden-64 llama: {context['machine']}; load average {context['load_start']}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="chunked-loss-bench-inductor-") as cache:
        # CCE compiles in its first step: a cache fresh for the run makes the first compile a cold one
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        for vocab in args.vocab:
            for tokens in args.tokens:
                samples: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
                for round_index in range(args.repeats):
                    shift = round_index % len(sides)
                    for side in sides[shift:] + sides[:shift]:
                        samples[side].append(_run_side(vocab, tokens, side, args, env))
                measured = {side: _summary(found) for side, found in samples.items()}
                for side in sides[1:]:
                    theirs, vanillas = measured[side]["loss"], measured["vanilla"]["loss"]
                    if abs(theirs - vanillas) > LOSS_AGREEMENT[args.dtype] * abs(vanillas):
                        sys.exit(f"{side}'s loss {theirs} at {vocab} x {tokens} is not vanilla's {vanillas}")
                rows.append((vocab, tokens, measured))
                line = f"{vocab:>7} {tokens:>6} |"
                for side in sides:
                    found = measured[side]
                    line += f" {side} {found['peak'] / 2**20:,.0f} MiB {found['cpu']:.2f} cpu-s {found['wall']:.2f} s"
                    if side != "vanilla":
                        line += f" ({_ratio(found['peak'], measured['vanilla']['peak'])} peak, "
                        line += f"{_ratio(found['cpu'], measured['vanilla']['cpu'])} cpu)"
                    line += " |"
                print(line, flush=True)
    context["load_end"] = _load_average()
    block = render(rows, sides, context)
    print()
    print(block)
    if args.write:
        for page in DOCS:
            text = page.read_text()
            if not MARKER.search(text):
                sys.exit(f"{page.relative_to(REPO)} has no <!-- bench:chunked-loss --> ... <!-- /bench --> region")
            page.write_text(update_markers(text, block))
            print(f"wrote {page.relative_to(REPO)}")


if __name__ == "__main__":
    main()
