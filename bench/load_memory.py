"""Peak resident memory of a converting load, against vanilla.

A ~110M llama (hidden 768, 12 layers, 12 heads / 4 kv heads, intermediate 2048, vocab
32000, fp32) and, with ``--qwen``, a Qwen2-MoE of similar width are saved with
``save_pretrained``; each is loaded in a fresh process per sample, vanilla and through
a converting pack (``fused-dense`` on llama, ``qwen-moe`` on qwen2_moe), interleaved
round by round.  Each process reports its peak resident set (``VmHWM``) after
``from_pretrained`` and the bytes of the model's tensors that are not views of the
memory-mapped checkpoint: what the load built (the pack's fused ``qkv_proj`` /
``gate_up_proj``; transformers' own stacked experts for a vanilla MoE).  Goal (issue
19.8): peak(pack) - peak(vanilla) <= 1.1 x built(pack), i.e. no transient second copy
of what the pack converts.  (The qwen-moe pack keeps the experts as per-expert views of
the checkpoint where vanilla stacks them, so its load peaks below vanilla's.)

With ``--fsdp`` the llama is also loaded by transformers' FSDP2 on two ranks
(``torchrun --nproc_per_node 2``, gloo, ``DistributedConfig(fsdp_size=2)``, transformers
5.25), and with ``--tp`` by its tensor parallelism (``tp_plan="auto"``), vanilla and with
the pack, and each rank reports the same two figures for its own shards: one row per rank.

Run: ``PYTHONPATH=.venv/first-party-packs .venv/bin/python bench/load_memory.py``
(``--rounds``, ``--qwen``, ``--fsdp``, ``--tp``); Linux only (``/proc/self/status``).
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

GOAL = 1.1

#: The child's report: peak resident set, and the bytes of its tensors (a rank's local shards
#: under FSDP2) that are not views of the memory-mapped checkpoint.
_MEASURE = r"""
def measure(model):
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmHWM", "VmRSS")))
    mapped = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if fields[-1].endswith(".safetensors"):
            start, end = (int(value, 16) for value in fields[0].split("-"))
            mapped.append((start, end))
    storages = {}
    for tensor in model.state_dict().values():
        tensor = getattr(tensor, "_local_tensor", tensor)
        pointer = tensor.untyped_storage().data_ptr()
        if not any(start <= pointer < end for start, end in mapped):
            storages[pointer] = tensor.untyped_storage().nbytes()
    return {"peak": int(status["VmHWM"].split()[0]) * 1024, "built": sum(storages.values())}
"""

_CHILD = (
    _MEASURE
    + r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
import hfpatch_core

path, packs = sys.argv[1], sys.argv[2]
if packs != "vanilla":
    hfpatch_core.enable(packs, strict=True)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
print(json.dumps(measure(model)))
"""
)

#: One rank of a 2-rank sharded load by transformers (gloo): FSDP2 (``DistributedConfig(fsdp_size=2)``)
#: or tensor parallelism (``tp_plan="auto"``).
_RANK = (
    _MEASURE
    + r"""
import json, os, sys
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
import hfpatch_core

path, packs, out, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo")
if packs != "vanilla":
    hfpatch_core.enable(packs, strict=True)
sharding = {"distributed_config": DistributedConfig(fsdp_size=2)} if mode == "fsdp" else {"tp_plan": "auto"}
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sharding)
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as report:
    json.dump(measure(model), report)
dist.barrier()
dist.destroy_process_group()
"""
)


def build(kind: str, directory: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=True,
    )
    if kind == "llama":
        config = AutoConfig.for_model("llama", intermediate_size=2048, **common)
    else:
        config = AutoConfig.for_model(
            "qwen2_moe",
            intermediate_size=2048,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=1024,
            num_experts=8,
            num_experts_per_tok=2,
            **common,
        )
    torch.manual_seed(0)
    path = directory / kind
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def sample(path: Path, packs: str) -> dict:
    environment = {**os.environ, "USE_HUB_KERNELS": os.environ.get("USE_HUB_KERNELS", "0")}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), packs], capture_output=True, text=True, env=environment, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"loading {path.name} with {packs} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


#: How each sharded mode is named in the table.
MODES = {"fsdp": "FSDP2", "tp": "TP"}


