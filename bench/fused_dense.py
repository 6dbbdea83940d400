"""Forward latency with and without the ``fused-dense`` pack (fused ``qkv_proj`` / ``gate_up_proj``).

A random checkpoint of realistic width is built from a config and saved with
``save_pretrained`` to a temporary directory (default: llama, hidden 1024, intermediate
2816, 4 layers, 16 heads / 4 kv heads, vocab 32000, fp32: 110M parameters).  It is
loaded twice: vanilla, and with ``hfpatch_core.enable("fused-dense")``.  Both models must
give the same logits (checked before timing), and both models' tensors are cloned into
fresh memory (``--no-materialize`` keeps vanilla's memory-mapped from the safetensors file
while the fused tensors are new allocations, which moves prefill by up to 10% from one
process to the next).  Then, interleaved round by round (one
sample of each variant per round, the order rotated each round):

* **prefill**: batch 1 x 512 tokens, a fresh KV cache, ``logits_to_keep=1`` (what
  ``generate`` asks for);
* **decode**: batch 1, 1 token on a KV cache holding 512 tokens (a copy of one cache
  filled once per variant; the copy is made outside the timed region), full model;
* **decode, layers only**: the same step through ``model.model`` (no ``lm_head``, whose
  32000 x 1024 matrix is the same in both variants), to show the part the pack changes.

A decode sample is the median of ``--decode-repeats`` steps.  Each row reports medians,
interquartile ranges and the speedup vanilla / fused with a 95% bootstrap interval.
Goal: decode speedup >= 1.15.  ``--profile`` (default on) prints the top operators of
a few decode steps of each variant (torch.profiler), and the per-load cost of the pack's
structural detection is measured for this config and for a 7B-size llama config.
Last, the projections alone (every linear once, on one token) are timed for both
variants, interleaved: the pack changes nothing else, so their difference bounds the
decode speedup it can give; the time reading the weights once takes, at this machine's
memory read rate, is printed for scale.

Run: ``.venv/bin/python bench/fused_dense.py`` (``--help`` for sizes and round counts).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import interleaved, load_causal_lm, machine_info, median, ratio_interval, repeat, spread, table, timed

PACK = "fused-dense"
GOAL = 1.15


def speedup_verdict(vanilla: list[float], fused: list[float], goal: float) -> str:
    """``met`` / ``MISSED`` when the whole interval of vanilla/fused is on one side of ``goal``."""
    low, high = ratio_interval(vanilla, fused)
    if low >= goal:
        return "met"
    if high < goal:
        return "MISSED"
    return f"{'met' if median(vanilla) / median(fused) >= goal else 'missed'} by the median, within noise"


def build_config(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        args.model_type,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def materialize(model: Any) -> None:
    """Give every parameter and buffer fresh memory of its own (a clone).

    ``from_pretrained`` leaves the tensors it loads unchanged as views of the memory-mapped
    safetensors file, while the fused tensors are new allocations; cloning both models'
    tensors keeps that difference in where the weights live out of the comparison.
    """
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()


def cache_argument(model: Any) -> str:
    """``cache`` after transformers 5.3, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


class Runner:
    """One model's prefill and decode steps, with a KV cache of the prompt filled once."""

    def __init__(self, model: Any, prompt: Any, token: Any) -> None:
        import torch

        self.model, self.prompt, self.token = model, prompt, token
        self.cache_name = cache_argument(model)
        with torch.inference_mode():
            output = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        self.cache = getattr(output, "cache", None) or output.past_key_values
        self.last_logits = output.logits[:, -1].float()

    def prefill(self) -> float:
        import torch

        with torch.inference_mode():
            return timed(lambda: self.model(input_ids=self.prompt, use_cache=True, logits_to_keep=1))

    def decode_arguments(self) -> dict[str, Any]:
        """Keyword arguments of one decode step, on a fresh copy of the prompt's cache."""
        return {"input_ids": self.token, self.cache_name: copy.deepcopy(self.cache), "use_cache": True}

    def _decode_once(self, module: Any) -> float:
        import torch

        kwargs = self.decode_arguments()
        with torch.inference_mode():
            return timed(lambda: module(**kwargs))

    def decode(self, repeats: int) -> float:
        return median([self._decode_once(self.model) for _ in range(repeats)])

    def decode_layers(self, repeats: int) -> float:
        return median([self._decode_once(self.model.model) for _ in range(repeats)])

    def decode_logits(self) -> Any:
        import torch

        with torch.inference_mode():
            output = self.model(input_ids=self.token, **{self.cache_name: copy.deepcopy(self.cache)}, use_cache=True)
        return output.logits[:, -1].float()


