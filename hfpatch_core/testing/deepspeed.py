"""Training a pack under DeepSpeed ZeRO-3 with ``transformers.Trainer``: ``torchrun`` with 2 CPU ranks (gloo).

``zero3_training(cases)`` starts one torchrun on this machine (``launcher``); each rank runs every case in
turn: it loads the checkpoint with the case's packs, trains ``steps`` steps with ``Trainer``
and a ZeRO-3 config (``ZERO3_CONFIG``), saves with ``Trainer.save_model`` and, on rank 0,
reloads what was written with vanilla transformers.  ``reference_losses`` trains the same
steps on one process without DeepSpeed (the reference); ``loss_bound`` is the bound a pack's
ZeRO-3 losses are held to, calibrated in the run.  A test::

    cases = [Zero3Case("llama/vanilla", path, "none"), Zero3Case("llama/fused-dense", path, "fused-dense")]
    results = zero3_training(cases)
    reference = reference_losses(path, "none")
    bound = loss_bound(results["llama/vanilla"].losses, reference)
    assert results["llama/fused-dense"].max_loss_diff(reference) <= bound

To compare the trained weights too: ``Zero3Case(optim="sgd", weights=FILE)`` (rank 0 writes them,
gathered), ``reference_training`` (the one-process losses and weights) and ``weight_bounds``.
``Zero3Case.observe`` records what each rank's steps did (a hook's findings), and the result says
which model steps the load installed (``Zero3Result.steps``) or refused.  A run sharded otherwise
(accelerate's FSDP2 plugin) compares with ``reference_training`` by training with the same
``training_arguments`` (and its own options) and ``in_order_trainer``.

Two load paths (``Zero3Case.init``): ``"zero.Init"`` creates the ``TrainingArguments`` (and so
transformers' ``HfDeepSpeedConfig``) before ``from_pretrained``, which then builds the model
under ``deepspeed.zero.Init``: every parameter is partitioned as its module is built, and the
checkpoint is read on rank 0 and spread by ``GatheredParameters``; ``"initialize"`` loads the
model as usual and ``Trainer`` partitions it in ``deepspeed.initialize``.

Both ranks see the same batch at every step (the three rows of ``padded_batch``, in order):
the ZeRO-3 gradient, the mean of the two ranks' equal gradients, is the one-process gradient
of that batch, and the losses are the one-process losses.

The config has no ``"optimizer"`` block (``Trainer``'s AdamW is handed to DeepSpeed, so its
``fused_adam`` op is never compiled) and ``stage3_param_persistence_threshold: 0`` (a tiny
model's parameters are otherwise all "persistent", kept whole on every rank, and nothing would
be partitioned).  DeepSpeed compiles its ``shm_comm`` op with g++ on first use, into
``TORCH_EXTENSIONS_DIR``: ``EXTENSIONS_DIR`` (inside the venv, built once by ``make venv``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .launcher import TorchrunFailed, rank_environment, run_rank, start_rank, torchrun, write_rank

#: The ZeRO-3 config of every case (``TrainingArguments(deepspeed=...)``): "auto" values are
#: filled in by transformers from the arguments.
ZERO3_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}

#: Where DeepSpeed's compiled ops are kept: one build per venv (``make venv`` builds ``shm_comm``).
EXTENSIONS_DIR = Path(sys.prefix) / "torch-extensions"

#: Steps of every case: a lost or wrong gradient shows in the second step's loss.
DEFAULT_STEPS = 2

#: AdamW's learning rate: large, so a wrong update shows in the next loss.
LEARNING_RATE = 1e-2

#: The floor of ``loss_bound``: fp32 losses of a few units, computed with the same parameters on
#: one process or gathered from two partitions, differ by reordered sums (a few ulps, ~1e-6 at
#: 5.0); 1e-5 is ten times that on any CPU, and far below what a lost gradient does (~1e-2).
LOSS_FLOOR = 1e-5

#: The file of the cases, in the ranks' output directory.
_CASES = "cases.json"

#: Seconds a rank waits in one collective: a tiny model's steps, saves and reloads take a few.
COLLECTIVE_TIMEOUT = 120

#: ``loss_bound``: this many times what ZeRO-3 itself does to vanilla's losses in the run.
LOSS_CALIBRATION = 3


@dataclasses.dataclass(frozen=True)
class Zero3Case:
    """One run of ``zero3_training``.

    Attributes:
        name: how results name it.
        checkpoint: a checkpoint directory.
        packs: ``HF_PATCH_PACKS``-style selection for the load (``"none"``: vanilla).
        init: ``"zero.Init"`` (the model built partitioned by ``from_pretrained``) or
            ``"initialize"`` (loaded whole, partitioned by ``deepspeed.initialize``).
        steps: training steps.
        save: save with ``Trainer.save_model`` and reload the result with vanilla transformers.
        optim: ``TrainingArguments(optim=...)`` (``"sgd"``: the update is the gradient times the
            learning rate, so the trained weights compare gradients); ``None``: ``Trainer``'s default.
        weights: a file where rank 0 writes the trained weights, gathered, in the original layout
            (safetensors), to compare with ``reference_training``'s; ``None``: not written.
        observe: ``"module:function"``, called on every rank with the loaded model before the
            training; what it returns is called after the training, and its JSON-able result is
            the rank's entry of ``Zero3Result.observed`` (what a step did: a hook's records).
    """

    name: str
    checkpoint: str
    packs: str
    init: str = "zero.Init"
    steps: int = DEFAULT_STEPS
    save: bool = True
    optim: str | None = None
    weights: str | None = None
    observe: str | None = None

    def __post_init__(self) -> None:
        if self.init not in ("zero.Init", "initialize"):
            raise ValueError(f"Zero3Case({self.name!r}): init must be 'zero.Init' or 'initialize', got {self.init!r}")


@dataclasses.dataclass
class Zero3Result:
    """What both ranks saw in one case.

    Attributes:
        losses: the losses ``Trainer`` logged, one per step (rank 0's; ``ranks_agree`` says the
            other rank logged the same).
        ranks_agree: both ranks logged the same losses.
        replaced: target -> replacement class name, as the load's plan says.
        errors: per rank, the error of the case (``None`` where the rank finished).
        warnings: per rank, the ``PackWarning`` messages.
        saved: the files ``save_model`` wrote.
        reload_diff: the largest difference between the weights vanilla transformers reloads
            from the saved checkpoint and the trained weights, gathered, both in the original
            layout (``None`` where nothing was reloaded).
        reload_keys: the keys that are in one of the two and not the other.
        direct_save: per rank, what ``model.save_pretrained(path)`` without a state dict raised on
            every rank after the training, where a pack converts weights (``None``: it did not raise,
            or was not tried).
        steps: per rank, the model steps the load installed (``"target [pack]"``, the plan's
            ``installed_steps``).
        refused: per rank, target -> reason of what the load's plan refused.
        observed: per rank, what ``Zero3Case.observe`` returned (``None`` without it).
    """

    losses: list[float] = dataclasses.field(default_factory=list)
    ranks_agree: bool = False
    replaced: dict[str, str] = dataclasses.field(default_factory=dict)
    errors: list[str | None] = dataclasses.field(default_factory=list)
    warnings: list[list[str]] = dataclasses.field(default_factory=list)
    saved: list[str] = dataclasses.field(default_factory=list)
    reload_diff: float | None = None
    reload_keys: list[str] = dataclasses.field(default_factory=list)
    direct_save: list[str | None] = dataclasses.field(default_factory=list)
    steps: list[list[str]] = dataclasses.field(default_factory=list)
    refused: list[dict[str, str]] = dataclasses.field(default_factory=list)
    observed: list[Any] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every rank finished, both logged the same losses."""
        return not any(self.errors) and self.ranks_agree

    def max_loss_diff(self, reference: Sequence[float]) -> float:
        """The largest difference from ``reference``'s losses (infinite where the counts differ)."""
        if len(self.losses) != len(reference) or not self.losses:
            return float("inf")
        return max(abs(a - b) for a, b in zip(self.losses, reference, strict=True))


