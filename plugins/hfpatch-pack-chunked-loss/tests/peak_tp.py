"""Per-rank peak of a training step under tensor parallelism, vanilla against chunked-loss (not a test).

``python tests/peak_tp.py [--vocab 32000] [--tokens 1024] [--rounds 2]`` (from the pack's directory, with
the suite's ``PYTHONPATH``): a tiny llama of that vocabulary is loaded with ``tp_plan="auto"`` on 2 ranks
(``torchrun``, gloo, CPU), vanilla and with ``hfpatch_core.enabled(packs="chunked-loss")`` (default
budget), each side in fresh torchruns, alternating; each rank runs a first step, records its resident
set (``VmRSS``), resets its peak (``/proc/self/clear_refs``), runs one step and reports ``VmHWM`` minus that
baseline: the memory the step added.  Prints the median over rounds per rank and side, and the ratio.
Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rank_main(checkpoint: str, side: str, tokens: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import AutoModelForCausalLM

    import hfpatch_core

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dist.init_process_group("gloo")
    with hfpatch_core.enabled(packs="chunked-loss" if side == "chunked-loss" else "none"):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, tp_plan="auto")
    model.train()
    vocab = model.config.vocab_size
    # the same batch on every rank, as tensor parallelism requires
    ids = torch.randint(3, vocab, (tokens // 256, 256), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    step()
    baseline = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    loss = step()
    peak = _status_bytes("VmHWM") - baseline
    rank = dist.get_rank()
    installed = model.__dict__.get("_hfpatch_chunked_loss") is not None
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": peak, "loss": loss, "installed": installed}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=1024, help="a multiple of 256 (sequences of 256)")
    parser.add_argument("--rounds", type=int, default=2)
    arguments = parser.parse_args()
    from hfpatch_core.testing import tiny_checkpoint

    environment = {**os.environ, "USE_HUB_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    peaks: dict[tuple[str, int], list[int]] = {}
    losses: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tiny_checkpoint(
            "llama", Path(tmp) / "llama", vocab_size=arguments.vocab, tie_word_embeddings=False
        )
        for _ in range(arguments.rounds):
            for side in ("vanilla", "chunked-loss"):
                out = Path(tmp) / "out"
                out.mkdir(exist_ok=True)
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                command += [__file__, "--rank", str(checkpoint), side, str(arguments.tokens), str(out)]
                done = subprocess.run(command, env=environment, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(done.stderr[-4000:])
                for rank in (0, 1):
                    result = json.loads((out / f"rank{rank}.json").read_text())
                    if side == "chunked-loss" and not result["installed"]:
                        raise SystemExit("chunked-loss was not installed on the tensor-parallel load")
                    peaks.setdefault((side, rank), []).append(result["peak"])
                    losses[side] = result["loss"]
    mib = 2**20
    print(f"llama, vocabulary {arguments.vocab}, {arguments.tokens} tokens, tp_plan='auto' on 2 ranks (gloo, CPU)")
    print(f"losses: vanilla {losses['vanilla']:.6f}, chunked-loss {losses['chunked-loss']:.6f}")
    print("rank  vanilla step peak (MiB)  chunked-loss step peak (MiB)  ratio")
    for rank in (0, 1):
        vanilla = statistics.median(peaks[("vanilla", rank)])
        ours = statistics.median(peaks[("chunked-loss", rank)])
        print(f"{rank:<4}  {vanilla / mib:>23.1f}  {ours / mib:>28.1f}  {ours / vanilla:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main()
