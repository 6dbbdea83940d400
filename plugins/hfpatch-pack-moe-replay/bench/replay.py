"""The train/rollout mismatch that routing replay (R3) removes, measured on tiny MoE policies.

For three router families (softmax top-k: qwen2_moe; sigmoid with a selection-only
correction bias, group-limited: deepseek_v3; llama4's sigmoid of the selected logits:
llama4_text), a tiny random policy in bf16, loaded with the moe-replay pack:

1. rollout: ``generate`` (KV cache, sampling) under ``record_routing``, keeping the
   rollout's log-probabilities of the sampled tokens (``output_logits``);
2. training: one full forward over the same sequences, without and with
   ``replay_routing`` of the rollout's routes.

Printed side by side for both training forwards: the share of (token, layer) routing
decisions whose expert set differs from the rollout's, and the per-token difference
between the training and rollout log-probabilities of the sampled tokens (mean, max,
share above 0.1), and the mean KL(rollout || training) over the vocabulary. Goal: no
differing decision with replay. Usage (about a minute on 2 CPU cores, < 1 GB)::

    USE_HUB_KERNELS=0 python plugins/hfpatch-pack-moe-replay/bench/replay.py [--rows 16] [--new 48] [--seeds 2]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from hfpatch_pack_moe_replay import Routing, record_routing, replay_routing
from transformers import AutoModelForCausalLM, DeepseekV3Config, Llama4TextConfig, Qwen2MoeConfig

from hfpatch_core.testing import load_model

VOCAB = 512
PROMPT = 16
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=0,
    # far from the default 0.02, so that the policy's next-token distribution and the routers'
    # scores are far from uniform, as in a trained model
    initializer_range=0.2,
)

FAMILIES: dict[str, Callable[[], Any]] = {
    "qwen2_moe (softmax top-k)": lambda: Qwen2MoeConfig(
        **_COMMON,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    "deepseek_v3 (sigmoid + bias)": lambda: DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=32,
        n_routed_experts=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    "llama4_text (sigmoid, llama4)": lambda: Llama4TextConfig(
        **_COMMON,
        intermediate_size_mlp=128,
        num_local_experts=16,
        num_experts_per_tok=1,
        head_dim=16,
        interleave_moe_layer_step=1,
        no_rope_layers=[1, 1, 1, 1],
        attention_chunk_size=512,
    ),
}


def _policy(config: Any, directory: Path, seed: int) -> Any:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if hasattr(config, "n_routed_experts"):
        # a trained deepseek-v3 router has a non-zero correction bias; a fresh one is zeros
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.rand(buffer.shape) * 0.2)
    model.save_pretrained(directory)
    return load_model(directory, "moe-replay", dtype=torch.bfloat16)


def _decisions_differ(rollout: Routing, training: Routing, length: int) -> tuple[int, int]:
    """``(differing, total)`` (token, layer) decisions over each sequence's first ``length`` tokens."""
    differing = total = 0
    for want, got in zip(rollout.layers, training.layers, strict=True):
        want = want.reshape(rollout.batch_size, rollout.seq_len, -1)[:, :length].sort(-1).values
        got = got.reshape(training.batch_size, training.seq_len, -1)[:, :length].sort(-1).values
        differing += int((want != got).any(-1).sum())
        total += want.shape[0] * want.shape[1]
    return differing, total


def _measure(model: Any, rows: int, new: int, seed: int) -> dict[str, dict[str, float]]:
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (rows, PROMPT), generator=generator)
    torch.manual_seed(seed)
    with torch.no_grad(), record_routing(model) as recording:
        out = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    sequences = out.sequences
    sampled = sequences[:, PROMPT:]
    rollout_logp = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # (rows, new, vocab)
    routing = recording.routing  # prompt + new - 1 tokens: the last one is never fed back
    covered = routing.seq_len
    results = {}
    for label, replay in (("without replay", False), ("with replay", True)):
        with torch.no_grad(), record_routing(model) as live:
            if replay:
                with replay_routing(model, routing.padded(sequences.shape[1])):
                    logits = model(input_ids=sequences).logits
            else:
                logits = model(input_ids=sequences).logits
        train_logp = logits[:, PROMPT - 1 : -1].float().log_softmax(-1)
        gap = (
            (train_logp.gather(-1, sampled[..., None]) - rollout_logp.gather(-1, sampled[..., None])).squeeze(-1).abs()
        )
        kl = (rollout_logp.exp() * (rollout_logp - train_logp)).sum(-1)
        differing, total = _decisions_differ(routing, live.routing, covered)
        results[label] = {
            "differing": differing,
            "decisions": total,
            "mean": float(gap.mean()),
            "max": float(gap.max()),
            "over": float((gap > 0.1).float().mean()),
            "kl": float(kl.mean()),
        }
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="rollouts per policy")
    parser.add_argument("--new", type=int, default=48, help="sampled tokens per rollout")
    parser.add_argument("--seeds", type=int, default=2, help="policies (random weights) per family")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"bf16 policies: hidden 64, 4 MoE layers, 16 experts; {args.rows} rollouts x {PROMPT} prompt +")
    print(
        f"{args.new} sampled tokens, {args.seeds} random policies per family; "
        "training forward vs the rollout's generate (KV cache)\n"
    )
    header = f"{'family':32s} {'training forward':16s} {'differing decisions':>22s} {'|dlogp| mean':>12s} "
    header += f"{'max':>8s} {'> 0.1':>7s} {'KL mean':>9s}"
    print(header)
    print("-" * len(header))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hfpatch-replay-bench-") as scratch:
        for family, build in FAMILIES.items():
            totals: dict[str, dict[str, float]] = {}
            for seed in range(args.seeds):
                model = _policy(build(), Path(scratch) / f"{family.split()[0]}-{seed}", seed)
                for label, values in _measure(model, args.rows, args.new, seed).items():
                    into = totals.setdefault(label, {"max": 0.0})
                    for key, value in values.items():
                        into[key] = max(into["max"], value) if key == "max" else into.get(key, 0.0) + value
                del model
            for label, values in totals.items():
                share = values["differing"] / values["decisions"]
                print(
                    f"{family:32s} {label:16s} {int(values['differing']):>7d}/{int(values['decisions']):<6d} "
                    f"({share:6.2%}) {values['mean'] / args.seeds:12.4f} {values['max']:8.4f} "
                    f"{values['over'] / args.seeds:7.2%} {values['kl'] / args.seeds:9.2e}"
                )
    print(f"\n{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
