"""Example pack ``rms-norm``: every RMS norm of a model computed by ``torch.nn.functional.rms_norm``.

A structural pack: it names no model type and no class.  For each load it builds the model
on the meta device, takes every module class that looks like a norm (an epsilon attribute,
at most one 1-D ``weight``, no children), and runs the original forward on a copy of it
against the replacements it knows: Llama's (normalise in float32, cast, then scale),
Olmo2's (scale in float32, then cast), Gemma's (scale by ``1 + weight``) and no scale.  A
class that matches one is replaced by a subclass whose forward calls ``rms_norm``; one that
looks like a norm and matches none is refused, with what the probe saw.
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from hfpatch_core import LoadContext, Patch, Refusal, hookimpl
from hfpatch_core.authoring import build_on_meta, runtime_class, shrunk_instance
from torch import nn

#: How each known norm scales the normalised hidden states (``x``: in float32, ``dtype``: the input's).
SCALINGS: dict[str, Callable[[nn.Module, torch.Tensor, torch.dtype], torch.Tensor]] = {
    "weight": lambda norm, x, dtype: norm.weight * x.to(dtype),
    "weight in float32": lambda norm, x, dtype: (norm.weight * x).to(dtype),
    "1 + weight": lambda norm, x, dtype: (x * (1.0 + norm.weight.float())).to(dtype),
    "none": lambda norm, x, dtype: x.to(dtype),
}
#: The replacement's class name: the original's with this prefix.
PREFIX = "FunctionalRMS"


def replacement_name(target: str) -> str:
    """The name of the class that replaces ``target``."""
    return PREFIX + target


def _epsilons(module: nn.Module) -> list[str]:
    return [name for name, value in vars(module).items() if "eps" in name.lower() and isinstance(value, float)]


def _looks_like_a_norm(module: nn.Module) -> bool:
    parameters = dict(module.named_parameters())
    return (
        type(module).__module__.startswith("transformers.")
        and not any(True for _ in module.children())
        and bool(_epsilons(module))
        and set(parameters) <= {"weight"}
        and all(parameter.dim() == 1 for parameter in parameters.values())
    )


def _forward(scaling: str, epsilon: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    scale = SCALINGS[scaling]

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        normalised = F.rms_norm(hidden_states.float(), hidden_states.shape[-1:], eps=getattr(self, epsilon))
        return scale(self, normalised, hidden_states.dtype)

    return forward


#: (original class, scaling, epsilon attribute) -> its replacement: one class per original keeps the
#: loads of a process on the same class
_classes: dict[tuple[type[nn.Module], str, str], type[nn.Module]] = {}


def functional_class(original: type[nn.Module], scaling: str, epsilon: str) -> type[nn.Module]:
    """The subclass of ``original`` whose forward calls ``rms_norm`` (``scaling``, ``getattr(self, epsilon)``).

    Built with ``runtime_class``: the class and its instances pickle as this call (``torch.save`` of a
    model, a ``DataLoader`` worker), which imports this module and builds the class again.
    """
    key = (original, scaling, epsilon)
    if key not in _classes:
        _classes[key] = runtime_class(
            replacement_name(original.__name__),
            (original,),
            {"forward": _forward(scaling, epsilon)},
            module=__name__,
            rebuild=functional_class,
            arguments=key,
        )
    return _classes[key]


#: A candidate with more elements than this is probed built small (``shrunk_instance``); a norm has
#: one weight of the hidden size and is probed as the load builds it: building a small model for
#: it would cost more than the copy (about 0.1 s each, hundreds of classes in a ``check``).
PROBE_LIMIT = 1 << 20


def _candidate(context: LoadContext, module_class: type[nn.Module], module: nn.Module) -> nn.Module:
    """One instance of ``module_class`` to probe, on the CPU: a copy of ``module`` (built on the meta
    device) materialised, or, for a large one, one built with the load's config scaled down
    (``shrunk_instance``: kilobytes where an MLP, an attention or experts are gigabytes)."""
    if sum(parameter.numel() for parameter in module.parameters()) > PROBE_LIMIT:
        try:
            return shrunk_instance(context, module_class)
        except Exception:  # a config that does not shrink, or a class built only at some sizes
            pass
    with torch.device("cpu"):
        return copy.deepcopy(module).to_empty(device="cpu")


def _probe(module: nn.Module, scaling: str, epsilon: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The original forward and the replacement's on one input, in ``dtype`` (``module``: on the CPU)."""
    # hooks of a nested load run under transformers' meta default device: probe on the CPU
    with torch.device("cpu"), torch.no_grad():
        probe = copy.deepcopy(module).to(dtype)
        generator = torch.Generator().manual_seed(0)
        size = probe.weight.shape[0] if "weight" in dict(probe.named_parameters()) else 64
        for parameter in probe.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        # hidden states whose mean square is of the order of epsilon: a norm that ignores it differs
        scale = max(getattr(probe, epsilon), 1e-12) ** 0.5
        hidden = (torch.randn(2, 3, size, generator=generator) * scale).to(dtype)
        return probe(hidden), _forward(scaling, epsilon)(probe, hidden)


