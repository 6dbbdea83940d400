"""``assert_pack_equivalent``: a model loaded with a pack against the same model without it.

``check_pack_equivalence`` loads a checkpoint (or a tiny one of a model type) with and
without the pack and runs each check in turn, collecting every failure in a ``Report``:

* ``_check_weights``: no weight is missing, unexpected or mismatched;
* ``_check_replacements``: the expected classes were replaced, as the plan says, and
  nothing else;
* ``_check_logits``: logits match (fp32 ``atol=1e-5``; bf16 and float16: ``BF16_ATOL`` or
  ``BF16_CALIBRATION`` times vanilla's own difference from vanilla in float32, whichever is
  larger) on a padded batch, top-k decisions (MoE routing) held equal on both sides; when
  they do not, the first diverging module is named;
* ``_check_generation``: greedy generation matches;
* ``_check_round_trip``: ``save_pretrained`` restores the source layout, and a vanilla
  reload gives the same logits;
* ``_check_steps``: where the pack installed model steps (``ModelStep``), one training step
  (labels, ``train()``) gives vanilla's loss (fp32: 1e-6 relative) and gradients (fp32: 1e-5);
  below float32 both bounds are at least ``BF16_CALIBRATION`` times vanilla's own difference
  from vanilla in float32, measured in the run;
* with ``apply_path=True``, ``applying.check_apply_path``: the pack applied in place to a
  vanilla model (``hfpatch_core.apply``) gives the loaded model, and ``revert`` undoes it;
* with ``train_steps=N``, ``training``: N AdamW steps with and without the pack give the
  same losses, gradients and parameters (checkpoint layout), with gradient checkpointing
  off and on.

``assert_pack_equivalent`` raises ``EquivalenceError`` listing the failures.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from .checkpoints import source_checkpoint as _source_checkpoint
from .comparison import Comparison, Report
from .models import _enabled, causal_lm_loader, comparison_prompts, logits_of, safetensors_of, tensor_differences
from .routing import HeldRouting
from .training import TrainingTolerances

#: The least logits tolerance of bfloat16 comparisons (max abs difference): one unit in the
#: last place of a bf16 logit in [4, 8) is 3.1e-2, so two models whose logits round apart
#: once differ by that much on any CPU.  Not a measurement: the bound a run applies is the
#: larger of this and ``BF16_CALIBRATION`` times what the CPU's own bf16 rounding measures
#: in the same run.
BF16_ATOL = 5e-2
#: How many times vanilla's bf16 logits' difference from its float32 logits (the rounding
#: of bf16 on this CPU, measured in the run) a pack's bf16 logits may differ from vanilla's:
#: each side's rounding may be that large, and the pack's up to twice vanilla's.
BF16_CALIBRATION = 3.0


class EquivalenceError(AssertionError):
    """``assert_pack_equivalent`` found one or more problems (all listed in the message)."""

    def __init__(self, failures: Sequence[str]) -> None:
        self.failures = list(failures)
        super().__init__("pack is not equivalent:\n- " + "\n- ".join(self.failures))


def _first_divergence(
    vanilla: nn.Module,
    patched: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    atol: float,
    dtype: torch.dtype = torch.float32,
) -> str:
    """The first module (in execution order) whose output differs, as 'layer N / module'; the
    patched model's top-k decisions held to vanilla's (ties in ``dtype``)."""
    records: dict[str, list[tuple[str, torch.Tensor]]] = {"vanilla": [], "patched": []}
    handles = []
    for label, model in (("vanilla", vanilla), ("patched", patched)):
        for name, module in model.named_modules():
            if not name:
                continue

            def hook(_module: nn.Module, _args: Any, output: Any, name: str = name, label: str = label) -> None:
                tensor = output[0] if isinstance(output, (tuple, list)) and output else output
                if isinstance(tensor, torch.Tensor):
                    records[label].append((name, tensor.detach()))

            handles.append(module.register_forward_hook(hook))
    try:
        held = HeldRouting(dtype)
        with torch.no_grad():
            with held.record():
                vanilla(input_ids=ids, attention_mask=mask)
            with held.force():
                patched(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    reference = dict(records["vanilla"])
    for name, tensor in records["patched"]:
        expected = reference.get(name)
        if expected is None or expected.shape != tensor.shape:
            continue
        difference = (expected.float() - tensor.float()).abs().max().item()
        if difference > atol:
            parts = name.split(".")
            layer = next((f"layer {parts[i + 1]}" for i, p in enumerate(parts[:-1]) if p == "layers"), "outside layers")
            return f"{layer}, module {name} ({type(tensor).__name__} max abs diff {difference:.3g})"
    return "no single module diverges beyond atol (the difference builds up across modules)"


def _tolerance(atol: float | None, dtype: torch.dtype) -> float:
    """``atol`` where given, else the least default of ``dtype`` (1e-5, ``BF16_ATOL`` below float32)."""
    if atol is not None:
        return atol
    return BF16_ATOL if _below_fp32(dtype) else 1e-5


def _below_fp32(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def _load_vanilla(source: str | Path, dtype: torch.dtype) -> Any:
    """The model without any pack, also where hfpatch is enabled (``hfpatch run -- pytest``)."""
    from .._scope import vanilla

    with vanilla():
        return causal_lm_loader(source).from_pretrained(source, dtype=dtype, use_kernels=False)


def _load_with_pack(pack: str, source: Path, dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
    """The model loaded with ``pack`` enabled (strict), and ``from_pretrained``'s loading info."""
    with _enabled(pack):
        # kernels off on both sides: a hub kernel would replace the forward of the pack's class
        # (it inherits its parent's kernel_layer_name) and of transformers' alike, and the
        # comparison would prove nothing about the pack (docs/authors-guide.md, "Hub kernels")
        loaded: Any = causal_lm_loader(source).from_pretrained(
            source, dtype=dtype, output_loading_info=True, use_kernels=False
        )
    return loaded[0], loaded[1]