def detection_cost(config: Any) -> list[list[str]]:
    """Cold and warm cost of the pack's per-load work (detection + both hooks) for ``config``."""
    import hfpatch_pack_fused_dense as pack
    from hfpatch_pack_fused_dense import detection
    from transformers import AutoConfig

    from hfpatch_core import LoadContext

    rows = []
    seven_b = AutoConfig.for_model(
        config.model_type,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
    )
    big = f"7B-size {config.model_type} (32 layers, hidden 4096)"
    for label, cfg in (("this config", config), (big, seven_b)):
        context = LoadContext(model_type=cfg.model_type, model_class_name="AnyForCausalLM", config=cfg)

        def hooks(context: LoadContext = context) -> None:
            pack.provide_patches(context)
            pack.provide_converters(context)

        cold = []
        for _ in range(5):
            detection.clear_cache()
            cold.append(timed(hooks))
        warm = repeat(hooks, 200)
        rows.append([label, f"{median(cold) * 1e3:.2f}", f"{median(warm) * 1e3:.3f}"])
    detection.clear_cache()
    return rows


def _descendants(event: Any) -> Any:
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def profile(runners: dict[str, Runner], steps: int, rounds: int = 4) -> None:
    """Where a decode step's time goes, per variant: operator self times inside the steps only.

    Each step runs under a ``record_function`` range, with its cache copy made outside it;
    only operators below those ranges are counted.  The variants alternate over
    ``rounds`` profiler sessions (order rotated), as the timed rounds do.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    names = list(runners)
    totals: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    walls: dict[str, float] = dict.fromkeys(names, 0.0)
    per_round = max(1, steps // rounds)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            runner = runners[name]
            runner.decode(1)  # warm
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(per_round):
                    kwargs = runner.decode_arguments()
                    with record_function("decode step"):
                        runner.model(**kwargs)
            for step in (event for event in prof.events() if event.name == "decode step"):
                walls[name] += step.cpu_time_total
                for event in _descendants(step):
                    entry = totals[name].setdefault(event.name, [0.0, 0.0])
                    entry[0] += 1
                    entry[1] += event.self_cpu_time_total
    count = per_round * rounds
    rows = []
    for name in names:
        found = totals[name]
        ops_ms = sum(entry[1] for entry in found.values()) / count / 1e3
        mm_ms = found.get("aten::mm", [0.0, 0.0])[1] / count / 1e3
        linear = int(found.get("aten::linear", [0.0, 0.0])[0]) // count
        rows.append([name, f"{walls[name] / count / 1e3:.2f}", linear, f"{mm_ms:.2f}", f"{ops_ms:.2f}"])
    print(f"\nprofile: {count} decode steps per variant (torch.profiler, CPU; inside the steps only), per step")
    print(table(["variant", "step ms (profiled)", "aten::linear calls", "aten::mm self ms", "all ops self ms"], rows))
    top = sorted(totals[names[0]], key=lambda key: -totals[names[0]][key][1])[:8]
    body = []
    for key in top:
        entries = [totals[name].get(key, [0.0, 0.0]) for name in names]
        times = [f"{entry[1] / count / 1e3:.3f}" for entry in entries]
        body.append([key, *times, " / ".join(str(int(entry[0]) // count) for entry in entries)])
    print(f"\ntop operators by self time, ms per step (calls per step: {' / '.join(names)})")
    print(table(["operator", *names, "calls"], body))


def weight_bytes_per_decode_step(model: Any) -> int:
    """Bytes of weights one decode step reads: every parameter once, but one row of the input embedding."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embedding
    return total if tied else total - embedding.numel() * embedding.element_size() + embedding[0].nbytes


def projections_sampler(model: Any, repeats: int) -> Callable[[], float]:
    """A sample of every ``nn.Linear`` of ``model`` run once on one token, as a decode step runs them.

    The part of a decode step the pack changes: the fused variant has fewer, wider
    linears reading the same weights.  A sample is the median of ``repeats`` passes.
    """
    import torch

    inputs = [
        (module, torch.randn(1, 1, module.in_features))
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
    ]

    def run_all() -> None:
        for module, x in inputs:
            module(x)

    def sample() -> float:
        with torch.inference_mode():
            return median(repeat(run_all, repeats))

    return sample