def loss_bound(vanilla_zero3: Sequence[float], reference: Sequence[float], *more: Sequence[float]) -> float:
    """The bound of a pack's ZeRO-3 losses against ``reference`` (vanilla on one process).

    ``LOSS_CALIBRATION`` times the largest difference between ``reference`` and what the same run
    measured for vanilla under ZeRO-3 (and for each of ``more``: the pack on one process, say),
    at least ``LOSS_FLOOR``.  A pack that loses or scales a gradient is off by far more.

    Raises:
        ValueError: the runs have different numbers of steps.
    """
    runs = [list(vanilla_zero3), *map(list, more)]
    if any(len(run) != len(reference) for run in runs):
        raise ValueError(f"loss_bound: runs of {[len(run) for run in runs]} steps against {len(reference)}")
    spread = max((abs(a - b) for run in runs for a, b in zip(run, reference, strict=True)), default=0.0)
    return max(LOSS_FLOOR, LOSS_CALIBRATION * spread)


def weight_bounds(vanilla_sharded: Mapping[str, Any], reference: Mapping[str, Any]) -> dict[str, float]:
    """Per tensor, the bound of a pack's trained weights under sharding against ``reference`` (vanilla
    on one process, ``reference_training``), for SGD (``Zero3Case(optim="sgd")``: an update is the
    gradient times the learning rate).

    ``LOSS_CALIBRATION`` times what the sharded run does to vanilla's own trained weights (its
    reduce-scatter averages the ranks' gradients in another order), at least two float32 steps at the
    tensor's largest value (an update an ulp off may round the weight to the neighbouring float).

    Raises:
        KeyError: ``vanilla_sharded`` lacks a tensor of ``reference``.
    """
    import torch

    eps = torch.finfo(torch.float32).eps
    return {
        key: max(
            LOSS_CALIBRATION * float((vanilla_sharded[key] - value).abs().max()), 2 * eps * float(value.abs().max())
        )
        for key, value in reference.items()
    }


