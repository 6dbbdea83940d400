"""``tiny_checkpoint`` across the zoo: every causal-LM model type of the installed transformers.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ``check_tiny_checkpoint``: the
shrunk default config builds a model of at most 20M parameters (counted on the meta device
first), which saves, loads again and gives finite logits.  Prints one line per failure (by
stage) and the count; exits 1 below ``--goal`` (default 0.95).

    USE_HUB_KERNELS=0 .venv/bin/python bench/zoo_checkpoints.py            # 2-5 min on 2 cores
    USE_HUB_KERNELS=0 .venv/bin/python bench/zoo_checkpoints.py llama gemma3
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
import warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="default: every causal-LM model type")
    parser.add_argument("--goal", type=float, default=0.95, help="the share that must work (default 0.95)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    from hfpatch_core.testing.checkpoints import check_tiny_checkpoint

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model_types = args.model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    start = time.perf_counter()
    failures = {}
    for model_type in model_types:
        problem = check_tiny_checkpoint(model_type)
        gc.collect()  # one model at a time: the peak memory is the largest model's, not the sum
        if problem is not None:
            failures[model_type] = problem
            print(f"FAIL {model_type}: {problem}", flush=True)
    working = len(model_types) - len(failures)
    print(
        f"tiny_checkpoint works for {working} of {len(model_types)} causal-LM model types "
        f"({working / len(model_types):.1%}; transformers {transformers.__version__}; "
        f"{time.perf_counter() - start:.0f} s; peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB)"
    )
    return 0 if working >= args.goal * len(model_types) else 1


if __name__ == "__main__":
    sys.exit(main())