def sharded_sample(path: Path, packs: str, directory: Path, mode: str) -> list[dict]:
    """Each rank's report of one ``torchrun --nproc_per_node 2`` load sharded by ``mode``."""
    script, out = directory / "rank.py", directory / f"out-{mode}-{packs}"
    script.write_text(_RANK)
    out.mkdir(exist_ok=True)
    environment = {**os.environ, "USE_HUB_KERNELS": os.environ.get("USE_HUB_KERNELS", "0"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = subprocess.run(
        [*command, str(path), packs, str(out), mode], capture_output=True, text=True, env=environment, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"{MODES[mode]} load of {path.name} with {packs} failed:\n{result.stderr[-3000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def sharded_rows(path: Path, pack: str, rounds: int, directory: Path, mode: str) -> list[list[str]]:
    """One row per rank: median peaks of vanilla and ``pack`` sharded by ``mode``, interleaved round by round."""
    peaks: dict[str, list[list[int]]] = {"vanilla": [[], []], pack: [[], []]}
    built: dict[str, list[int]] = {}
    for round_index in range(rounds):
        for packs in ["vanilla", pack] if round_index % 2 == 0 else [pack, "vanilla"]:
            reports = sharded_sample(path, packs, directory, mode)
            for rank, report in enumerate(reports):
                peaks[packs][rank].append(report["peak"])
            built[packs] = [report["built"] for report in reports]
    rows = []
    for rank in (0, 1):
        vanilla, patched = median(peaks["vanilla"][rank]), median(peaks[pack][rank])
        # what vanilla builds too (under TP its row-wise cuts, copies of the file's columns) is
        # not converted by the pack: the goal counts what the pack builds beyond it
        converted = built[pack][rank] - built["vanilla"][rank]
        ratio = (patched - vanilla) / converted if converted > 0 else float("nan")
        values = (vanilla, built["vanilla"][rank], patched, built[pack][rank])
        rows.append(
            [
                f"{path.name}, {MODES[mode]} rank {rank}",
                pack,
                *(f"{value / 2**20:.0f}" for value in values),
                f"{ratio:.2f}",
                "met" if ratio <= GOAL else "MISSED",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--qwen", action="store_true", help="also a Qwen2-MoE with the qwen-moe pack")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="also the llama loaded by transformers' FSDP2 on 2 ranks (torchrun, gloo), each rank's figures",
    )
    parser.add_argument(
        "--tp",
        action="store_true",
        help="also the llama loaded by transformers' tensor parallelism on 2 ranks (torchrun, gloo)",
    )
    args = parser.parse_args()
    print("\n".join(machine_info()))
    cases = [("llama", "fused-dense")] + ([("qwen2_moe", "qwen-moe")] if args.qwen else [])
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for kind, pack in cases:
            path = build(kind, Path(directory))
            peaks: dict[str, list[int]] = {"vanilla": [], pack: []}
            built: dict[str, int] = {}
            for round_index in range(args.rounds):
                order = ["vanilla", pack] if round_index % 2 == 0 else [pack, "vanilla"]
                for packs in order:
                    result = sample(path, packs)
                    peaks[packs].append(result["peak"])
                    built[packs] = result["built"]
            vanilla, patched = median(peaks["vanilla"]), median(peaks[pack])
            ratio = (patched - vanilla) / built[pack] if built[pack] else float("nan")
            rows.append(
                [
                    kind,
                    pack,
                    *(f"{value / 2**20:.0f}" for value in (vanilla, built["vanilla"], patched, built[pack])),
                    f"{ratio:.2f}",
                    "met" if ratio <= GOAL else "MISSED",
                ]
            )
            for mode in [mode for mode in MODES if getattr(args, mode)] if kind == "llama" else []:
                rows.extend(sharded_rows(path, pack, args.rounds, Path(directory), mode))
    print(f"\npeak RSS after from_pretrained and bytes built, MiB (median of {args.rounds} fresh processes each)")
    header = ["model", "pack", "vanilla peak", "vanilla built", "pack peak", "pack built", "(pack - vanilla) / built"]
    print(table([*header, f"<= {GOAL}"], rows))


if __name__ == "__main__":
    main()
