"""Peak resident memory and load time of MoE checkpoints loaded with the linear-experts pack, against vanilla.

Two family shapes of about 0.9 GB fp32, each a random checkpoint built from a config (in a
child process) and saved with ``save_pretrained`` to a temporary directory:

* **mixtral** (hidden 1024, 4 layers, 8 experts of intermediate 1792, vocab 16000): the
  checkpoint stores one tensor per expert and projection (``experts.<e>.w1.weight``), which
  vanilla transformers stacks into 3-D parameters at load (``MergeModulelist``: a copy of
  every expert) and the pack loads unchanged into its per-expert linears;
* **gpt_oss** (same sizes): the checkpoint stores the experts 3-D (transposed, gate/up
  interleaved, with biases), which vanilla keeps as they are and the pack splits into
  per-expert linears (``conversion.SplitExperts``): views of the memory-mapped tensor, the
  interleaved gate/up kept whole per expert (``experts.<e>.gate_up_proj``), so nothing is
  copied.  Neither side reads an expert page during the load; the summary's "peak once run"
  compares the two after a forward has read every expert.  What the pack adds at load is a
  fixed cost (its imports, and the torch code its probe runs: ``discovery``), shown in MiB.

Each load runs in a fresh process (``AutoModelForCausalLM.from_pretrained(path,
dtype=float32)``), vanilla and linear-experts alternating, ``--rounds`` times after one
warm-up load each (the checkpoint then sits in the page cache for both).  Each process
reports the peak resident set (``VmHWM``, which counts the pages of the memory-mapped
checkpoint it touched) and its resident set before the load (imports), the seconds of
``from_pretrained``, and the bytes of its tensors that are not views of the memory-mapped
checkpoint (what the load built), then runs 64 tokens through the model (every expert is
routed to) and reports its resident set and peak again: every checkpoint page is then
resident for vanilla too, so "peak once run" compares what each side holds to compute.
Goals (issue 30 item 3): peak(pack) <= peak(vanilla)
and load time(pack) <= 1.1 x vanilla's.

Run: ``PYTHONPATH=.venv/first-party-packs .venv/bin/python bench/linear_experts_load.py``
(``--rounds``, ``--families``, ``--quick`` for 0.1 GB models); Linux only (``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine_info, median, table

PACK = "linear-experts"
FAMILIES = ("mixtral", "gpt_oss")
TIME_GOAL = 1.1
SIZES = dict(hidden=1024, layers=4, experts=8, intermediate=1792, vocab=16000)
QUICK = dict(hidden=512, layers=2, experts=8, intermediate=768, vocab=8000)

_BUILD = r"""
import json, sys
import torch, transformers
family, path, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
common = dict(
    hidden_size=sizes["hidden"], num_hidden_layers=sizes["layers"], num_attention_heads=sizes["hidden"] // 64,
    num_key_value_heads=4, head_dim=64, num_experts_per_tok=2, vocab_size=sizes["vocab"],
    intermediate_size=sizes["intermediate"], num_local_experts=sizes["experts"], tie_word_embeddings=False,
)
config = transformers.MixtralConfig(**common) if family == "mixtral" else transformers.GptOssConfig(**common)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config)
model.save_pretrained(path)
print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
"""

_LOAD = r"""
import json, sys, time
def status():
    wanted = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(wanted))
    return {key: int(value.split()[0]) * 1024 for key, value in fields.items()}
import torch
from transformers import AutoModelForCausalLM
import transformers
import hfpatch_core
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
path, packs = sys.argv[1], sys.argv[2]
before = status()["VmRSS"]
if packs != "vanilla":
    hfpatch_core.enable(packs, strict=True)
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
seconds = time.perf_counter() - start
mapped = []
for line in open("/proc/self/maps"):
    fields = line.split()
    if fields[-1].endswith(".safetensors"):
        low, high = (int(value, 16) for value in fields[0].split("-"))
        mapped.append((low, high))
storages = {}
for tensor in model.state_dict().values():
    pointer = tensor.untyped_storage().data_ptr()
    if not any(low <= pointer < high for low, high in mapped):
        storages[pointer] = tensor.untyped_storage().nbytes()
