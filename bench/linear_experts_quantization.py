"""Decode speed and memory of three MoE family shapes quantized with and without the linear-experts pack.

transformers 5 keeps routed experts as 3-D parameters, which quantizers that swap or
re-weight ``nn.Linear`` (``torch.ao.quantization.quantize_dynamic``, torchao's
``quantize_``) never reach: on a vanilla model they quantize attention and the LM head
and leave the experts, most of the weights, in fp32.  The linear-experts pack loads every
expert as ``nn.Linear`` modules, so the same call quantizes them.

Three family shapes, each a random checkpoint built from a config and saved with
``save_pretrained`` to a temporary directory (defaults: hidden 1024, 4 layers, 8 experts of
intermediate 2048, top-2, vocab 8000; about 205-235M parameters, 0.77-0.87 GiB fp32; the run
peaks near 7 GB resident, the four variants of one family at a time).  At batch 1 a decode step
reads every weight it uses once, so its time is bytes plus a fixed cost per op (Python, dispatch,
the dynamic quantization of each activation); at hidden 768 and intermediate 768 the fixed cost
was most of an int8 step and the ratios read 1.9-2.7x.  The defaults keep the weights the
larger part, as in the real models (hidden 2880-7168), where that cost is smaller still:

* **mixtral**: gated experts (per-expert checkpoint tensors ``w1``/``w3``/``w2``), softmax top-k;
* **deepseek_v3**: a shared expert beside the routed ones, sigmoid routing with groups and a
  correction bias, MLA attention, one dense layer first;
* **gpt_oss**: experts stored 3-D in the checkpoint (transposed, gate/up interleaved, with
  biases; the pack splits them at load), a clamped custom gate, attention sinks.

Each family is loaded four ways (one family in memory at a time):

* **vanilla fp32**: plain transformers (its default experts implementation);
* **vanilla int8**: the same, then ``quantize_dynamic(model, {nn.Linear}, qint8)``;
* **linear-experts fp32**: loaded with the pack;
* **linear-experts int8**: the same, then the same ``quantize_dynamic`` call;
* (**linear-experts torchao int8wo**, with ``--torchao``: ``quantize_(model, Int8WeightOnlyConfig())``).

Each variant runs greedy decoding at batch 1 with the KV cache (a ``--prompt``-token
prompt, not timed, then ``--tokens - 1`` single-token steps, ``--rounds`` times), the
variants' steps interleaved, the order rotated every step; ms/token is the median step.
Memory is the bytes of the parameters and buffers (packed int8 weights included).
Accuracy is against vanilla fp32, teacher-forced on its greedy sequence (the cosine of
the last position's logits, top-1 agreement).  The summary prints, per family, side by
side: decode speedup of linear-experts int8 over vanilla fp32 (goal >= 2.5x at batch 1)
and over vanilla int8, and the memory of each int8 variant relative to vanilla fp32.

Run: ``PYTHONPATH=.venv/first-party-packs .venv/bin/python bench/linear_experts_quantization.py``
(``--quick`` for small models and a short run; ``--families`` to pick; ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import interleaved, machine_info, median, spread, table
from quantization import (
    Decoder,
    accuracy,
    dynamic_int8,
    load,
    profile_step,
    quantized_linears,
    speedup,
    tensor_bytes,
    torchao_int8_weight_only,
)

PACK = "linear-experts"
FAMILIES = ("mixtral", "deepseek_v3", "gpt_oss")
GOAL = 2.5  # linear-experts int8 over vanilla fp32, decode at batch 1 (the goal)
QUICK = dict(hidden=256, layers=2, experts=8, top_k=2, intermediate=256, vocab=4096)


def build_config(family: str, args: argparse.Namespace) -> Any:
    """A random config of ``family`` with the sizes of ``args`` (untied embeddings, fp32)."""
    import transformers

    heads = max(4, args.hidden // 96)
    common: dict[str, Any] = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_experts_per_tok=args.top_k,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **common, intermediate_size=args.intermediate, num_key_value_heads=heads, num_local_experts=args.experts
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common,
            intermediate_size=2 * args.intermediate,  # the dense first layer
            moe_intermediate_size=args.intermediate,
            n_routed_experts=args.experts,
            n_shared_experts=1,
            n_group=4 if args.experts % 4 == 0 else 1,
            topk_group=2 if args.experts % 4 == 0 else 1,
            first_k_dense_replace=1,
            num_key_value_heads=heads,
            kv_lora_rank=args.hidden // 6,
            q_lora_rank=args.hidden // 3,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
            head_dim=32,
        )
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            **common,
            intermediate_size=args.intermediate,
            num_key_value_heads=max(1, heads // 4),
            head_dim=64,
            num_local_experts=args.experts,
        )
    raise SystemExit(f"unknown family {family!r}: choose from {FAMILIES}")


def float_expert_parameters(model: Any) -> int:
    """Expert parameters left in floating point (3-D parameters, or per-expert linears' weights)."""
    import torch

    total = 0
    for name, module in model.named_modules():
        if not name.endswith(".experts"):
            continue
        for parameter in module.parameters():
            if type(parameter) in (torch.Tensor, torch.nn.Parameter) and parameter.dim() >= 2:
                total += parameter.numel()
    return total


def run_family(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, load four (five) ways, decode interleaved; print the family's table; return its ratios."""
    import torch
    import transformers

    config = build_config(family, args)
    with tempfile.TemporaryDirectory(prefix=f"hfpatch-bench-le-{family}-") as directory:
        path = Path(directory)
        torch.manual_seed(args.seed)
        source = transformers.AutoModelForCausalLM.from_config(config)
        parameters = sum(p.numel() for p in source.parameters())
        source.save_pretrained(path)
        del source
        gc.collect()
        print(
            f"\n== {family}: hidden {args.hidden}, {args.layers} layers, {args.experts} experts (intermediate "
            f"{args.intermediate}, top-{args.top_k}), vocab {args.vocab}: {parameters / 1e6:.1f}M parameters, "
            f"{parameters * 4 / 2**30:.2f} GiB fp32"
        )
        builders: dict[str, tuple[str, Callable[[], Any]]] = {
            "fp32": ("vanilla fp32", lambda: load(path, None)),
            "int8": ("vanilla + quantize_dynamic int8", lambda: dynamic_int8(load(path, None))),
            "le-fp32": ("linear-experts fp32", lambda: load(path, PACK)),
            "le-int8": ("linear-experts + quantize_dynamic int8", lambda: dynamic_int8(load(path, PACK))),
        }
        if args.torchao:
            builders["le-ao"] = (
                "linear-experts + torchao Int8WeightOnly",
                lambda: torchao_int8_weight_only(load(path, PACK)),
            )
        models = {key: build() for key, (_, build) in builders.items()}

    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed))
    decoders = {key: Decoder(model, prompt) for key, model in models.items()}
    for decoder in decoders.values():  # warm-up: one whole generation each
        for _ in range(args.tokens - 1):
            decoder.step()
    samples: dict[str, list[float]] = {key: [] for key in models}
    for _ in range(args.rounds):
        for decoder in decoders.values():
            decoder.reset()
        gc.collect()
        steps = interleaved({key: d.step for key, d in decoders.items()}, args.tokens - 1, collect=False)
        for key, values in steps.items():
            samples[key] += values
    reference_tokens = decoders["fp32"].generated
    sequence = torch.cat([prompt, torch.tensor([reference_tokens])], dim=1)
    with torch.inference_mode():
        reference = models["fp32"](input_ids=sequence).logits[0].float()
    sizes = {key: tensor_bytes(model) for key, model in models.items()}
    rows = []
    for key, model in models.items():
        scores = accuracy(model, sequence, reference, args.prompt)
        rows.append(
            [
                builders[key][0],
                f"{median(samples[key]) * 1e3:.1f}",
                spread(samples[key]),
                f"{1 / median(samples[key]):.1f}",
                f"{quantized_linears(model)}",
                f"{float_expert_parameters(model) / 1e6:.1f}M",
                f"{sizes[key] / 2**20:.0f}",
                f"{scores['cosine']:.5f}",
                f"{scores['top1']:.2f}",
            ]
        )
    header = ["variant", "ms/token", "IQR ms", "tokens/s", "quantized Linear", "fp expert params", "MiB"]
    header += ["cos", "top-1"]
    print(table(header, rows))
    if args.profile:
        split = {key: profile_step(models[key], decoders[key], args.tokens - 1) for key in models}
        print(f"\nms per decode step by part (forward hooks, {args.tokens - 1} steps each, not interleaved):")
        parts = list(next(iter(split.values())))
        print(table(["part", *models], [[part] + [f"{split[key][part]:.2f}" for key in models] for part in parts]))
    result: dict[str, Any] = {"family": family}
    for baseline in ("fp32", "int8"):
        result[f"over {baseline}"] = speedup(samples[baseline], samples["le-int8"])
    result["memory"] = {key: sizes[key] / sizes["fp32"] for key in ("int8", "le-int8")}
    del models, decoders
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--families", default=",".join(FAMILIES), help=f"comma-separated, from {FAMILIES}")
    add("--hidden", type=int, default=1024)
    add("--layers", type=int, default=4)
    add("--experts", type=int, default=8)
    add("--top-k", type=int, default=2)
    add("--intermediate", type=int, default=2048, help="each routed expert's intermediate size (default 2048)")
    add("--vocab", type=int, default=8000)
    add("--prompt", type=int, default=8, help="prompt tokens (default 8)")
    add("--tokens", type=int, default=16, help="generated tokens per round (default 16: 15 timed steps)")
    add("--rounds", type=int, default=5, help="rounds, each a whole generation per variant (default 5)")
    add("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    add("--seed", type=int, default=0)
    add("--quick", action="store_true", help=f"small models and a short run: {QUICK}, 2 rounds of 8 tokens")
    add("--torchao", action="store_true", help="add torchao's Int8WeightOnlyConfig on linear-experts")
    add("--profile", action="store_true", help="also print each variant's decode step split by part (attention, ...)")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.rounds, args.tokens = min(args.rounds, 2), min(args.tokens, 8)

    import torch
    import transformers

    import hfpatch_core

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if PACK not in hfpatch_core.discover().packs:
        raise SystemExit("the linear-experts pack is not installed: pip install plugins/hfpatch-pack-linear-experts")
    for line in machine_info():
        print(line)
    print(
        f"greedy decode at batch 1: {args.prompt}-token prompt, then {args.tokens - 1} single-token steps with the "
        f"KV cache; {args.rounds} rounds, steps interleaved across the variants (order rotated)"
    )
    started = time.perf_counter()
    results = [run_family(family, args) for family in args.families.split(",")]
    print(f"\nsummary ({time.perf_counter() - started:.0f} s): linear-experts + quantize_dynamic int8, side by side")
    rows = []
    for result in results:
        fp32, int8 = result["over fp32"], result["over int8"]
        rows.append(
            [
                result["family"],
                f"{fp32[0]:.2f}x ({fp32[1]:.2f}..{fp32[2]:.2f})",
                "met" if fp32[1] >= GOAL else "MISSED" if fp32[2] < GOAL else "within noise",
                f"{int8[0]:.2f}x ({int8[1]:.2f}..{int8[2]:.2f})",
                f"{result['memory']['int8']:.2f}",
                f"{result['memory']['le-int8']:.2f}",
            ]
        )
    print(
        table(
            [
                "family",
                "decode vs vanilla fp32 (95% CI)",
                f"goal >= {GOAL}x",
                "decode vs vanilla int8 (95% CI)",
                "memory: vanilla int8 / fp32",
                "memory: linear-experts int8 / fp32",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