def zero3_environment(extra_path: Sequence[str | os.PathLike[str]] = ()) -> dict[str, str]:
    """The environment of a ZeRO-3 torchrun: this interpreter's ``sys.path`` (plus ``extra_path``)
    on ``PYTHONPATH``, ``TORCH_EXTENSIONS_DIR`` (``EXTENSIONS_DIR``) and one intra-op thread."""
    environment = rank_environment(extra_path)
    environment.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
    return {**environment, "USE_HUB_KERNELS": "0", "DS_ACCELERATOR": "cpu"}


def zero3_training(
    cases: Sequence[Zero3Case], *, extra_path: Sequence[str | os.PathLike[str]] = (), timeout: float = 600
) -> dict[str, Zero3Result]:
    """Run ``cases`` under ZeRO-3 in one ``torchrun --nproc_per_node 2`` (gloo, CPU) on this machine.

    Args:
        cases: the runs, in order (one process group for all: starting torchrun and importing
            DeepSpeed costs more than a tiny model's steps).
        extra_path: entries put first on the ranks' ``PYTHONPATH`` (the first-party packs' site).
        timeout: seconds before the torchrun is stopped.

    Returns:
        Case name -> its result.

    Raises:
        RuntimeError: the torchrun failed or timed out (the message has the end of its output).
        ValueError: two cases have the same name.
    """
    names = [case.name for case in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"zero3_training: case names must differ, got {names}")
    spec = json.dumps([dataclasses.asdict(case) for case in cases])
    try:
        seen = torchrun(__name__, environment=zero3_environment(extra_path), timeout=timeout, inputs={_CASES: spec})
    except TorchrunFailed as failed:
        if failed.timeout is not None:
            message = f"the ZeRO-3 torchrun timed out after {timeout:g} s: {failed.stderr[-4000:]!r}"
        else:
            message = (
                f"the ZeRO-3 torchrun exited {failed.returncode}:\n{failed.stdout[-3000:]}\n{failed.stderr[-6000:]}"
            )
        raise RuntimeError(message) from failed
    return {name: _combine([rank[name] for rank in seen]) for name in names}


def _combine(ranks: list[dict[str, Any]]) -> Zero3Result:
    first = ranks[0]
    return Zero3Result(
        losses=first["losses"],
        ranks_agree=all(rank["losses"] == first["losses"] for rank in ranks),
        replaced=first["replaced"],
        errors=[rank["error"] for rank in ranks],
        warnings=[rank["warnings"] for rank in ranks],
        saved=first["saved"],
        reload_diff=first["reload_diff"],
        reload_keys=first["reload_keys"],
        direct_save=[rank["direct_save"] for rank in ranks],
        steps=[rank["steps"] for rank in ranks],
        refused=[rank["refused"] for rank in ranks],
        observed=[rank["observed"] for rank in ranks],
    )


# --- the training, on one process or on each rank -------------------------------------------


