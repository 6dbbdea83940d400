"""Peak memory and time of one causal-LM training step (forward + backward), vanilla vs the chunked-loss pack.

A small-hidden llama (hidden 64, one layer) built from a config, so the step's memory is the
loss's: vocabularies of 32,000, 128,256 and 151,936 tokens, 2,048 and 4,096 tokens of one
sequence, fp32 on CPU (bf16 with ``--dtype bfloat16``; on a GPU when CUDA is available).

Every (vocabulary, tokens, side) runs in a fresh process, vanilla and pack alternating: the
process builds the model and batch, records its resident set (``VmRSS``; on CUDA the allocated
bytes), runs one step and reports its peak (``VmHWM``; on CUDA ``max_memory_allocated``) minus
that baseline: the memory the step added.  It then runs ``--repeats`` more steps and reports their
median time.  The pack's side installs it with ``hfpatch_pack_chunked_loss.install`` (chunk
``--chunk`` tokens).  Goals (issue 39): peak <= 0.35x vanilla at 152k x 4k, time <= 1.1x on CPU.

Run: ``PYTHONPATH=.venv/first-party-packs .venv/bin/python bench/chunked_loss.py``
(``--vocab``, ``--tokens``, ``--repeats``, ``--chunk``, ``--dtype``); Linux only
(``/proc/self/status``); vanilla's 152k x 4k step needs about 10 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _worker(vocab: int, tokens: int, side: str, chunk: int, repeats: int, dtype_name: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    transformers.utils.logging.set_verbosity_error()
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
    if side == "chunked-loss":
        import hfpatch_pack_chunked_loss

        hfpatch_pack_chunked_loss.install(model, chunk=chunk)
    input_ids = torch.randint(0, vocab, (1, tokens), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        if cuda:
            torch.cuda.synchronize()

    # the gradients' buffers exist before the baseline on both sides: the step's own memory is measured
    step()
    model.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = _status_bytes("VmRSS")
        # VmHWM is the process's peak so far: reset it to now (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    step()
    peak = (torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")) - baseline
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"peak": peak, "seconds": statistics.median(seconds), "device": device}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 151936])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--worker", nargs=3, metavar=("VOCAB", "TOKENS", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        vocab, tokens, side = args.worker
        _worker(int(vocab), int(tokens), side, args.chunk, args.repeats, args.dtype)
        return
    print(f"one training step of a hidden-64 llama, {args.dtype}, chunk {args.chunk}, median of {args.repeats} steps")
    print(
        f"{'vocab':>7} {'tokens':>6} | {'vanilla MiB':>11} {'pack MiB':>9} {'peak x':>7} | "
        f"{'vanilla s':>9} {'pack s':>8} {'time x':>7}"
    )
    for vocab in args.vocab:
        for tokens in args.tokens:
            results = {}
            for side in ("vanilla", "chunked-loss"):
                command = [sys.executable, __file__, "--worker", str(vocab), str(tokens), side]
                command += ["--chunk", str(args.chunk), "--repeats", str(args.repeats), "--dtype", args.dtype]
                done = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ)
                if done.returncode != 0:
                    sys.exit(f"{side} {vocab} x {tokens} failed:\n{done.stderr}")
                results[side] = json.loads(done.stdout.strip().splitlines()[-1])
            a, b = results["vanilla"], results["chunked-loss"]
            print(
                f"{vocab:>7} {tokens:>6} | {a['peak'] / 2**20:>11.0f} {b['peak'] / 2**20:>9.0f} "
                f"{b['peak'] / a['peak']:>6.2f}x | {a['seconds']:>9.2f} {b['seconds']:>8.2f} "
                f"{b['seconds'] / a['seconds']:>6.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