linears = sum(1 for name, module in model.named_modules() if ".experts." in name and type(module) is torch.nn.Linear)
after = status()
torch.manual_seed(0)
with torch.inference_mode():  # 64 tokens through every layer: every expert is routed to, so all its pages are read
    model(input_ids=torch.randint(3, model.config.vocab_size, (1, 64)))
ran = status()
print(json.dumps({"peak": after["VmHWM"], "before": before, "anon": after["RssAnon"], "file": after["RssFile"],
                  "seconds": seconds, "running": ran["VmRSS"], "peak_run": ran["VmHWM"],
                  "built": sum(storages.values()), "expert_linears": linears}))
"""


def child(script: str, *args: str) -> dict:
    environment = {**os.environ, "USE_HUB_KERNELS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=environment, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"child process failed ({' '.join(args)}):\n{result.stderr[-3000:]}")
    report: dict = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def run_family(family: str, sizes: dict[str, int], rounds: int) -> list[str]:
    with tempfile.TemporaryDirectory(prefix=f"hfpatch-bench-le-load-{family}-") as directory:
        path = Path(directory)
        built = child(_BUILD, family, str(path), json.dumps(sizes))
        size = sum(file.stat().st_size for file in path.glob("*.safetensors"))
        print(
            f"\n== {family}: {built['parameters'] / 1e6:.0f}M parameters, checkpoint {size / 2**30:.2f} GiB ({sizes})"
        )
        for packs in ("vanilla", PACK):  # warm-up: the checkpoint into the page cache, imports compiled
            child(_LOAD, str(path), packs)
        samples: dict[str, list[dict]] = {"vanilla": [], PACK: []}
        for round_ in range(rounds):
            order = ("vanilla", PACK) if round_ % 2 == 0 else (PACK, "vanilla")
            for packs in order:
                samples[packs].append(child(_LOAD, str(path), packs))
    rows = []
    for packs, reports in samples.items():
        rows.append(
            [
                packs,
                f"{median([r['peak'] for r in reports]) / 2**20:.0f}",
                f"{median([r['peak'] - r['before'] for r in reports]) / 2**20:.0f}",
                f"{median([r['built'] for r in reports]) / 2**20:.0f}",
                f"{median([r['running'] for r in reports]) / 2**20:.0f}",
                f"{median([r['peak_run'] for r in reports]) / 2**20:.0f}",
                f"{median([r['seconds'] for r in reports]):.2f}",
                f"{min(r['seconds'] for r in reports):.2f}..{max(r['seconds'] for r in reports):.2f}",
                str(reports[0]["expert_linears"]),
            ]
        )
    header = [
        "load",
        "peak RSS MiB",
        "peak - before load",
        "built MiB",
        "RSS after a forward",
        "peak once run",
        "load s (median)",
        "range",
        "expert Linears",
    ]
    print(table(header, rows))
    pack_peak, vanilla_peak = (median([r["peak"] for r in samples[packs]]) for packs in (PACK, "vanilla"))
    peak, extra = pack_peak / vanilla_peak, (pack_peak - vanilla_peak) / 2**20
    seconds = median([r["seconds"] for r in samples[PACK]]) / median([r["seconds"] for r in samples["vanilla"]])
    run = median([r["peak_run"] for r in samples[PACK]]) / median([r["peak_run"] for r in samples["vanilla"]])
    return [
        family,
        f"{peak:.2f}",
        f"{extra:+.0f}",
        "met" if peak <= 1.0 else "MISSED",
        f"{run:.2f}",
        f"{seconds:.2f}",
        "met" if seconds <= TIME_GOAL else "MISSED",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, from {FAMILIES}")
    parser.add_argument("--rounds", type=int, default=3, help="loads per variant, alternating (default 3)")
    parser.add_argument("--quick", action="store_true", help=f"small models: {QUICK}")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else SIZES
    for line in machine_info():
        print(line)
    print(f"each load in a fresh process, vanilla and {PACK} alternating, {args.rounds} rounds after a warm-up load")
    rows = [run_family(family, sizes, args.rounds) for family in args.families.split(",")]
    header = [
        "family",
        "peak RSS at load: pack / vanilla",
        "pack - vanilla MiB",
        "goal <= 1",
        "peak once run: pack / vanilla",
        "load time: pack / vanilla",
        f"goal <= {TIME_GOAL}",
    ]
    print("\nsummary (medians):")
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
