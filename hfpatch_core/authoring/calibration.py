"""What a routed-experts forward owes a quantizer's calibration: every expert sees the tokens.

A quantizer that calibrates module by module (llm-compressor's GPTQ, its activation
observers) observes each expert's ``nn.Linear`` inputs through forward hooks while the
model runs on calibration data.  A per-expert loop that skips the experts the router
gave no token leaves them unobserved: llm-compressor then saves them with uninitialised
scales (issue 51).  Packs whose experts are separate modules ask here:

* ``calibrating_all_experts()``: inside llm-compressor's ``moe_calibration_context``
  (``oneshot(..., moe_calibrate_all_experts=True)``, its default), where every expert must
  run on every calibration token, its output still made of the routed rows only;
* ``observed(module)``: whether something observes a module's inputs (a forward hook or
  pre-hook on it or under it), which is how an expert that got no token in a forward
  knows that a calibration would miss it;
* ``report_unrouted(...)``: names the experts that got no routed token in a calibration
  forward (a ``PackWarning`` once per expert, a ``PackError`` with ``HF_PATCH_STRICT=1``).

``calibrating_all_experts`` costs one dictionary look-up when llm-compressor is not imported
and never imports it; call it once per forward.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Sequence

import torch.nn as nn

from ..errors import PackError, PackWarning
from ..settings import strict_for

__all__ = ["calibrating_all_experts", "observed", "report_unrouted"]

#: llm-compressor's module holding the flag ``moe_calibration_context`` sets (0.10 and later).
LLMCOMPRESSOR_CONTEXT = "llmcompressor.modeling.moe.context"


def calibrating_all_experts() -> bool:
    """Whether a calibration asks every MoE expert to run on every token now.

    True inside llm-compressor's ``moe_calibration_context()`` (entered by ``oneshot`` with
    ``moe_calibrate_all_experts=True``, its default): each expert then runs on every
    calibration token so that its quantization is calibrated on all of them, and only the
    routed rows make the output, as llm-compressor's own ``LinearExperts2D`` does.  Call it
    in the experts' forward; it reads llm-compressor's flag only if the program imported
    llm-compressor (``sys.modules``), so it never imports it and costs a dictionary look-up
    otherwise.
    """
    context = sys.modules.get(LLMCOMPRESSOR_CONTEXT)
    if context is None:
        return False
    flag = getattr(context, "get_calibrate_all_experts_flag", None)
    return bool(flag()) if flag is not None else False


def observed(module: nn.Module) -> bool:
    """Whether a forward hook or forward pre-hook is registered on ``module`` or a module under it.

    That is how calibrating quantizers (llm-compressor's GPTQ and observers, GPTQ-style tools)
    see a module's inputs.  Call it for an expert that got no token in a forward: if it is
    observed, a calibration is running that would otherwise miss it.  Global hooks
    (``register_module_forward_hook``) are not counted: they observe every module alike.
    Costs a few dictionary checks per module under ``module``; ask for one expert, not for
    every expert of every forward.  Only while llm-compressor is imported: other tools hook every
    module too (DeepSpeed ZeRO-3's parameter gathering, accelerate's offloading), and an idle
    expert run for them would join the optimizer's step with zero gradients.
    """
    if LLMCOMPRESSOR_CONTEXT not in sys.modules:
        return False
    # ``_forward_hooks_with_kwargs`` / ``_forward_pre_hooks_with_kwargs`` only flag hooks these hold
    if module._forward_hooks or module._forward_pre_hooks:
        return True
    for child in module._modules.values():
        if child is not None and (
            child._forward_hooks or child._forward_pre_hooks or (child._modules and observed(child))
        ):
            return True
    return False


_reported: weakref.WeakKeyDictionary[nn.Module, set[int]] = weakref.WeakKeyDictionary()
_reported_lock = threading.Lock()


def report_unrouted(experts: nn.Module, numbers: Sequence[int], tokens: int, *, pack: str) -> None:
    """Name the experts of ``experts`` that the router gave no token in an observed forward.

    Called by a pack's experts forward when a calibration observes experts that got no token
    while ``calibrating_all_experts()`` is false (llm-compressor's
    ``moe_calibrate_all_experts=False``), after it ran them on all ``tokens`` rows so that
    their quantization is calibrated.  A ``PackWarning`` names each expert once per module
    (the module's name in the model that is running, found from the calling frames).

    Raises:
        PackError: strict mode (``HF_PATCH_STRICT=1``, or the model's load ran under
            ``enable(strict=True)``); stage ``"calibration"``.
    """
    with _reported_lock:
        seen = _reported.setdefault(experts, set())
        new = [number for number in numbers if number not in seen]
        seen.update(new)
    if not new:
        return
    model, name = _running(experts)
    listed = ", ".join(str(number) for number in new)
    they, their = ("they", "their") if len(new) > 1 else ("it", "its")
    message = (
        f"hfpatch: pack {pack!r}: {name}: the router gave expert{'s' if len(new) > 1 else ''} {listed} no token "
        f"in a calibration forward that does not ask for every expert (llm-compressor's "
        f"oneshot(moe_calibrate_all_experts=False)); {they} ran on all {tokens} tokens of that forward instead, "
        f"output discarded, so that {their} quantization is calibrated rather than saved with uninitialised "
        "scales. moe_calibrate_all_experts=True (llm-compressor's default) calibrates every expert on every token."
    )
    if strict_for(model):
        raise PackError(pack, message, stage="calibration")
    warnings.warn(message, PackWarning, stacklevel=3)  # the experts' caller


def _running(module: nn.Module) -> tuple[nn.Module, str]:
    """The outermost module whose forward is running in this thread's calling frames (the model),
    and ``module``'s name in it (``module`` and its class name where none holds it)."""
    outermost: nn.Module | None = None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            outermost = owner
        frame = frame.f_back  # type: ignore[assignment]
    if outermost is not None:
        for name, candidate in outermost.named_modules():
            if candidate is module:
                return outermost, name or type(module).__name__
    return module, type(module).__name__
