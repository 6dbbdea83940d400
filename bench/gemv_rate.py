"""How fast this machine's torch multiplies one token by the weights of a decode step.

Decode at batch 1 is a chain of matrix-vector products: each reads its weight once, so
its speed is a read rate.  This script sets the rates side by side, for 1 and 2 torch
threads, on the fused projections of ``bench/fused_dense.py``'s checkpoint (hidden 1024,
intermediate 2816, 4 layers; fp32):

* ``tensor.sum()`` over 1 GiB: how fast this process streams memory;
* ``F.linear(x, W)``: what a decode step's projections use;
* ``torch.mv(W, x)``, and ``x @ W.T`` with the transposed weight stored contiguously:
  other kernels for the same product;
* the weight split in two halves, as a batched ``matmul`` and with ``torch.jit.fork``:
  attempts to put both threads on one product.

When ``F.linear`` reads at about the streaming rate, no kernel can make the step much
faster without reading fewer bytes; when it reads far below it, a better matrix-vector
kernel could, and fusing projections (the same bytes) still cannot.

Run: ``.venv/bin/python bench/gemv_rate.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import machine_info, median, repeat, table

#: (out, in) of every projection of the fused checkpoint: qkv, o, gate_up, down, 4 layers.
SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 4


def rate(nbytes: int, function: Callable[[], object], count: int = 30) -> float:
    function()  # warm-up
    return nbytes / median(repeat(function, count)) / 1e9


def main() -> None:
    for line in machine_info(torch_and_transformers=False):
        print(line)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=generator) for out, inp in SHAPES]
    transposed = [w.t().contiguous() for w in weights]
    halves = [w.view(2, w.shape[0] // 2, w.shape[1]) for w in weights]
    inputs = [torch.randn(1, inp, generator=generator) for _, inp in SHAPES]
    nbytes = sum(w.nbytes for w in weights)
    buffer = torch.ones(256 * 1024 * 1024)

    def forked() -> None:
        for x, w in zip(inputs, weights, strict=True):
            half = w.shape[0] // 2
            future = torch.jit.fork(F.linear, x, w[half:])
            torch.cat([F.linear(x, w[:half]), torch.jit.wait(future)], dim=-1)

    kernels: dict[str, Callable[[], object]] = {
        "F.linear(x, W)": lambda: [F.linear(x, w) for x, w in zip(inputs, weights, strict=True)],
        "torch.mv(W, x)": lambda: [torch.mv(w, x[0]) for x, w in zip(inputs, weights, strict=True)],
        "x @ W.T (stored transposed)": lambda: [x @ wt for x, wt in zip(inputs, transposed, strict=True)],
        "matmul of two halves (batched)": lambda: [torch.matmul(h, x[0]) for x, h in zip(inputs, halves, strict=True)],
        "two halves, torch.jit.fork": forked,
    }
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        stream = rate(buffer.nbytes, buffer.sum, count=5)
        rows.append([f"{threads}", "tensor.sum() over 1 GiB", f"{stream:.1f}", "1.00"])
        for name, kernel in kernels.items():
            measured = rate(nbytes, kernel)
            rows.append([f"{threads}", name, f"{measured:.1f}", f"{measured / stream:.2f}"])
    print(f"\n{nbytes / 1e6:.1f} MB of fp32 weights, one token; median of 30 passes")
    print(table(["threads", "kernel", "GB/s", "of the streaming rate"], rows))


if __name__ == "__main__":
    main()
