"""Decode latency, memory and accuracy of a Qwen2-MoE quantized to dynamic int8, with and without qwen-moe.

transformers 5 keeps a Qwen2-MoE layer's routed experts as two 3-D parameters, which
``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)`` (like
any quantizer that swaps ``nn.Linear``) never reaches; the qwen-moe pack loads them as one
``nn.Linear`` triple per expert, so the same call quantizes every expert.

A random checkpoint is built from a config and saved with ``save_pretrained`` to a
temporary directory (default: hidden 1024, 6 layers, 16 experts of intermediate 704,
top-4, shared expert of intermediate 2816, 16 heads, vocab 32000, untied embeddings,
fp32: 350M parameters, 1.30 GiB).  It is loaded four ways:

* **vanilla fp32**: plain transformers (its default experts implementation);
* **vanilla int8**: the same, then ``quantize_dynamic(model, {nn.Linear}, qint8)``;
* **qwen-moe fp32**: loaded with ``hfpatch_core.enable("qwen-moe")``;
* **qwen-moe int8**: the same, then the same ``quantize_dynamic`` call;
* (**torchao int8wo**, with ``--torchao``, when torchao is importable: qwen-moe, then
  ``torchao.quantization.quantize_(model, Int8WeightOnlyConfig())``).

Each variant runs greedy decoding with the KV cache: a ``--prompt``-token prompt (one
forward, not timed), then ``--tokens - 1`` single-token steps, ``--rounds`` times.  A
sample is one step.  The variants advance together, one step of each in turn, the order
rotated every step, so that a burst of load from other processes (the machine is shared)
hits all of them alike; ms/token is the median step.  The report gives medians with the
interquartile range and speedups (vanilla fp32 / variant, vanilla int8 / variant) with a
95% bootstrap interval.  Goals: qwen-moe int8 >= 2.5x vanilla fp32 and >= 1.4x vanilla
int8.

Per variant it also prints: the number of ``nn.Linear`` the quantizer replaced, how many
expert weights are left in floating point, the bytes of parameters and buffers (packed
int8 weights included), and accuracy against vanilla fp32, on fp32's own greedy sequence
fed in one forward (teacher forcing): the max abs logit difference, the cosine similarity
of the last position's logits and the top-1 agreement over the generated positions; and
the agreement of the variant's own (free-running) greedy tokens with fp32's.

``--profile`` (default on) splits one decode step of the int8 variants into attention,
router, routed experts, shared expert (with its gate), the MoE block's own code (``mlp``),
lm_head and the rest, with forward hooks, each part counted once where parts nest (they add
a little time of their own: read the split, not the totals).

Run: ``PYTHONPATH=.venv/first-party-packs .venv/bin/python bench/quantization.py``
(``--quick`` for a small model and a short run; ``--help`` for sizes and counts).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import interleaved, load_causal_lm, machine_info, median, ratio_interval, spread, table

GOALS = {"fp32": 2.5, "int8": 1.4}
QUICK = dict(
    hidden=256, layers=2, experts=8, top_k=2, moe_intermediate=128, shared_intermediate=512, heads=4, vocab=4096
)


def speedup(baseline: list[float], variant: list[float]) -> tuple[float, float, float]:
    low, high = ratio_interval(baseline, variant)
    return median(baseline) / median(variant), low, high


def speedup_verdict(baseline: list[float], variant: list[float], goal: float) -> str:
    """``met`` / ``MISSED`` when the whole interval of baseline/variant is on one side of ``goal``."""
    value, low, high = speedup(baseline, variant)
    if low >= goal:
        return "met"
    if high < goal:
        return "MISSED"
    return f"{'met' if value >= goal else 'missed'} by the median, within noise"


def build_config(args: argparse.Namespace) -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        hidden_size=args.hidden,
        intermediate_size=args.shared_intermediate,
        moe_intermediate_size=args.moe_intermediate,
        shared_expert_intermediate_size=args.shared_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def load(path: Path, packs: str | None) -> Any:
    model = load_causal_lm(path, packs)
    materialize(model)
    return model


def materialize(model: Any) -> None:
    """Fresh memory for every tensor: ``from_pretrained`` leaves memory-mapped views of the file."""
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()


def dynamic_int8(model: Any) -> Any:
    import torch
    import torch.nn as nn
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13 deprecates torch.ao.quantization (and says so per call)
        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def torchao_int8_weight_only(model: Any) -> Any:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())
    return model


def quantized_linears(model: Any) -> int:
    """Linears the quantizer replaced (torch.ao) or gave a quantized weight (torchao's tensor subclasses)."""
    import torch
    import torch.ao.nn.quantized.dynamic as dynamic

    return sum(
        isinstance(module, dynamic.Linear)
        or (type(module) is torch.nn.Linear and type(module.weight) not in (torch.Tensor, torch.nn.Parameter))
        for module in model.modules()
    )


def float_expert_weights(model: Any) -> tuple[int, int]:
    """(expert weight tensors left in floating point, their parameters), over all layers."""
    import torch

    count = numel = 0
    for layer in model.model.layers:
        for tensor in layer.mlp.experts.parameters():
            # A plain floating-point tensor: quantized weights are packed (no parameter) or a tensor subclass.
            if tensor.is_floating_point() and type(tensor) in (torch.Tensor, torch.nn.Parameter):
                count += 1
                numel += tensor.numel()
    return count, numel


def tensor_bytes(model: Any) -> int:
    """Bytes of every tensor in the state dict, packed quantized weights included, shared ones once."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter):
            # A tensor subclass (torchao's quantized weights): count the tensors it holds.
            names, _ = value.__tensor_flatten__()
            for name in names:
                add(getattr(value, name))
        elif isinstance(value, torch.Tensor):
            if value.is_quantized:
                key, size = id(value), value.numel() * value.element_size()
            else:
                key, size = value.untyped_storage().data_ptr(), value.untyped_storage().nbytes()
            if key not in seen:
                seen.add(key)
                total += size
        elif isinstance(value, tuple | list):
            for item in value:
                add(item)

    for value in model.state_dict(keep_vars=True).values():
        add(value)
    return total


def cache_argument(model: Any) -> str:
    """``cache`` after transformers 5.3, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


class Decoder:
    """Greedy decoding of one model with the KV cache, one timed step at a time."""

    def __init__(self, model: Any, prompt: Any) -> None:
        self.model, self.prompt, self.cache_name = model, prompt, cache_argument(model)
        self.reset()

    def reset(self) -> None:
        """Run the prompt (not timed): the cache holds it, the first token is generated."""
        import torch

        with torch.inference_mode():
            output = self.model(input_ids=self.prompt, use_cache=True, logits_to_keep=1)
        self.cache = getattr(output, "cache", None) or output.past_key_values
        self.token = output.logits[:, -1].argmax(-1, keepdim=True)
        self.generated = [int(self.token)]

    def step(self) -> float:
        """One decode step (one token through the model, the cache growing by one); its seconds."""
        import torch

        with torch.inference_mode():
            start = time.perf_counter()
            output = self.model(input_ids=self.token, use_cache=True, **{self.cache_name: self.cache})
            self.token = output.logits[:, -1].argmax(-1, keepdim=True)
            seconds = time.perf_counter() - start
        self.generated.append(int(self.token))
        return seconds


def accuracy(model: Any, sequence: Any, reference: Any, prompt_length: int) -> dict[str, float]:
    """Teacher-forced logits on fp32's greedy sequence, against fp32's (``reference``)."""
    import torch
    import torch.nn.functional as F

    with torch.inference_mode():
        logits = model(input_ids=sequence).logits[0].float()
    generated = slice(prompt_length - 1, sequence.shape[1] - 1)
    return {
        "max_abs": (logits - reference).abs().max().item(),
        "cosine": F.cosine_similarity(logits[-1], reference[-1], dim=0).item(),
        "top1": (logits[generated].argmax(-1) == reference[generated].argmax(-1)).float().mean().item(),
    }


#: the parts of a decode step that ``--profile`` times, by the module names' last component
PARTS = {
    "self_attn": "attention",
    "gate": "router",
    "router": "router",
    "experts": "routed experts",
    "shared_experts": "shared expert",
    "shared_expert": "shared expert",
    "shared_expert_gate": "shared expert",
    "mlp": "mlp",  # a dense layer's MLP (deepseek_v3's first), and the MoE block's own code
    "lm_head": "lm_head",
}


def profile_step(model: Any, decoder: Decoder, steps: int) -> dict[str, float]:
    """ms per decode step spent in each part of the model (forward hooks, innermost part counted once)."""
    decoder.reset()  # the prompt, not counted
    spent = dict.fromkeys(dict.fromkeys(PARTS.values()), 0.0)
    handles = []
    stack: list[float] = []  # the inner parts' time, subtracted from the part around them
    for name, module in model.named_modules():
        part = PARTS.get(name.rsplit(".", 1)[-1])
        if part is None or (part == "router" and ".experts" in name):
            continue

        def pre(module: Any, args: Any) -> None:
            stack.append(0.0)
            module._bench_start = time.perf_counter()

        def post(module: Any, args: Any, output: Any, _part: str = part) -> None:
            elapsed = time.perf_counter() - module._bench_start
            inner = stack.pop()
            spent[_part] += elapsed - inner
            if stack:
                stack[-1] += elapsed

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    total = 0.0
    try:
        for _ in range(steps):
            total += decoder.step()
    finally:
        for handle in handles:
            handle.remove()
    result = {part: seconds / steps * 1e3 for part, seconds in spent.items()}
    result["rest (embedding, norms, residuals, mask, python)"] = total / steps * 1e3 - sum(result.values())
    result["total"] = total / steps * 1e3
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--hidden", type=int, default=1024)
    add("--layers", type=int, default=6)
    add("--experts", type=int, default=16)
    add("--top-k", type=int, default=4)
    add("--moe-intermediate", type=int, default=704, help="each routed expert's intermediate size (default 704)")
    add("--shared-intermediate", type=int, default=2816, help="the shared expert's intermediate size (default 2816)")
    add("--heads", type=int, default=16, help="attention heads, also the kv heads (default 16)")
    add("--vocab", type=int, default=32000)
    add("--prompt", type=int, default=8, help="prompt tokens (default 8)")
    add("--tokens", type=int, default=16, help="generated tokens per round (default 16: 15 timed steps)")
    add("--rounds", type=int, default=10, help="rounds, each a whole generation per variant (default 10)")
    add("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    add("--seed", type=int, default=0)
    add("--quick", action="store_true", help=f"a small model and a short run: {QUICK}, 3 rounds of 8 tokens")
    add("--torchao", action="store_true", help="add torchao's Int8WeightOnlyConfig on qwen-moe (needs torchao)")
    add("--no-profile", action="store_true", help="skip the per-part split of a decode step")
    args = parser.parse_args(argv)
    sizes = ("hidden", "layers", "experts", "top_k", "moe_intermediate", "shared_intermediate", "heads", "vocab")
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.rounds, args.tokens = min(args.rounds, 3), min(args.tokens, 8)
    default_model = all(getattr(args, name) == parser.get_default(name) for name in sizes)

    import torch
    import transformers

    import hfpatch_core

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if "qwen-moe" not in hfpatch_core.discover().packs:
        raise SystemExit("the qwen-moe pack is not installed: pip install plugins/hfpatch-pack-qwen-moe")
    for line in machine_info():
        print(line)
    print(f"quantized engine: {torch.backends.quantized.engine}")
    config = build_config(args)
    with tempfile.TemporaryDirectory(prefix="hfpatch-bench-quant-") as directory:
        path = Path(directory)
        torch.manual_seed(args.seed)
        started = time.perf_counter()
        source = transformers.Qwen2MoeForCausalLM(config)
        parameters = sum(p.numel() for p in source.parameters())
        source.save_pretrained(path)
        del source
        print(
            f"model: random Qwen2-MoE, hidden {args.hidden}, {args.layers} layers, {args.experts} experts "
            f"(intermediate {args.moe_intermediate}, top-{args.top_k}), shared expert {args.shared_intermediate}, "
            f"{args.heads} heads, vocab {args.vocab}: {parameters / 1e6:.1f}M parameters, "
            f"{parameters * 4 / 2**30:.2f} GiB fp32 (built and saved in {time.perf_counter() - started:.1f} s)"
        )
        builders: dict[str, tuple[str, Callable[[], Any]]] = {
            "fp32": ("vanilla fp32", lambda: load(path, None)),
            "int8": ("vanilla + quantize_dynamic int8", lambda: dynamic_int8(load(path, None))),
            "moe-fp32": ("qwen-moe fp32", lambda: load(path, "qwen-moe")),
            "moe-int8": ("qwen-moe + quantize_dynamic int8", lambda: dynamic_int8(load(path, "qwen-moe"))),
        }
        if args.torchao:
            builders["ao"] = (
                "qwen-moe + torchao Int8WeightOnlyConfig",
                lambda: torchao_int8_weight_only(load(path, "qwen-moe")),
            )
        models: dict[str, Any] = {}
        for key, (_, build) in builders.items():
            started = time.perf_counter()
            models[key] = build()
            print(f"  {builders[key][0]}: ready in {time.perf_counter() - started:.1f} s")

    prompt = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed))
    decoders = {key: Decoder(model, prompt) for key, model in models.items()}
    print(
        f"\ngreedy decode: {args.prompt}-token prompt, then {args.tokens - 1} single-token steps with the KV cache; "
        f"{args.rounds} rounds, each step interleaved across the variants (order rotated); a sample is one step"
    )
    # Warm-up: one whole generation per variant.
    for decoder in decoders.values():
        for _ in range(args.tokens - 1):
            decoder.step()
    samples: dict[str, list[float]] = {key: [] for key in models}
    for _ in range(args.rounds):
        for decoder in decoders.values():
            decoder.reset()
        gc.collect()
        for key, values in interleaved(
            {key: d.step for key, d in decoders.items()}, args.tokens - 1, collect=False
        ).items():
            samples[key] += values
    # fp32's greedy sequence: the reference of the accuracy columns.
    reference_tokens = decoders["fp32"].generated
    sequence = torch.cat([prompt, torch.tensor([reference_tokens])], dim=1)
    with torch.inference_mode():
        reference = models["fp32"](input_ids=sequence).logits[0].float()
    scale = reference.abs().max().item()
    rows = []
    for key, model in models.items():
        floats, float_numel = float_expert_weights(model)
        scores = accuracy(model, sequence, reference, args.prompt)
        own = decoders[key].generated
        agree = sum(a == b for a, b in zip(own, reference_tokens, strict=True)) / len(reference_tokens)
        rows.append(
            [
                builders[key][0],
                f"{median(samples[key]) * 1e3:.1f}",
                spread(samples[key]),
                f"{quantized_linears(model)}",
                f"{floats} ({float_numel / 1e6:.1f}M)",
                f"{tensor_bytes(model) / 2**20:.0f}",
                f"{scores['max_abs']:.2e}",
                f"{scores['cosine']:.6f}",
                f"{scores['top1']:.2f}",
                f"{agree:.2f}",
            ]
        )
    print(
        table(
            [
                "variant",
                "ms/token",
                "IQR ms",
                "quantized Linear",
                "fp expert weights",
                "params MiB",
                "max |dlogit|",
                "cos last",
                "top-1 (tf)",
                "greedy agree",
            ],
            rows,
        )
    )
    print(
        f"  accuracy against vanilla fp32 (|logits| <= {scale:.3f}): teacher-forced on fp32's greedy sequence; "
        "'greedy agree' is the variant's own greedy tokens, position by position"
    )
    for baseline in ("fp32", "int8"):
        for key in models:
            if key == baseline or (baseline == "int8" and key == "fp32"):
                continue
            value, low, high = speedup(samples[baseline], samples[key])
            line = f"  {builders[baseline][0]} / {builders[key][0]} = {value:.3f}x (95% CI {low:.3f}..{high:.3f})"
            if key == "moe-int8":
                goal = GOALS[baseline]
                line += f"  goal >= {goal}: {speedup_verdict(samples[baseline], samples[key], goal)}"
                if not default_model:
                    line += " (the goals are set for the default model)"
            print(line)

    if not args.no_profile:
        steps = max(args.tokens, 8)
        print(f"\nwhere a decode step's time goes ({steps} steps, forward hooks; ms per step)")
        variants = ("int8", "moe-int8", "fp32")
        profiles = {key: profile_step(models[key], Decoder(models[key], prompt), steps) for key in variants}
        names = list(profiles["moe-int8"])
        print(
            table(
                ["part", *(builders[key][0] for key in profiles)],
                [[name, *(f"{profiles[key][name]:.2f}" for key in profiles)] for name in names],
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
