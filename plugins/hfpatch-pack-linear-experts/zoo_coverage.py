"""Coverage of the ``linear-experts`` pack over the MoE model types of the installed transformers.

For every model type of the causal-LM mapping whose modeling module declares an experts
class through ``use_experts_implementation``: build a tiny checkpoint
(``hfpatch_core.testing.tiny_checkpoint``), then

* ``exact``: the pack replaced its experts and ``check_pack_equivalence`` passed (fp32 logits
  within 1e-5 of vanilla, the save round trip, and, with ``--full``, greedy generation and
  the apply path);
* ``refused``: the pack left the experts to transformers, with the reason it gives;
* ``failed``: the pack replaced the experts but a check failed (a bug);
* ``no build``: the tiny checkpoint does not build, vanilla transformers cannot run it, or it
  has no sparse experts module.

Run: ``USE_HUB_KERNELS=0 PYTHONPATH=.venv/first-party-packs .venv/bin/python
plugins/hfpatch-pack-linear-experts/zoo_coverage.py [MODEL_TYPE ...] [--full]``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections import Counter

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def moe_model_types() -> list[str]:
    """The causal-LM model types whose modeling module declares experts through the decorator."""
    from hfpatch_pack_linear_experts.experts import is_declared_experts

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except Exception:
            continue
        if any(isinstance(value, type) and is_declared_experts(value) for value in vars(module).values()):
            found.append(model_type)
    return found


def measure(model_type: str, full: bool) -> tuple[str, str]:
    from hfpatch_core.errors import PackWarning
    from hfpatch_core.testing import check_pack_equivalence, tiny_checkpoint

    try:
        path = tiny_checkpoint(model_type)
    except Exception as exc:
        return "no build", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    try:  # a tiny checkpoint vanilla transformers cannot run proves nothing about the pack
        from hfpatch_core.testing import load_model, logits_of, padded_batch

        vanilla = load_model(path)
        ids, mask = padded_batch(int(vanilla.config.get_text_config().vocab_size), pad_token_id=0)
        logits_of(vanilla, ids, mask)
    except Exception as exc:
        return "no build", f"vanilla cannot run it: {type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report = check_pack_equivalence("linear-experts", path, generate_tokens=20 if full else 0, apply_path=full)
        except Exception as exc:
            return "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    refusals = [str(w.message) for w in caught if issubclass(w.category, PackWarning) and "left as" in str(w.message)]
    if report.replaced and not report.failures:
        return "exact", ", ".join(sorted(report.replaced)) + (f" (also refused: {refusals})" if refusals else "")
    if refusals:
        return "refused", " | ".join(message.split("builds it: ", 1)[-1] for message in refusals)[:300]
    if not report.replaced and any("replaced no class" in failure for failure in report.failures):
        return "no build", "the tiny checkpoint has no sparse experts module"
    return "failed", "; ".join(report.failures)[:300]


def main(argv: list[str]) -> int:
    full = "--full" in argv
    types = [arg for arg in argv if not arg.startswith("--")] or moe_model_types()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    counts: Counter[str] = Counter()
    for model_type in types:
        outcome, detail = measure(model_type, full)
        counts[outcome] += 1
        print(f"{model_type:28s} {outcome:9s} {detail}", flush=True)
    built = counts["exact"] + counts["refused"] + counts["failed"]
    share = f"{100 * counts['exact'] / built:.0f}%" if built else "n/a"
    print(
        f"\n{len(types)} MoE model types (transformers {transformers.__version__}): "
        + ", ".join(f"{counts[key]} {key}" for key in ("exact", "refused", "failed", "no build"))
        + f"; exact on {share} of the {built} whose tiny checkpoint builds"
    )
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
