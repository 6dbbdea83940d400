"""Which MoE model types of the installed transformers moe-replay replays, on tiny checkpoints.

For every model type of the causal-LM mapping whose modeling module has a top-k over
experts (``moe_model_types``): build a tiny random checkpoint (``tiny_checkpoint``), load
it with the pack, record the routing of a forward pass, replay it and compare the logits
(bit for bit). Prints one line per model type, then the counts::

    USE_HUB_KERNELS=0 python plugins/hfpatch-pack-moe-replay/zoo_coverage.py [MODEL_TYPE ...]

``replay exact``: replayed, logits identical; ``refused``: the pack refuses it (the reason);
``checkpoint does not build``: ``tiny_checkpoint`` or the load fails, so nothing is measured.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter

import torch
import transformers
from hfpatch_pack_moe_replay import discover, moe_model_types, record_routing, replay_routing

import hfpatch_core
from hfpatch_core.testing import load_model, tiny_checkpoint


def measure(model_type: str) -> tuple[str, str]:
    """``(outcome, detail)`` for one model type."""
    try:
        checkpoint = tiny_checkpoint(model_type)
        config = transformers.AutoConfig.from_pretrained(checkpoint)
    except Exception as exc:
        return "checkpoint does not build", f"{type(exc).__name__}: {str(exc)[:160]}"
    vocab = int(getattr(config.get_text_config(), "vocab_size", 64) or 64)
    ids = torch.randint(3, min(vocab, 200), (2, 7), generator=torch.Generator().manual_seed(0))
    try:  # a tiny checkpoint whose vanilla model does not run measures nothing
        with torch.no_grad():
            load_model(checkpoint)(input_ids=ids)
    except Exception as exc:
        return "checkpoint does not build", f"vanilla forward: {type(exc).__name__}: {str(exc)[:160]}"
    found = discover(config.model_type, config)
    if not found.replayable:
        if "does not run on hidden states alone" in str(found.refused) and discover(model_type).replayable:
            # the shrunk config breaks the router (more expert groups than experts), not the rule
            return "checkpoint does not build", f"its tiny MoE config is inconsistent: {found.refused}"
        return "refused", str(found.refused)
    try:
        model = load_model(checkpoint, "moe-replay")
    except Exception as exc:
        return "replay fails", f"load: {type(exc).__name__}: {str(exc)[:160]}"
    rules = "; ".join(sorted({family.rule for family in found.routers}))
    try:
        with torch.no_grad():
            with record_routing(model) as recording:
                live = model(input_ids=ids).logits
            with replay_routing(model, recording.routing):
                replayed = model(input_ids=ids).logits
    except Exception as exc:
        if "has no MoE router" in str(exc):  # the tiny config kept no sparse layer
            return "checkpoint does not build", f"no MoE layer: {str(exc)[:160]}"
        return "replay fails", f"{type(exc).__name__}: {str(exc)[:200]}"
    if not torch.equal(live, replayed):
        return "replay inexact", f"max |diff| {float((live - replayed).abs().max()):.3g} ({rules})"
    return "replay exact", f"{recording.routing.num_layers} routers; {rules}"


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    transformers.utils.logging.set_verbosity_error()
    hfpatch_core.disable()
    types = argv or moe_model_types()
    counts: Counter[str] = Counter()
    for model_type in types:
        outcome, detail = measure(model_type)
        counts[outcome] += 1
        print(f"{model_type:24s} {outcome:26s} {detail}", flush=True)
    built = sum(count for outcome, count in counts.items() if outcome != "checkpoint does not build")
    print()
    for outcome, count in sorted(counts.items()):
        print(f"{outcome:26s} {count}")
    if built:
        print(
            f"replayed exactly: {counts['replay exact']} of the {built} MoE model types whose tiny checkpoint builds "
            f"({100 * counts['replay exact'] / built:.0f}%), {len(types)} MoE model types in all"
        )
    return 0 if not counts["replay inexact"] + counts["replay fails"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