def memory_bound(runners: dict[str, Runner], decode: list[float], rounds: int, repeats: int) -> list[str]:
    """How much faster the pack could make a decode step at most, measured on this machine.

    The pack changes only the projections, so a step can get at most faster by the time
    the vanilla projections take beyond the fused ones (every linear once, interleaved
    like the phases).  For scale: the time reading the weights once takes, at the best
    ``tensor.sum()`` rate over 1 GiB of fp32 (larger than any cache here).
    """
    import torch

    samples = interleaved(
        {name: projections_sampler(runner.model, repeats) for name, runner in runners.items()}, rounds
    )
    vanilla, fused = median(samples["vanilla"]), median(samples["fused"])
    counts = {
        name: sum(isinstance(m, torch.nn.Linear) for m in runner.model.modules()) for name, runner in runners.items()
    }
    step = median(decode)
    saved = vanilla - fused
    buffer = torch.ones(256 * 1024 * 1024)
    buffer.sum()  # first touch
    rate = buffer.nbytes / min(repeat(buffer.sum, 5))
    del buffer
    weights = weight_bytes_per_decode_step(runners["vanilla"].model)
    return [
        f"every linear once, 1 token: vanilla {vanilla * 1e3:.2f} ms ({counts['vanilla']} calls), "
        f"fused {fused * 1e3:.2f} ms ({counts['fused']} calls): the pack can save {saved * 1e3:.2f} ms of a "
        f"{step * 1e3:.2f} ms decode step, at most {step / max(step - saved, 1e-12):.3f}x faster (goal {GOAL}x)",
        f"weights read per decode step: {weights / 1e6:.1f} MB; memory read rate (tensor.sum, 1 GiB) "
        f"{rate / 1e9:.1f} GB/s, so reading them takes {weights / rate * 1e3:.2f} ms; the vanilla linears read "
        f"them at {weights / vanilla / 1e9:.1f} GB/s",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=512, help="prefill length, and the decode step's cache length")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--decode-repeats", type=int, default=9, help="decode steps per sample (median)")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument(
        "--no-materialize",
        dest="materialize",
        action="store_false",
        help="keep the loaded weights where from_pretrained put them (memory-mapped for vanilla's)",
    )
    args = parser.parse_args(argv)

    import torch
    import transformers

    import hfpatch_core

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if PACK not in hfpatch_core.discover().packs:
        raise SystemExit(
            "fused-dense is not installed: pip install --no-deps -e plugins/hfpatch-pack-fused-dense (exit 2)"
        )
    for line in machine_info():
        print(line)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    config = build_config(args)
    with tempfile.TemporaryDirectory(prefix="hfpatch-bench-fused-") as work:
        path = Path(work) / args.model_type
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        built = AutoModelForCausalLM.from_config(config)
        parameters = sum(p.numel() for p in built.parameters())
        built.save_pretrained(path)
        del built
        print(
            f"\ncheckpoint: {args.model_type}, hidden {args.hidden}, intermediate {args.intermediate}, "
            f"{args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, vocab {args.vocab}, fp32: "
            f"{parameters / 1e6:.1f}M parameters (built and saved in {time.perf_counter() - start:.1f} s)"
        )
        vanilla, fused = load_causal_lm(path, None), load_causal_lm(path, PACK)
        if args.materialize:
            materialize(vanilla)
            materialize(fused)
    plan = hfpatch_core.plan_of(fused)
    assert plan is not None and plan.replaced, "fused-dense replaced nothing"
    print(plan.summary())

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, args.vocab, (1, args.tokens), generator=generator)
    token = torch.randint(3, args.vocab, (1, 1), generator=generator)
    runners = {"vanilla": Runner(vanilla, prompt, token), "fused": Runner(fused, prompt, token)}
    prefill_diff = (runners["vanilla"].last_logits - runners["fused"].last_logits).abs().max().item()
    decode_diff = (runners["vanilla"].decode_logits() - runners["fused"].decode_logits()).abs().max().item()
    print(f"max |logits vanilla - fused|: prefill {prefill_diff:.3g}, decode {decode_diff:.3g} (fp32)")
    assert max(prefill_diff, decode_diff) <= 1e-4, "the fused model computes something else"

    phases: dict[str, Callable[[Runner], Callable[[], float]]] = {
        f"prefill (1 x {args.tokens})": lambda runner: runner.prefill,
        f"decode (1 token, cache {args.tokens})": lambda runner: lambda: runner.decode(args.decode_repeats),
        "decode, layers only (model.model)": lambda runner: lambda: runner.decode_layers(args.decode_repeats),
    }
    rows = []
    decode_samples: list[float] = []
    for phase, sampler in phases.items():
        for runner in runners.values():
            sampler(runner)()  # warm-up, untimed
        samples = interleaved({name: sampler(runner) for name, runner in runners.items()}, args.rounds)
        a, b = samples["vanilla"], samples["fused"]
        if phase.startswith("decode ("):
            decode_samples = a
        low, high = ratio_interval(a, b)
        goal = speedup_verdict(a, b, GOAL) if phase.startswith("decode (") else "-"
        rows.append(
            [
                phase,
                f"{median(a) * 1e3:.2f}",
                spread(a),
                f"{median(b) * 1e3:.2f}",
                spread(b),
                f"{median(a) / median(b):.3f} ({low:.3f}..{high:.3f})",
                goal,
            ]
        )
    print(f"\n{args.rounds} rounds, variants interleaved (order rotated each round)")
    header = ["phase", "vanilla ms", "IQR ms", "fused ms", "IQR ms", "speedup (95% CI)", f"goal >= {GOAL}"]
    print(table(header, rows))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    print("\nthe most the pack can save per decode step (its projections alone, measured side by side)")
    for line in memory_bound(runners, decode_samples, args.rounds, args.decode_repeats):
        print(f"  {line}")

    print("\nper-load cost of the pack's hooks (structural detection on the meta device + patches + converters)")
    print(table(["config", "cold ms (cache cleared)", "warm ms (cached)"], detection_cost(config)))

    if args.profile:
        profile(runners, steps=20)


if __name__ == "__main__":
    main()
