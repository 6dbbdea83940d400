"""vLLM serves the quantized checkpoints ``interop/serving_checkpoints.py`` saved through the converting packs.

Run by ``test_quantized_serving.py`` as ``python serve_quantized.py CHECKPOINTS_DIR`` with the
engine venv's Python (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller): for each scheme it
starts an in-process engine on ``CHECKPOINTS_DIR/<scheme>``, generates greedily from the prompt of
``transformers.json`` in the entry's ``dtype`` (``interop/harness.py``'s ``vllm_dtype``), and writes
the tokens, or the error that stopped the engine, to ``CHECKPOINTS_DIR/vllm.json``.
``interop/quantization_table.py`` serves every checkpoint of its table this way too.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def main(root: str) -> None:
    from vllm import LLM, SamplingParams

    directory = Path(root)
    reference = json.loads((directory / "transformers.json").read_text())
    results: dict[str, object] = {}
    for scheme, expected in reference["schemes"].items():
        dtype = expected["dtype"]
        try:
            llm = LLM(
                model=str(directory / scheme),
                skip_tokenizer_init=True,
                dtype=dtype,
                max_model_len=64,
                enforce_eager=True,
                distributed_executor_backend="uni",
                seed=0,
            )
            params = SamplingParams(
                max_tokens=len(expected["tokens"]), temperature=0.0, detokenize=False, ignore_eos=True
            )
            outputs = llm.generate([{"prompt_token_ids": reference["prompt"]}], params, use_tqdm=False)
            results[scheme] = {"tokens": list(outputs[0].outputs[0].token_ids), "dtype": dtype}
            del llm
            gc.collect()
        except Exception as exc:  # the test names what stopped the engine
            results[scheme] = {"error": f"{type(exc).__name__}: {exc}"}
    (directory / "vllm.json").write_text(json.dumps(results))


if __name__ == "__main__":  # vLLM may start processes that import this module again
    main(sys.argv[1])
