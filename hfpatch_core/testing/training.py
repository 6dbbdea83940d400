"""Training equivalence: N optimizer steps with a pack against the same N steps without it.

``check_training_equivalence`` loads a checkpoint with and without the pack, puts both in
training mode and runs the same ``steps`` AdamW steps on each (the same seeded batches,
labels = the inputs, one row left-padded and one right-padded, with their attention mask).
At every step it compares

* the loss;
* every parameter's gradient, before the optimizer step;
* every parameter, after the optimizer step;

gradients and parameters mapped back to the checkpoint layout first (the model's
conversions reversed, as ``save_pretrained`` does), so a pack that fuses weights is
compared name by name with vanilla transformers. A pack whose forward is right and whose
backward is not (a detached or scaled gradient) shows in the gradients at step 1 even
where AdamW, which is invariant to the scale of a gradient, hides it from the weights.
Every divergence is reported at once, each naming the first step and the first
parameter, in the checkpoint's names.

Routing is held equal on both sides (``routing.HeldRouting``): the pack's run takes the
top-k decisions (MoE routes) vanilla's run took, at every step, recomputations under
gradient checkpointing included. A token whose top-k scores tie within bf16 rounding
would otherwise take another expert on one side, on some CPUs and not on others. A forced
decision that is not such a tie is a failure; ``TrainingReport.forced_routes`` counts the
ties forced.

Why the default tolerances (``TrainingTolerances.default``) are what they are is
measured and written in docs/training.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .models import token_batch
from .routing import HeldRouting

#: steps ``hfpatch verify --train`` and ``assert_pack_equivalent(train_steps=...)`` users run by default
DEFAULT_TRAIN_STEPS = 5


@dataclasses.dataclass(frozen=True)
class TrainingTolerances:
    """The largest absolute differences a training comparison accepts.

    Attributes:
        loss: between the two models' losses at any step.
        gradients: between a parameter's gradients at any step, relative: the norm of the
            difference over the norm of vanilla's gradient (checkpoint layout); relative because
            gradients of different parameters differ in scale by orders of magnitude.
        parameters: between any element of a parameter after any step (checkpoint layout).
        model_gradients: between all the gradients of a step taken together, relative: the
            norm of every parameter's difference over the norm of all vanilla's gradients.
            A parameter with little gradient can differ by a large fraction of it where the
            order of a sum changes (bfloat16, an MoE token routed to another expert on a
            tie), the model's gradient as a whole cannot; ``None``: ``gradients`` (which the
            whole never exceeds, so nothing more is checked).
        calibration: where set (and the dtype is below float32), each bound above is raised to
            at least this many times the same difference between vanilla in the dtype and
            vanilla in float32 on the same steps, measured in the same run (routing held):
            what the dtype's rounding does on this CPU, so that the bounds hold on any CPU.
            ``None``: the bounds are used as they are.
    """

    loss: float
    gradients: float
    parameters: float
    model_gradients: float | None = None
    calibration: float | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in ("model_gradients", "calibration"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(
                    f"TrainingTolerances.{field.name} must be a number >= 0 (an absolute difference), got {value!r}"
                )

    @classmethod
    def default(cls, dtype: torch.dtype) -> TrainingTolerances:
        """The tolerances of ``dtype`` (``FP32_TOLERANCES``, ``BF16_TOLERANCES`` for bfloat16; float16 as bf16)."""
        return BF16_TOLERANCES if dtype in (torch.bfloat16, torch.float16) else FP32_TOLERANCES


#: fp32: the first-party packs measured at most 1e-6 (loss), 5.2e-6 (relative gradient) and
#: 4.1e-5 (parameters) over 5 steps; a wrong backward moves them by 1e-2 and more. The
#: parameter bound is a tenth of what AdamW at lr 1e-3 can move a weight in 5 steps (docs/training.md).
FP32_TOLERANCES = TrainingTolerances(loss=1e-4, gradients=1e-4, parameters=5e-4)
#: bf16 (8 bits of mantissa), the least bounds: each is raised to 3 times what vanilla in bf16
#: differs from vanilla in fp32 in the same run (``calibration``), so a CPU whose bf16 kernels
#: round more gets bounds as much wider.  The floors: parameters 1.6e-2, two bf16 steps at 1.0
#: (7.8e-3 each; a norm weight AdamW moves by 1e-3 rounds to one or the next); the others are
#: what a wrong backward exceeds (a gradient scaled by 0.8 in every layer: 0.2 of the model's
#: gradient), with routing held equal (docs/training.md has what the first-party packs measure)
BF16_TOLERANCES = TrainingTolerances(loss=2e-2, gradients=0.3, parameters=1.6e-2, model_gradients=0.1, calibration=3.0)


@dataclasses.dataclass(frozen=True)
class TrainingReport:
    """What one ``check_training_equivalence`` run measured, and every divergence it found.

    Attributes:
        pack: the pack compared.
        steps: how many optimizer steps each model took.
        dtype: the models' dtype, as ``str(torch.dtype)``.
        gradient_checkpointing: whether activation checkpointing was on in both models.
        losses: ``(vanilla, patched)`` loss at each step.
        max_loss_diff: the largest loss difference over the steps (``None`` when a side failed to train).
        max_gradient_diff: the largest relative gradient difference of one parameter over the steps
            (or ``None``).
        max_model_gradient_diff: the largest relative difference of all the gradients of a step
            together (or ``None``).
        max_parameter_diff: the largest parameter element difference over the steps (or ``None``).
        first_step: the first step (1-based) where anything diverged, ``None`` when nothing did.
        first_parameter: the parameter (checkpoint name) that diverged most at ``first_step``, in
            its gradient or else its value: the likeliest culprit, as what it feeds diverges less.
        tolerances: the tolerances compared against (calibrated: raised to ``calibration`` times
            vanilla's own rounding, where the tolerances asked for it).
        forced_routes: how many top-k decisions (a token's experts, at one router and step) of
            the patched run differed from vanilla's by a tie and were held to vanilla's
            (``None`` where routing was not held, or a side failed to train).
        failures: one message per kind of divergence, each naming its first step and parameter.
    """

    pack: str
    steps: int
    dtype: str
    gradient_checkpointing: bool
    losses: tuple[tuple[float, float], ...]
    max_loss_diff: float | None
    max_gradient_diff: float | None
    max_model_gradient_diff: float | None
    max_parameter_diff: float | None
    first_step: int | None
    first_parameter: str | None
    tolerances: TrainingTolerances
    failures: tuple[str, ...]
    forced_routes: int | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        fields["losses"] = [list(pair) for pair in self.losses]
        fields["tolerances"] = dataclasses.asdict(self.tolerances)
        fields["failures"] = list(self.failures)
        return {**fields, "ok": self.ok}


@dataclasses.dataclass(frozen=True)
class _Step:
    """One side's measurements at one step, gradients and parameters in checkpoint layout."""

    loss: float
    gradients: dict[str, torch.Tensor | None]
    parameters: dict[str, torch.Tensor]


def training_batches(
    vocab_size: int, steps: int, *, pad_token_id: int = 0, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``(input_ids, attention_mask, labels)``, deterministic from ``seed``.

    Each batch has four rows of 12 tokens drawn from ``3 .. vocab_size - 1``: two full,
    one left-padded (4 pads) and one right-padded (3 pads); padded positions hold
    ``pad_token_id``, a 0 in the mask and the label ``-100`` (ignored by the loss).

    Raises:
        ValueError: ``vocab_size`` is 3 or less, or ``steps`` is below 1.
    """
    if vocab_size <= 3:
        raise ValueError(f"vocab_size must be above 3 (tokens are drawn from 3 .. vocab_size - 1), got {vocab_size}")
    if steps < 1:
        raise ValueError(f"steps must be 1 or more, got {steps}")
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        pads = [(0, 0), (4, 0), (0, 3), (0, 0)]
        ids, mask = token_batch(vocab_size, 12, pads, generator=generator, pad_token_id=pad_token_id)
        batches.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return batches


def enable_checkpointing(model: Any) -> None:
    """Turn activation (gradient) checkpointing on with transformers' defaults, under the name
    the installed release has (``activation_checkpointing_enable`` after 5.3, which deprecates
    ``gradient_checkpointing_enable``)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()


def _checkpoint_layout(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (named as the model's parameters) in checkpoint layout: the model's conversions reversed."""
    from transformers.core_model_loading import revert_weight_conversion

    reverted: dict[str, torch.Tensor] = revert_weight_conversion(model, tensors)
    return {key: value.detach().float().clone() for key, value in reverted.items()}


def adapter_steps(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, steps: int = 3, lr: float = 1e-2
) -> list[float]:
    """``steps`` AdamW steps on ``model``'s trainable parameters (an adapter's: PEFT freezes the rest),
    the batch its own labels; the model is left in training mode.  Returns each step's loss.

    A pack test's check that an adapter on the pack's modules trains: the losses move, and the
    adapter's weights with them."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.item()))
    return losses


def _train(
    model: Any,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    checkpointing: bool,
    seed: int,
    routing: HeldRouting | None = None,
    record: bool = True,
) -> list[_Step]:
    """AdamW steps on ``batches``, measured at each step; ``routing`` records the top-k decisions
    of each step's forward and backward (``record``), or forces the recorded ones."""
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parameters = dict(model.named_parameters())
    measured = []
    for step, (ids, mask, labels) in enumerate(batches):
        torch.manual_seed(seed + step)  # the same dropout masks, where a config has dropout
        optimizer.zero_grad(set_to_none=True)
        held = contextlib.nullcontext() if routing is None else routing.record() if record else routing.force()
        if routing is not None:
            routing.step = step + 1
        with held:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
        present = {name: p.grad for name, p in parameters.items() if p.grad is not None}
        gradients: dict[str, torch.Tensor | None] = dict(_checkpoint_layout(model, present))
        for name in _checkpoint_layout(model, {n: p for n, p in parameters.items() if p.grad is None}):
            gradients[name] = None
        optimizer.step()
        measured.append(_Step(float(loss.item()), gradients, _checkpoint_layout(model, dict(parameters))))
    return measured


def _difference(a: torch.Tensor, b: torch.Tensor, *, relative: bool = False) -> float:
    """The largest element difference, or (``relative``) ``|a - b| / |a|`` in the 2-norm; ``inf``
    for other shapes."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    if not relative:
        return float((a - b).abs().max().item())
    difference, scale = float(torch.linalg.vector_norm(a - b).item()), float(torch.linalg.vector_norm(a).item())
    return difference / scale if scale > 0 else difference


@dataclasses.dataclass
class _Divergence:
    """The first step of one kind of divergence, the parameter that diverges most at that step
    (the likeliest culprit: what it feeds diverges less), the first one in checkpoint order, and
    the extent."""

    what: str
    step: int | None = None
    name: str | None = None
    detail: str = ""
    worst: float = -1.0
    first: str | None = None
    largest: float = 0.0
    count: int = 0

    def see(self, step: int, name: str, detail: str, difference: float = float("inf")) -> None:
        self.count += 1
        if self.step is None:
            self.step, self.first = step, name
        if step == self.step and difference > self.worst:
            self.name, self.detail, self.worst = name, detail, difference


def _compare_tensors(
    divergence: _Divergence,
    step: int,
    vanilla: dict[str, torch.Tensor | None],
    patched: dict[str, torch.Tensor | None],
    atol: float,
    *,
    relative: bool = False,
) -> None:
    kind = "relative difference" if relative else "max abs diff"
    for name in sorted(set(vanilla) | set(patched)):
        if name not in patched or name not in vanilla:
            side = "the patched model" if name not in patched else "vanilla transformers"
            divergence.see(step, name, f"{name} (not a parameter of {side}, in checkpoint layout)")
            continue
        a, b = vanilla[name], patched[name]
        if a is None or b is None:
            if a is not b:
                missing = "the patched model" if b is None else "vanilla transformers"
                divergence.see(step, name, f"{name} (no gradient in {missing}, a gradient in the other)")
            continue
        difference = _difference(a, b, relative=relative)
        divergence.largest = max(divergence.largest, difference)
        if not difference <= atol:  # NaN fails too
            shapes = f" (shapes {tuple(a.shape)} and {tuple(b.shape)})" if a.shape != b.shape else ""
            detail = f"{name} ({kind} {difference:.3g} > {atol:g}{shapes})"
            divergence.see(step, name, detail, difference if difference == difference else float("inf"))


def _model_gradient_difference(
    vanilla: dict[str, torch.Tensor | None], patched: dict[str, torch.Tensor | None]
) -> tuple[float, str | None]:
    """The relative difference of all the gradients together (the parameters both have, of one
    shape), and the parameter contributing most to it."""
    difference = scale = 0.0
    worst, largest = None, -1.0
    for name, a in vanilla.items():
        b = patched.get(name)
        if a is None or b is None or a.shape != b.shape:
            continue  # reported parameter by parameter
        part = float(torch.linalg.vector_norm(a - b).item()) ** 2
        difference, scale = difference + part, scale + float(torch.linalg.vector_norm(a).item()) ** 2
        if part > largest:
            worst, largest = name, part
    relative = (difference / scale) ** 0.5 if scale > 0 else difference**0.5
    return relative, worst


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What ``_compare`` measured over the steps: the largest differences, and the failures."""

    failures: tuple[str, ...]
    loss: float
    gradient: float
    model_gradient: float
    parameter: float
    first_step: int | None
    first_parameter: str | None


def _compare(
    vanilla: list[_Step],
    patched: list[_Step],
    tolerances: TrainingTolerances,
    setting: str,
) -> _Measured:
    loss = _Divergence("loss")
    gradients = _Divergence("gradients")
    model = _Divergence("the model's gradients")
    parameters = _Divergence("parameters")
    model_tolerance = tolerances.gradients if tolerances.model_gradients is None else tolerances.model_gradients
    for step, (a, b) in enumerate(zip(vanilla, patched, strict=True), 1):
        difference = abs(a.loss - b.loss)
        loss.largest = max(loss.largest, difference)
        if not difference <= tolerances.loss:  # a NaN loss fails too
            loss.see(step, "", f"vanilla {a.loss:.7g}, patched {b.loss:.7g} (diff {difference:.3g})")
        _compare_tensors(gradients, step, a.gradients, b.gradients, tolerances.gradients, relative=True)
        whole, worst = _model_gradient_difference(a.gradients, b.gradients)
        model.largest = max(model.largest, whole)
        if not whole <= model_tolerance:
            model.see(step, worst or "", f"relative difference {whole:.3g} > {model_tolerance:g}, most from {worst}")
        _compare_tensors(parameters, step, dict(a.parameters), dict(b.parameters), tolerances.parameters)
    failures = []
    if loss.step is not None:
        failures.append(
            f"{setting}: the loss diverges from step {loss.step} on: {loss.detail} > atol {tolerances.loss:g}; "
            f"{loss.count} of {len(vanilla)} steps differ, at most by {loss.largest:.3g}"
        )
    for divergence, when in ((gradients, "at step"), (parameters, "after step")):
        if divergence.step is not None:
            failures.append(
                f"{setting}: {divergence.what} diverge first {when} {divergence.step}, most in "
                f"{divergence.detail}, first in checkpoint order {divergence.first}; {divergence.count} (step, "
                f"parameter) pairs differ over {len(vanilla)} steps"
            )
    if model.step is not None:
        failures.append(
            f"{setting}: the model's gradients, all parameters together, diverge first at step {model.step}: "
            f"{model.detail}; {model.count} of {len(vanilla)} steps differ, at most by {model.largest:.3g}"
        )
    firsts = [d for d in (gradients, model, parameters, loss) if d.step is not None]
    first = min(firsts, key=lambda d: (d.step, d is loss)) if firsts else None
    first_parameter = next((d.name for d in (gradients, model, parameters) if first and d.step == first.step), None)
    return _Measured(
        failures=tuple(failures),
        loss=loss.largest,
        gradient=gradients.largest,
        model_gradient=model.largest,
        parameter=parameters.largest,
        first_step=first.step if first else None,
        first_parameter=first_parameter,
    )


def check_training_equivalence(
    pack: str,
    checkpoint_or_model_type: str | Path,
    *,
    steps: int = DEFAULT_TRAIN_STEPS,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    tolerances: TrainingTolerances | None = None,
    seed: int = 0,
    hold_routing: bool = True,
) -> TrainingReport:
    """Train a model with and without ``pack`` for ``steps`` AdamW steps and compare them.

    Both models are loaded from the same checkpoint (a tiny one of a model type is built
    and removed afterwards), in ``dtype``, and trained on ``training_batches`` with AdamW
    (lr 1e-3); losses, gradients and parameters are compared at every step (see the
    module docstring).

    Args:
        pack: the pack's name, installed in this environment.
        checkpoint_or_model_type: a checkpoint directory, or a model type for a tiny one.
        steps: optimizer steps per model (1 or more).
        dtype: the dtype to load and train both models in.
        gradient_checkpointing: train both models with activation checkpointing on.
        tolerances: the accepted differences (default ``TrainingTolerances.default(dtype)``).
        seed: the seed of the batches and of each step's random state.
        hold_routing: hold the pack's top-k decisions (MoE routing) to vanilla's, ties only
            (see the module docstring); ``False`` for a pack that computes its routing without
            ``torch.topk``, which a held comparison reports as making fewer top-k calls.

    Returns:
        A ``TrainingReport``; its ``failures`` list every divergence (empty when equivalent).

    Raises:
        ValueError: ``steps`` is below 1.
    """
    from .checkpoints import source_checkpoint

    if steps < 1:
        raise ValueError(f"steps must be 1 or more, got {steps}")
    with source_checkpoint(checkpoint_or_model_type) as source:
        return _training_report(pack, source, steps, dtype, gradient_checkpointing, tolerances, seed, hold_routing)


def _setting(steps: int, dtype: torch.dtype, checkpointing: bool) -> str:
    return (
        f"training ({steps} AdamW steps, {str(dtype).removeprefix('torch.')}, gradient checkpointing "
        f"{'on' if checkpointing else 'off'})"
    )


def _training_report(
    pack: str,
    source: Path,
    steps: int,
    dtype: torch.dtype,
    checkpointing: bool,
    tolerances: TrainingTolerances | None,
    seed: int,
    hold_routing: bool = True,
) -> TrainingReport:
    from .models import load_model, text_config_of

    tolerances = tolerances or TrainingTolerances.default(dtype)
    setting = _setting(steps, dtype, checkpointing)
    failed = TrainingReport(
        pack=pack,
        steps=steps,
        dtype=str(dtype),
        gradient_checkpointing=checkpointing,
        losses=(),
        max_loss_diff=None,
        max_gradient_diff=None,
        max_model_gradient_diff=None,
        max_parameter_diff=None,
        first_step=1,
        first_parameter=None,
        tolerances=tolerances,
        failures=(),
    )
    # kernels off on both sides, as in the equivalence check: a hub kernel would replace both forwards
    vanilla = load_model(source, dtype=dtype, use_kernels=False)
    config = text_config_of(vanilla.config)  # a composite model's vocabulary is its text model's
    batches = training_batches(int(config.vocab_size), steps, pad_token_id=_pad_id(config), seed=seed)
    runs: list[list[_Step]] = []
    routing = HeldRouting(dtype) if hold_routing else None
    sides = (
        ("vanilla transformers", lambda: vanilla),
        (f"pack {pack!r}", lambda: load_model(source, pack, dtype=dtype, use_kernels=False)),
    )
    for record, (side, load) in zip((True, False), sides, strict=True):
        try:
            runs.append(_train(load(), batches, checkpointing=checkpointing, seed=seed, routing=routing, record=record))
        except Exception as exc:  # a pack that cannot train is one failure of the report, not the end of the run
            return dataclasses.replace(failed, failures=(f"{setting}: {side} failed: {type(exc).__name__}: {exc}",))
    a, b = runs
    if tolerances.calibration is not None and _below_fp32(dtype):
        try:
            exact = load_model(source, dtype=torch.float32, use_kernels=False)
            forced = None if routing is None else routing.for_another_model()
            reference = _train(exact, batches, checkpointing=checkpointing, seed=seed, routing=forced, record=False)
        except Exception as exc:
            failure = f"{setting}: vanilla transformers in float32 (calibrating) failed: {type(exc).__name__}: {exc}"
            return dataclasses.replace(failed, failures=(failure,))
        tolerances = _calibrated(tolerances, a, reference)
    compared = _compare(a, b, tolerances, setting)
    failures = list(compared.failures)
    if routing is not None:
        failures.extend(f"{setting}: {problem}" for problem in routing.finish())
    return dataclasses.replace(
        failed,
        losses=tuple((x.loss, y.loss) for x, y in zip(a, b, strict=True)),
        max_loss_diff=compared.loss,
        max_gradient_diff=compared.gradient,
        max_model_gradient_diff=compared.model_gradient,
        max_parameter_diff=compared.parameter,
        first_step=compared.first_step,
        first_parameter=compared.first_parameter,
        failures=tuple(failures),
        forced_routes=None if routing is None else routing.forced,
        tolerances=tolerances,
    )


def _below_fp32(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def _calibrated(tolerances: TrainingTolerances, low: list[_Step], exact: list[_Step]) -> TrainingTolerances:
    """``tolerances`` raised to ``calibration`` times the differences of ``low`` (vanilla in a dtype
    below float32) from ``exact`` (vanilla in float32)."""
    factor = tolerances.calibration or 1.0
    zero = TrainingTolerances(loss=0, gradients=0, parameters=0)
    noise = _compare(low, exact, zero, "")
    model = tolerances.gradients if tolerances.model_gradients is None else tolerances.model_gradients
    return dataclasses.replace(
        tolerances,
        loss=max(tolerances.loss, factor * noise.loss),
        gradients=max(tolerances.gradients, factor * noise.gradient),
        parameters=max(tolerances.parameters, factor * noise.parameter),
        model_gradients=max(model, factor * noise.model_gradient),
    )


def _pad_id(config: Any) -> int:
    pad = getattr(config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < int(config.vocab_size) else 0


def training_reports(
    pack: str,
    source: Path,
    *,
    steps: int,
    dtype: torch.dtype,
    checkpointing: Sequence[bool],
    tolerances: TrainingTolerances | None,
) -> Iterator[TrainingReport]:
    """One ``TrainingReport`` per checkpointing setting (for ``assert_pack_equivalent``)."""
    for setting in checkpointing:
        yield _training_report(pack, source, steps, dtype, setting, tolerances, 0)
