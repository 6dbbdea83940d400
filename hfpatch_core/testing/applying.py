"""The apply path of ``assert_pack_equivalent(..., apply_path=True)``: the pack applied in place.

A vanilla model is loaded, patched with ``hfpatch_core.apply`` and compared with the model
loaded with the pack: the same plan fingerprint, the same classes at the same paths, the
same weights and logits, a save in the source layout; then ``revert`` must give back the
vanilla state dict (names, shapes, dtypes, values) and classes.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from .comparison import Comparison
from .models import load_model, logits_of, safetensors_of, tensor_differences


def _classes(model: Any) -> dict[str, type]:
    return {name: type(module) for name, module in model.named_modules()}


def _weights_differ(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], atol: float) -> list[str]:
    return [
        key
        for key in sorted(set(expected) | set(found))
        if key not in expected
        or key not in found
        or expected[key].shape != found[key].shape
        or expected[key].dtype != found[key].dtype
        or (expected[key].float() - found[key].float()).abs().max().item() > atol
    ]


def check_apply_path(comparison: Comparison) -> None:
    """``apply`` on a vanilla model gives the loaded patched model, and ``revert`` gives the vanilla one back.

    ``comparison``: the run's models, source and settings.
    """
    from .._runtime.steps import installed_on
    from .._session.inplace import applied_to, apply, revert

    c = comparison
    model = load_model(c.source, dtype=c.dtype)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    classes = _classes(model)
    try:
        plan = apply(model, packs=c.report.pack, strict=True)
    except Exception as exc:
        c.report.apply_path = False
        c.fail(f"apply() with pack {c.report.pack!r} failed: {type(exc).__name__}: {exc}")
        return
    failures: list[str] = []
    loaded = c.report.plan
    if loaded is not None and plan.fingerprint != loaded.fingerprint:
        failures.append(f"apply() planned {plan.fingerprint}, the load {loaded.fingerprint}")
    patched_classes, applied_classes = _classes(c.patched), _classes(model)
    if applied_classes != patched_classes:
        differ = sorted(
            k for k in {*patched_classes, *applied_classes} if applied_classes.get(k) is not patched_classes.get(k)
        )
        failures.append(f"apply() gives other modules than the load at {', '.join(differ[:10])}")
    weights = _weights_differ(c.patched.state_dict(), model.state_dict(), c.tolerance)
    if weights:
        failures.append(f"apply() gives other weights than the load: {', '.join(weights[:10])}")
    difference = (logits_of(c.patched, c.ids, c.mask) - logits_of(model, c.ids, c.mask)).abs().max().item()
    if difference > c.tolerance:
        failures.append(f"apply() gives other logits than the load: max abs diff {difference:.3g}")
    steps = [(claim.pack, claim.target) for claim in plan.installed_steps]
    if loaded is not None and steps != [(claim.pack, claim.target) for claim in loaded.installed_steps]:
        failures.append(f"apply() installs the model steps {steps}, the load {list(loaded.installed_steps)}")
    with tempfile.TemporaryDirectory(prefix="hfpatch-apply-") as saved:
        try:
            model.save_pretrained(saved)
            layout = tensor_differences(safetensors_of(c.source), safetensors_of(saved))
            if layout:
                failures.append(f"the applied model does not save the source layout: {', '.join(layout[:10])}")
        except Exception as exc:
            failures.append(f"the applied model does not save: {type(exc).__name__}: {exc}")
    try:
        if applied_to(model) is not None:  # apply() that replaced nothing left nothing to revert
            revert(model)
    except Exception as exc:
        failures.append(f"revert() failed: {type(exc).__name__}: {exc}")
    else:
        after = model.state_dict()
        exact = [
            key
            for key in sorted(set(before) | set(after))
            if key not in before
            or key not in after
            or before[key].dtype != after[key].dtype
            or not torch.equal(before[key], after[key])
        ]
        if exact:
            failures.append(f"revert() does not give the vanilla weights back: {', '.join(exact[:10])}")
        if _classes(model) != classes:
            failures.append("revert() does not give the vanilla classes back")
        if installed_on(model):
            failures.append("revert() leaves model steps installed")
    c.report.apply_path = not failures
    for failure in failures:
        c.fail(failure)