def _check_weights(comparison: Comparison, info: dict[str, Any]) -> None:
    """No weight is missing, unexpected or mismatched in the load with the pack."""
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(key) for key in info.get(kind) or ())
        if keys:
            comparison.fail(f"weights {kind.replace('_', ' ')}: {', '.join(keys[:10])}")


def _replaced_modules(vanilla: nn.Module, patched: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """``(path, original, replacement)`` for each outermost module whose class the pack changed."""
    originals = dict(vanilla.named_modules())
    replaced_paths: list[str] = []
    for name, module in patched.named_modules():
        original = originals.get(name)
        if original is None or type(original) is type(module):
            continue
        if any(name.startswith(path + ".") for path in replaced_paths):
            continue
        replaced_paths.append(name)
        yield name, original, module


def _check_replacements(comparison: Comparison, expected_replacements: Sequence[str] | None) -> None:
    """Every replaced class is one the plan claims; the replaced classes are the expected ones; there is one."""
    from ..plan import plan_of

    report = comparison.report
    plan = report.plan = plan_of(comparison.patched)
    # a composite model's text model is loaded inside it, with a plan of its own (plan.nested)
    claims = {name: claim for each in plan.all_plans() for name, claim in each.replaced.items()} if plan else {}
    for name, original, module in _replaced_modules(comparison.vanilla, comparison.patched):
        report.replaced.setdefault(type(original).__name__, type(module).__name__)
        claim = claims.get(type(original).__name__)
        if claim is None or claim.patch.replacement is not type(module):
            comparison.fail(
                f"{name}: {type(original).__name__} became {type(module).__name__}, which the plan does not say"
            )
    if expected_replacements is not None and sorted(report.replaced) != sorted(expected_replacements):
        comparison.fail(f"replaced classes {sorted(report.replaced)}, expected {sorted(expected_replacements)}")
    # a pack of model steps replaces no class: its steps are what the run checks (``_check_steps``)
    if not report.replaced and not (plan is not None and plan.steps):
        comparison.fail(f"pack {report.pack!r} replaced no class of this {report.model_type} model")


def _check_logits(comparison: Comparison) -> None:
    """The logits of both models agree within the tolerance (measured whatever ``expect`` says),
    the patched model's top-k decisions held to vanilla's (ties only: ``routing.HeldRouting``)."""
    c = comparison
    routing = HeldRouting(c.dtype)
    with routing.record():
        reference = logits_of(c.vanilla, c.ids, c.mask)
    held = routing.for_another_model()
    with held.force():
        logits = logits_of(c.patched, c.ids, c.mask)
    c.report.forced_routes = held.forced
    if c.calibrate:
        c.tolerance = max(c.tolerance, BF16_CALIBRATION * _own_rounding(c, routing))
    c.report.atol = c.tolerance
    difference = c.report.max_abs_diff = (reference - logits).abs().max().item()
    if c.expect != "same":
        return
    for problem in held.finish():
        c.fail(f"logits: {problem}")
    if difference > c.tolerance:
        where = _first_divergence(c.vanilla, c.patched, c.ids, c.mask, c.tolerance, c.dtype)
        c.fail(f"logits differ: max abs diff {difference:.3g} > atol {c.tolerance:g}; first divergence: {where}")


def _own_rounding(comparison: Comparison, routing: HeldRouting) -> float:
    """The largest difference of vanilla's logits in ``comparison.dtype`` from vanilla's in float32
    (routing held to the first's): what the dtype's rounding does on this CPU."""
    c = comparison
    exact = _load_vanilla(c.source, torch.float32)
    with routing.for_another_model().force():
        return float((logits_of(exact, c.ids, c.mask) - c.reference.float()).abs().max().item())


#: A training step's loss bound, relative, and gradient bound in float32 (issue 39's exactness):
#: the same per-token terms summed in another order.  A reordered float32 sum errs in proportion to
#: its magnitude, so each parameter's gradient may also differ by ``STEP_GRAD_RTOL`` of its largest
#: element (16 float32 ulps: eps is 1.19e-7): rwkv's tiny embedding gradients reach 148, where one
#: ulp is 1.5e-5, above the absolute bound alone.
STEP_LOSS_RTOL = 1e-6
STEP_GRAD_ATOL = 1e-5
STEP_GRAD_RTOL = 16 * torch.finfo(torch.float32).eps
#: How a step check's failure starts when vanilla itself cannot run the training step: the tooling's
#: problem (the zoo's ``no checkpoint``), not the pack's.
VANILLA_CANNOT_TRAIN = "vanilla transformers cannot run a training step on it"


def _training_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward with labels, in training mode (dropout drawn from one seed on both
    sides); the loss and each parameter's gradient, as float32.  The model is left as it was."""
    labels = ids.masked_fill(mask == 0, -100)
    was_training = model.training
    model.train()
    try:
        torch.manual_seed(0)
        with torch.enable_grad():
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return float(loss.detach().float()), grads


def _check_steps(comparison: Comparison) -> None:
    """The model steps the load installed keep a training step vanilla's: loss and gradients."""
    c = comparison
    plan = c.report.plan
    installed = plan.installed_steps if plan is not None else ()
    c.report.steps = [f"{claim.target} [{claim.pack}]" for claim in installed]
    if not installed or c.expect != "same":
        return
    try:
        reference_loss, reference = _training_step(c.vanilla, c.ids, c.mask)
    except Exception as exc:  # a tiny checkpoint vanilla cannot train (reformer's axial shapes): nothing to compare
        c.fail(f"{VANILLA_CANNOT_TRAIN}: {type(exc).__name__}: {exc}")
        return
    loss, grads = _training_step(c.patched, c.ids, c.mask)
    loss_bound, grad_bound = STEP_LOSS_RTOL * abs(reference_loss), STEP_GRAD_ATOL
    if c.calibrate:
        exact_loss, exact = _training_step(_load_vanilla(c.source, torch.float32), c.ids, c.mask)
        own_grads = max((float((exact[n] - reference[n]).abs().max()) for n in reference if n in exact), default=0.0)
        loss_bound = max(loss_bound, BF16_CALIBRATION * abs(exact_loss - reference_loss))
        grad_bound = max(grad_bound, BF16_CALIBRATION * own_grads)
    # a pack that also replaces classes renames some parameters: those with vanilla's name and shape compare
    common = [n for n in reference if n in grads and grads[n].shape == reference[n].shape]
    c.report.step_loss_diff = abs(loss - reference_loss) / (abs(reference_loss) or 1.0)
    diffs = {n: float((grads[n] - reference[n]).abs().max()) for n in common}
    c.report.step_grad_diff = max(diffs.values(), default=0.0)
    where = ", ".join(c.report.steps)
    if abs(loss - reference_loss) > loss_bound:
        c.fail(f"model step(s) {where}: training loss {loss!r} differs from vanilla's {reference_loss!r}")
    bounds = {n: grad_bound + STEP_GRAD_RTOL * float(reference[n].abs().max()) for n in common}
    over = max(common, key=lambda n: diffs[n] / bounds[n], default=None)
    if over is not None and diffs[over] > bounds[over]:
        c.fail(
            f"model step(s) {where}: gradients differ from vanilla's by {diffs[over]:.3g} > {bounds[over]:.3g} "
            f"({over}, whose largest gradient is {float(reference[over].abs().max()):.3g})"
        )
    if not common:
        c.fail(f"model step(s) {where}: no gradient to compare with vanilla's")


def _check_generation(comparison: Comparison, tokens: int) -> None:
    """Greedy generation of ``tokens`` tokens from the first prompt gives the same tokens."""
    c = comparison
    settings = {"max_new_tokens": tokens, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        a = c.vanilla.generate(c.ids[:1], attention_mask=c.mask[:1], **settings)
        b = c.patched.generate(c.ids[:1], attention_mask=c.mask[:1], **settings)
    c.report.generation_match = bool(torch.equal(a, b))
    if not c.report.generation_match:
        c.fail(f"greedy generation of {tokens} tokens differs: {a.tolist()} vs {b.tolist()}")


def _check_saved_layout(comparison: Comparison, saved: str) -> None:
    """The patched model's ``save_pretrained`` output holds the source checkpoint's tensors, as they were."""
    c = comparison
    written = safetensors_of(saved)
    try:
        original = safetensors_of(c.source)
    except FileNotFoundError as exc:  # a checkpoint in another format: no layout to compare
        c.report.round_trip = False
        c.fail(f"the saved layout cannot be compared with the source: {exc}")
        return
    if original:
        layout = tensor_differences(original, written)
        c.report.round_trip = not layout
        if layout:
            c.fail(f"save_pretrained does not restore the source layout: {', '.join(layout[:10])}")


def _check_reload(comparison: Comparison, saved: str) -> None:
    """A vanilla load of the saved checkpoint gives the vanilla model's logits."""
    c = comparison
    again = logits_of(_load_vanilla(saved, c.dtype), c.ids, c.mask)
    if c.expect == "same" and (again - c.reference).abs().max().item() > c.tolerance:
        c.report.round_trip = False
        c.fail("a vanilla reload of the saved checkpoint gives different logits")


def _check_round_trip(comparison: Comparison) -> None:
    """The patched model saves (``_check_saved_layout``), and what it saved reloads (``_check_reload``)."""
    with tempfile.TemporaryDirectory(prefix="hfpatch-roundtrip-") as saved:
        try:
            comparison.patched.save_pretrained(saved)
        except Exception as exc:
            comparison.report.round_trip = False
            comparison.fail(f"save_pretrained failed: {type(exc).__name__}: {exc}")
            return
        _check_saved_layout(comparison, saved)
        _check_reload(comparison, saved)


def check_pack_equivalence(
    pack: str,
    checkpoint_or_model_type: str | Path,
    *,
    atol: float | None = None,
    expect: Literal["same", "different"] = "same",
    dtype: torch.dtype = torch.float32,
    generate_tokens: int = 20,
    expected_replacements: Sequence[str] | None = None,
    apply_path: bool = False,
    train_steps: int = 0,
    train_checkpointing: Sequence[bool] = (False, True),
    train_tolerances: TrainingTolerances | None = None,
) -> Report:
    """Run every check of ``assert_pack_equivalent`` and return the report.

    A tiny checkpoint built for a model type is removed before this returns.
    """
    with _source_checkpoint(checkpoint_or_model_type) as source:
        report = _check_equivalence(
            pack, source, atol, expect, dtype, generate_tokens, expected_replacements, apply_path
        )
        if train_steps and expect == "same":
            from .training import training_reports

            for training in training_reports(
                pack,
                source,
                steps=train_steps,
                dtype=dtype,
                checkpointing=train_checkpointing,
                tolerances=train_tolerances,
            ):
                report.training.append(training)
                report.failures.extend(training.failures)
        return report


def _check_equivalence(
    pack: str,
    source: Path,
    atol: float | None,
    expect: Literal["same", "different"],
    dtype: torch.dtype,
    generate_tokens: int,
    expected_replacements: Sequence[str] | None,
    apply_path: bool,
) -> Report:
    vanilla = _load_vanilla(source, dtype)
    report = Report(pack=pack, model_type=str(vanilla.config.model_type))
    try:
        patched, info = _load_with_pack(pack, source, dtype)
    except Exception as exc:
        report.failures.append(f"loading with pack {pack!r} failed: {type(exc).__name__}: {exc}")
        return report
    ids, mask = comparison_prompts(vanilla.config)
    comparison = Comparison(
        report=report,
        source=source,
        dtype=dtype,
        tolerance=_tolerance(atol, dtype),
        expect=expect,
        vanilla=vanilla,
        patched=patched,
        ids=ids,
        mask=mask,
        reference=logits_of(vanilla, ids, mask),
        calibrate=atol is None and _below_fp32(dtype),
    )
    _check_weights(comparison, info)
    _check_replacements(comparison, expected_replacements)
    _check_logits(comparison)
    if generate_tokens and expect == "same":
        _check_generation(comparison, generate_tokens)
    _check_round_trip(comparison)
    _check_steps(comparison)
    if apply_path:
        from .applying import check_apply_path

        check_apply_path(comparison)
    return report


def assert_pack_equivalent(
    pack: str,
    checkpoint_or_model_type: str | Path,
    *,
    atol: float | None = None,
    expect: Literal["same", "different"] = "same",
    dtype: torch.dtype = torch.float32,
    generate_tokens: int = 20,
    expected_replacements: Sequence[str] | None = None,
    apply_path: bool = False,
    train_steps: int = 0,
    train_checkpointing: Sequence[bool] = (False, True),
    train_tolerances: TrainingTolerances | None = None,
) -> Report:
    """Assert that pack ``pack`` keeps a model correct (see the module docstring).

    Args:
        pack: the pack's name (its entry point name), installed in this environment.
        checkpoint_or_model_type: a checkpoint directory, or a model type for a tiny one.
        atol: the logits tolerance (default 1e-5 in fp32; in bf16 and float16 the larger of
            ``BF16_ATOL`` and ``BF16_CALIBRATION`` times vanilla's own difference from vanilla
            in float32, measured in the run).
        expect: ``"different"`` for a pack that changes outputs on purpose.
        dtype: the dtype to load both models in.
        generate_tokens: how many greedy tokens to compare (0 to skip).
        expected_replacements: the original class names the pack must replace.
        apply_path: also apply the pack in place to a vanilla model (``hfpatch_core.apply``)
            and check it equals the load, saves the source layout, and reverts exactly.
        train_steps: also train both models for this many AdamW steps (0: no training
            check; 5 is what ``hfpatch verify --train`` runs) and compare losses, gradients
            and parameters at every step (``check_training_equivalence``, docs/training.md).
        train_checkpointing: the gradient checkpointing settings to train with, one
            training comparison each (default: off, then on).
        train_tolerances: the training tolerances (default ``TrainingTolerances.default(dtype)``).

    Raises:
        EquivalenceError: listing every failed check.
    """
    report = check_pack_equivalence(
        pack,
        checkpoint_or_model_type,
        atol=atol,
        expect=expect,
        dtype=dtype,
        generate_tokens=generate_tokens,
        expected_replacements=expected_replacements,
        apply_path=apply_path,
        train_steps=train_steps,
        train_checkpointing=train_checkpointing,
        train_tolerances=train_tolerances,
    )
    if report.failures:
        raise EquivalenceError(report.failures)
    return report