#: class -> its replacement, or why there is none: a class computes what it computes in every load,
#: and one replacement class per original keeps the loads of a process on the same class.
_decided: dict[type[nn.Module], type[nn.Module] | str] = {}


def _decide(context: LoadContext, module_class: type[nn.Module], module: nn.Module) -> type[nn.Module] | str:
    """The replacement class of ``module_class`` (``module``: one instance, on the meta device), or why
    there is none."""
    if module_class not in _decided:
        _decided[module_class] = _probed(module_class, module, context)
    return _decided[module_class]


def _probed(module_class: type[nn.Module], module: nn.Module, context: LoadContext) -> type[nn.Module] | str:
    name = module_class.__name__
    home = sys.modules.get(module_class.__module__)
    if getattr(home, name, None) is not module_class:
        return f"{module_class.__module__} does not hold it as {name}, the name a patch replaces it by"
    # the probe calls the forward with the hidden states alone; a model may pass more (a gate)
    extra = [p for p in list(inspect.signature(module_class.forward).parameters)[2:] if p not in ("args", "kwargs")]
    if extra:
        return f"its forward takes more than the hidden states ({', '.join(extra)})"
    candidate = _candidate(context, module_class, module)
    tried: list[str] = []
    for epsilon in _epsilons(module):
        for scaling in SCALINGS:
            if scaling != "none" and "weight" not in dict(module.named_parameters()):
                continue
            try:
                original, replacement = _probe(candidate, scaling, epsilon, torch.float32)
            except Exception as exc:
                return f"its forward does not take the hidden states alone ({type(exc).__name__}: {exc})"
            if not torch.allclose(original, replacement, rtol=1e-5, atol=0.0):
                tried.append(f"{scaling} with {epsilon}")
                continue
            # the casts differ only below float32: bfloat16 tells Llama's order from Olmo2's
            original, replacement = _probe(candidate, scaling, epsilon, torch.bfloat16)
            if torch.equal(original, replacement):
                return functional_class(module_class, scaling, epsilon)
            tried.append(f"{scaling} with {epsilon} (float32 only)")
    return f"it computes none of rms_norm's scalings (tried {', '.join(tried)})"


@hookimpl
def provide_patches(context: LoadContext) -> list[Patch | Refusal]:
    if context.config is None:  # no config, no model to look into
        return []
    try:
        model = build_on_meta(context)
    except Exception:  # a model that cannot be built on meta: nothing to see, nothing claimed
        return []
    found: dict[str, tuple[type[nn.Module], nn.Module]] = {}
    decisions: list[Patch | Refusal] = []
    weighted: dict[str, set[bool]] = {}
    for module in model.modules():
        if _looks_like_a_norm(module):
            first, _ = found.setdefault(type(module).__name__, (type(module), module))
            weighted.setdefault(type(module).__name__, set()).add("weight" in dict(module.named_parameters()))
            if first is not type(module):  # a patch replaces by name: both or neither
                decisions.append(Refusal(first.__name__, f"two classes of this name: {first} and {type(module)}"))
    replacements: dict[str, type[nn.Module]] = {}
    for name, (module_class, module) in sorted(found.items()):
        # one instance is probed for the class: its instances must all compute the same form
        # (gemma3n's norm has a weight in some instances only)
        if len(weighted[name]) > 1:
            decisions.append(Refusal(name, "its instances differ: some have a weight, some do not"))
            continue
        decided = _decide(context, module_class, module)
        if isinstance(decided, str):
            decisions.append(Refusal(name, decided))
        else:
            replacements[name] = decided
    # transformers' registry also replaces every class whose name contains a claimed plain name
    # (it searches names as patterns): a class left alone must not contain a claimed one
    names = {type(module).__name__ for module in model.modules()}
    while True:
        shadowed = {
            name: other
            for name in replacements
            for other in sorted(names - set(replacements))
            if other != name and re.search(name, other)
        }
        if not shadowed:
            break
        for name, other in shadowed.items():
            del replacements[name]
            decisions.append(Refusal(name, f"the registry would replace {other} too (its name contains this one)"))
    decisions.extend(Patch(name, replacement) for name, replacement in sorted(replacements.items()))
    return decisions
