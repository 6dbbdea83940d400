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

Run: ``PYTHONPATH=.venv/first-party-packs .venv/bin/python bench/load_memory.py``
(``--rounds``, ``--qwen``); Linux only (``/proc/self/status``).
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

_CHILD = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
import hfpatch_core

path, packs = sys.argv[1], sys.argv[2]
if packs != "vanilla":
    hfpatch_core.enable(packs, strict=True)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmHWM", "VmRSS")))
mapped = []
for line in open("/proc/self/maps"):
    fields = line.split()
    if fields[-1].endswith(".safetensors"):
        start, end = (int(value, 16) for value in fields[0].split("-"))
        mapped.append((start, end))
storages = {}
for tensor in model.state_dict().values():
    pointer = tensor.untyped_storage().data_ptr()
    if not any(start <= pointer < end for start, end in mapped):
        storages[pointer] = tensor.untyped_storage().nbytes()
print(json.dumps({"peak": int(status["VmHWM"].split()[0]) * 1024, "built": sum(storages.values())}))
"""


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--qwen", action="store_true", help="also a Qwen2-MoE with the qwen-moe pack")
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
    print(f"\npeak RSS after from_pretrained and bytes built, MiB (median of {args.rounds} fresh processes each)")
    header = ["model", "pack", "vanilla peak", "vanilla built", "pack peak", "pack built", "(pack - vanilla) / built"]
    print(table([*header, f"<= {GOAL}"], rows))


if __name__ == "__main__":
    main()
