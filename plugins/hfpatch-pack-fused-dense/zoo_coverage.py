"""fused-dense against every causal-LM model type of the installed transformers: exact, refused, failed.

Run from the repository root, with the pack installed::

    USE_HUB_KERNELS=0 PYTHONPATH=.venv/first-party-packs .venv/bin/python \\
        plugins/hfpatch-pack-fused-dense/zoo_coverage.py [--json rows.json] [MODEL_TYPE ...]

For each model type, ``hfpatch_core.testing.zoo.verdict_of`` builds a tiny checkpoint
(``tiny_checkpoint``) and checks the pack on it (weights, fp32 logits, greedy generation,
the saved layout).  Where the pack replaced nothing, the row says why from the pack's
own ``refusals``: ``refused`` with the reasons where the model has a candidate, ``not
applicable`` where it has none.  The last lines count each verdict, and the share of
exact rows among the model types with a candidate whose checkpoint builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("USE_HUB_KERNELS", "0")
warnings.simplefilter("ignore")


#: A tiny checkpoint larger than this is not built (a composite model whose sub-configs
#: ``tiny_config`` does not shrink yet): "no checkpoint".
MAX_PARAMETERS = 60_000_000


def _meta_model(model_type: str) -> tuple[Any, Any, str]:
    """The tiny config ``verdict_of`` builds, its causal-LM model on the meta device, and why not."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from hfpatch_core.testing.checkpoints import tiny_config

    try:
        config = tiny_config(model_type)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config), ""
    except Exception as exc:
        return None, None, f"{type(exc).__name__}: {exc}"


def _vanilla_problem(checkpoint: Path) -> str | None:
    """Why the checkpoint does not run, without any pack, the left-padded batch ``verdict_of`` compares on."""
    import torch
    from transformers import AutoModelForCausalLM

    from hfpatch_core.testing import padded_batch

    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        ids, mask = padded_batch(int(model.config.get_text_config().vocab_size), pad_token_id=0)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="model types (default: every causal-LM model type)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from hfpatch_pack_fused_dense import refusals
    from hfpatch_pack_fused_dense.detection import candidate_kinds

    from hfpatch_core.testing.zoo import ZooRow, causal_lm_model_types, coverage, verdict_of

    types = args.model_types or causal_lm_model_types()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fused-dense-zoo-") as directory:
        for number, model_type in enumerate(types, 1):
            config, model, problem = _meta_model(model_type)
            if model is None:
                row = ZooRow("fused-dense", model_type, "no checkpoint", problem[:200])
            elif not any(candidate_kinds(module) for module in model.modules()):
                row = ZooRow("fused-dense", model_type, "not applicable")
            elif (size := sum(p.numel() for p in model.parameters())) > MAX_PARAMETERS:
                row = ZooRow("fused-dense", model_type, "no checkpoint", f"the tiny checkpoint has {size:,} parameters")
            else:
                row = verdict_of("fused-dense", model_type, Path(directory), generate_tokens=8)
                problem = _vanilla_problem(Path(directory) / model_type) if row.verdict == "failed" else None
                if problem is not None:  # the checkpoint is broken without the pack too
                    row = dataclasses.replace(row, verdict="no checkpoint", detail=f"vanilla fails: {problem}"[:200])
            candidate = model is not None and any(candidate_kinds(module) for module in model.modules())
            if row.verdict == "not applicable" and candidate:
                reasons = refusals(config, type(model).__name__)
                detail = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
                row = dataclasses.replace(row, verdict="refused", detail=detail or "candidate not claimed")
            rows.append(row)
            print(f"[{number}/{len(types)}] {row.model_type:28} {row.verdict:15} {row.detail[:150]}", flush=True)
    counts = coverage(rows)
    candidates = counts["exact"] + counts["failed"] + counts["refused"]
    print("counts:", json.dumps(counts))
    if candidates:
        share = counts["exact"] / candidates
        print(f"exact: {counts['exact']} of {candidates} model types with a candidate and a checkpoint ({share:.0%})")
    if args.json:
        args.json.write_text(json.dumps([row.to_json() for row in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