def training_arguments(output_dir: str, steps: int = DEFAULT_STEPS, *, optim: str | None = None, **options: Any) -> Any:
    """The ``TrainingArguments`` of ``reference_training`` and of every ``Zero3Case``: a run sharded
    otherwise (accelerate's FSDP2 plugin) trains with them too, to compare with ``reference_training``.

    Args:
        output_dir: ``Trainer``'s output directory.
        steps: training steps (``max_steps``).
        optim: ``TrainingArguments(optim=...)``; ``None``: ``Trainer``'s default.
        **options: further ``TrainingArguments`` (``deepspeed=``, ``fsdp=``, ``fsdp_config=``).

    Returns:
        ``transformers.TrainingArguments``: batches of 3, ``LEARNING_RATE``, a loss logged at every
        step, no checkpoint, on the CPU.
    """
    from transformers import TrainingArguments

    chosen: dict[str, Any] = {} if optim is None else {"optim": optim}
    return TrainingArguments(
        output_dir,
        max_steps=steps,
        per_device_train_batch_size=3,
        learning_rate=LEARNING_RATE,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        use_cpu=True,  # with DeepSpeed too: else accelerate, finding no GPU, counts one process of one
        **chosen,
        **options,
    )


def in_order_trainer(model: Any, arguments: Any, steps: int = DEFAULT_STEPS) -> Any:
    """A ``Trainer`` of ``model`` whose every rank gets the three rows of ``padded_batch``, in order, at
    every step (``reference_training``'s, and every ``Zero3Case``'s).

    Args:
        model: the model to train.
        arguments: its ``TrainingArguments`` (``training_arguments``).
        steps: training steps: the dataset holds the three rows twice per step.

    Returns:
        ``transformers.Trainer``.
    """
    import torch
    from transformers import Trainer

    from .models import text_config_of
    from .trainer import TrainerBatches

    class InOrder(Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(dataset)

    config = text_config_of(model.config)
    pad = getattr(config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < int(config.vocab_size) else 0
    # the three rows twice per step: rank 0 takes the first batch of three, rank 1 the second
    dataset = TrainerBatches(int(config.vocab_size), pad_token_id=pad, repeats=2 * steps)
    return InOrder(model=model, args=arguments, train_dataset=dataset)


def _losses(trainer: Any) -> list[float]:
    return [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


def reference_losses(
    checkpoint: str | os.PathLike[str], packs: str = "none", *, steps: int = DEFAULT_STEPS
) -> list[float]:
    """The losses of ``steps`` steps of the same training on this process, without DeepSpeed.

    Args:
        checkpoint: a checkpoint directory.
        packs: the packs of the load (``"none"``: vanilla, the reference).
        steps: training steps.

    Returns:
        The loss of each step.
    """
    return reference_training(checkpoint, packs, steps=steps)[0]


def reference_training(
    checkpoint: str | os.PathLike[str], packs: str = "none", *, steps: int = DEFAULT_STEPS, optim: str | None = None
) -> tuple[list[float], dict[str, Any]]:
    """``reference_losses``, and the trained weights in the original layout (``Zero3Case.weights``'s keys).

    Args:
        checkpoint: a checkpoint directory.
        packs: the packs of the load (``"none"``: vanilla, the reference).
        steps: training steps.
        optim: ``TrainingArguments(optim=...)`` (``Zero3Case.optim``); ``None``: ``Trainer``'s default.

    Returns:
        The loss of each step, and parameter name -> trained tensor.
    """
    import torch
    from transformers import AutoModelForCausalLM

    import hfpatch_core
    from hfpatch_core import original_state_dict

    with hfpatch_core.enabled(packs=packs):
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="hfpatch-reference-") as out:
        trainer = in_order_trainer(model, training_arguments(out, steps, optim=optim), steps)
        trainer.train()
    weights = {key: value.detach().clone() for key, value in original_state_dict(model).items()}
    return _losses(trainer), weights


@contextlib.contextmanager
def _no_deepspeed_config() -> Iterator[None]:
    """Outside any ``HfDeepSpeedConfig``: a load here is a plain one (the ``"initialize"`` path, the reload)."""
    from transformers.integrations import deepspeed as integration

    kept = getattr(integration, "_hf_deepspeed_config_weak_ref", None)
    integration._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        integration._hf_deepspeed_config_weak_ref = kept


def _gathered_original_layout(model: Any) -> dict[str, Any]:
    """The trained weights, whole, in the original layout (on every rank: a collective)."""
    from hfpatch_core import original_state_dict
    from hfpatch_core.authoring.packing import gathered

    with gathered(list(model.parameters())):
        return {key: value.detach().clone() for key, value in original_state_dict(model).items()}


def _run_case(case: Zero3Case, out: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hfpatch_core
    from hfpatch_core import original_state_dict
    from hfpatch_core.errors import PackWarning
    from hfpatch_core.plan import plan_of

    result: dict[str, Any] = {"losses": [], "replaced": {}, "error": None, "warnings": [], "saved": []}
    result.update(reload_diff=None, reload_keys=[], direct_save=None, steps=[], refused={}, observed=None)
    directory = out / case.name.replace("/", "_")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PackWarning)
        try:
            arguments = None
            if case.init == "zero.Init":  # alive while the model is built: from_pretrained uses zero.Init
                arguments = training_arguments(
                    str(directory), case.steps, optim=case.optim, deepspeed=dict(ZERO3_CONFIG)
                )
                with hfpatch_core.enabled(packs=case.packs):
                    model = AutoModelForCausalLM.from_pretrained(case.checkpoint, dtype=torch.float32)
            else:
                with _no_deepspeed_config(), hfpatch_core.enabled(packs=case.packs):
                    model = AutoModelForCausalLM.from_pretrained(case.checkpoint, dtype=torch.float32)
                arguments = training_arguments(
                    str(directory), case.steps, optim=case.optim, deepspeed=dict(ZERO3_CONFIG)
                )
            plan = plan_of(model)
            result["replaced"] = {c.target: c.patch.replacement.__name__ for c in plan.entries} if plan else {}
            result["steps"] = [f"{c.target} [{c.pack}]" for c in plan.installed_steps] if plan else []
            result["refused"] = {r.target: r.reason for r in plan.refused} if plan else {}
            observer = _observer(case.observe, model)
            trainer = in_order_trainer(model, arguments, case.steps)
            trainer.train()
            result["losses"] = _losses(trainer)
            if observer is not None:
                result["observed"] = observer()
            if case.weights is not None and not case.save:
                _write_weights(model, case.weights)
            if case.save:
                trainer.save_model(str(directory / "saved"))
                dist.barrier()
                trained = _gathered_original_layout(model)
                if case.weights is not None and dist.get_rank() == 0:
                    _save_tensors(trained, case.weights)
                if dist.get_rank() == 0:
                    result["saved"] = sorted(path.name for path in (directory / "saved").iterdir())
                    with _no_deepspeed_config(), hfpatch_core.enabled(packs="none"):
                        reloaded = AutoModelForCausalLM.from_pretrained(str(directory / "saved"), dtype=torch.float32)
                    again = original_state_dict(reloaded)
                    result["reload_keys"] = sorted(set(again) ^ set(trained))
                    common = [key for key in again if key in trained]
                    result["reload_diff"] = max(
                        (float((again[key].float() - trained[key].float()).abs().max()) for key in common),
                        default=None,
                    )
                if plan is not None and plan.touches_weights:  # hfpatch's save guard is on the model
                    try:
                        model.save_pretrained(str(directory / "direct"), is_main_process=dist.get_rank() == 0)
                    except Exception as exc:
                        result["direct_save"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"[:3000] + "\n" + traceback.format_exc()[-3000:]
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, PackWarning)]
    return result


def _observer(spec: str | None, model: Any) -> Any:
    if spec is None:
        return None
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)(model)


def _save_tensors(tensors: Mapping[str, Any], path: str) -> None:
    from safetensors.torch import save_file

    save_file({key: value.contiguous() for key, value in tensors.items()}, path)


def _write_weights(model: Any, path: str) -> None:
    """The trained weights gathered (a collective: every rank), written by rank 0."""
    import torch.distributed as dist

    trained = _gathered_original_layout(model)
    if dist.get_rank() == 0:
        _save_tensors(trained, path)


def main(argv: Sequence[str] | None = None) -> None:
    """One rank of ``zero3_training``: ``OUT``, which holds the cases (``cases.json``)."""
    import torch.distributed as dist

    (out,) = argv if argv is not None else sys.argv[1:]
    start_rank()
    cases = [Zero3Case(**fields) for fields in json.loads((Path(out) / _CASES).read_text())]
    if not dist.is_initialized():  # DeepSpeed takes the group over (its CPU accelerator speaks gloo)
        # a rank left waiting in a collective the other skipped fails the case after this, not the run's timeout
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    results = {}
    for case in cases:
        results[case.name] = _run_case(case, Path(out))
        dist.barrier()  # every rank runs every case, failed or not: none waits alone in a collective
    write_rank(out, results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(main)
