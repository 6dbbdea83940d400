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

os.environ.setdefault("USE_HUB_KERNELS", "0")
warnings.simplefilter("ignore")


def _meta_model(model_type: str) -> tuple[object, object]:
    """The tiny config ``verdict_of`` builds, and its causal-LM model on the meta device (``None`` if it fails)."""
    import torch

    from hfpatch_core.testing.checkpoints import _causal_lm_class, tiny_config

    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            return config, _causal_lm_class(config)(config)
    except Exception:
        return None, None


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

    from hfpatch_core.testing.zoo import causal_lm_model_types, coverage, verdict_of

    types = args.model_types or causal_lm_model_types()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fused-dense-zoo-") as directory:
        for number, model_type in enumerate(types, 1):
            row = verdict_of("fused-dense", model_type, Path(directory), generate_tokens=8)
            if row.verdict == "not applicable":
                config, model = _meta_model(model_type)
                if model is not None and any(candidate_kinds(module) for module in model.modules()):
                    reasons = refusals(config)
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
