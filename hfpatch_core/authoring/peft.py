"""PEFT on patched models: adapters name the original projections, whatever a pack fused.

When PEFT puts adapters into a model (``get_peft_model``, ``PeftModel.from_pretrained``,
transformers' ``model.load_adapter`` / ``add_adapter``: all end in
``BaseTuner.inject_adapter``), every module whose class declares packed modules
(``hfpatch_core.authoring.packing``) first gets its original projections back as views of the
fused weight.  ``target_modules=["q_proj", "v_proj"]`` then finds them, the adapter
saved names them as an unpatched model does, and an adapter trained on an unpatched
model loads.  Targeting a fused name itself (``qkv_proj``) would make an adapter no
unpatched model can load: that is an ``AdapterError`` naming the pack, before PEFT
changes anything.  A module that holds as modules what the original model holds as
parameters (qwen-moe's per-expert experts) declares ``hfpatch_hidden_from_adapters``:
lists of names then do not reach inside it, as they do not on the original model.  One
that declares it ``False`` (linear-experts' per-expert ``nn.Linear`` experts) shows them:
PEFT's rewrite of expert names into the original's 3-D ``target_parameters``
(``_shown``) is kept off the names that reach its linears, so
``target_modules=["w1", "w3", "w2"]`` puts one adapter on each expert's projection, as on
a per-expert (transformers 4) model, and the adapter saves and loads under those names.

peft is not imported here: ``watch_peft`` hooks ``BaseTuner.inject_adapter`` when peft
is imported (at once if it already is), and only once a model with packed modules (or
modules declaring ``hfpatch_hidden_from_adapters``) has been built.  The hook stays for the
process: it does nothing for other models.
"""

from __future__ import annotations

import copy
import functools
import importlib.abc
import importlib.machinery
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from ..errors import AdapterError
from ..plan import plan_of
from ._shown import _HOOKED, HIDDEN_FROM_ADAPTERS, _hook_conversions, _lock, _shown_linears
from .packing import PACKED_MODULES, PackedPart, expose_parts, packed_modules

#: The peft module defining ``BaseTuner``.
_TUNERS = "peft.tuners.tuners_utils"


def _pack_of(model: nn.Module, module: nn.Module) -> str:
    plan = plan_of(model)
    if plan is not None:
        for each in plan.all_plans():
            for claim in each.entries:
                if claim.patch.replacement is type(module):
                    return claim.pack
    return type(module).__module__.split(".")[0]


def _names(key: str, parameter: str) -> bool:
    """Whether PEFT's ``target_parameters`` entry ``parameter`` names a parameter of module ``key``."""
    return any(full == parameter or full.endswith(f".{parameter}") for full in (f"{key}.weight", f"{key}.bias"))


def _remedy(pack: str) -> str:
    return f"or load the model without the pack: HF_PATCH_PACKS=all,-{pack} (or enable(packs=['all', '-{pack}']))"


def prepare_model(model: nn.Module, config: Any) -> int:
    """Make ``model``'s packed modules ready for the adapter ``config`` (a PEFT config).

    Called by the hook before PEFT matches ``config.target_modules`` against the model.

    Returns:
        How many modules had their parts exposed (0: the model has no packed modules).

    Raises:
        AdapterError: ``config`` targets a fused module or parameter by its fused name,
            a fused projection cannot be split into views (quantized, already
            wrapped), or PEFT would put expert targets on 3-D parameters that a pack
            made modules; the message names the pack and the remedy.
    """
    _hook_conversions()
    hidden = _hidden_modules(model)
    shown = _shown_linears(model)
    if hidden or shown:
        _refuse_converted_targets(model, config, hidden, shown)
    if hidden:
        _exclude_hidden(config, hidden)
    packed = [(name, module) for name, module in model.named_modules() if packed_modules(module)]
    if not packed:
        return 0
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = getattr(config, "target_modules", None)
    parameters: Sequence[str] = getattr(config, "target_parameters", None) or ()
    for name, module in packed:
        for fused, parts in packed_modules(module).items():
            key = f"{name}.{fused}" if name else fused
            hit = (targets is not None and bool(check_target_module_exists(config, key))) or any(
                _names(key, parameter) for parameter in parameters
            )
            if hit:
                pack = _pack_of(model, module)
                raise AdapterError(
                    f"the adapter targets {key}, which pack {pack!r} fused from {list(parts)}: an adapter on the "
                    f"fused projection does not load on an unpatched model. Target the original names instead "
                    f"(target_modules={list(parts)}, or a subset): hfpatch shows them to PEFT as parts of {fused}, "
                    f"so the adapter is the one an unpatched model would have; {_remedy(pack)}."
                )
    for name, module in packed:
        try:
            expose_parts(module)
        except TypeError as exc:
            pack = _pack_of(model, module)
            raise AdapterError(
                f"cannot put an adapter on {name or type(module).__name__}, fused by pack {pack!r}: {exc}. "
                "An adapter on a quantized model (QLoRA) needs the original projections: "
                f"{_remedy(pack).removeprefix('or ')}."
            ) from exc
    return len(packed)


def _hidden_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every module whose class declares ``hfpatch_hidden_from_adapters = True``."""
    modules = model.named_modules()
    return [(name, module) for name, module in modules if getattr(type(module), HIDDEN_FROM_ADAPTERS, False)]


def _refuse_converted_targets(
    model: nn.Module,
    config: Any,
    hidden: list[tuple[str, nn.Module]],
    shown: dict[str, tuple[str, nn.Module]],
) -> None:
    """Refuse an adapter that PEFT would put on the original model's parameters that a pack made modules.

    On transformers 5, PEFT rewrites the targets of some MoE model types (qwen3_moe, mixtral,
    deepseek_v3; qwen2_moe on some releases) from the experts' module names to the 3-D expert
    parameters (``target_parameters``): those do not exist on a model whose experts are
    modules, so PEFT would adapt the attention only, and only warn, or find nothing at all.
    Names that reach the linears of a shown module (``hfpatch_hidden_from_adapters = False``)
    are kept off that rewrite (``_shown._keep_on_linears``).  This runs the rewrite on a copy of
    ``config`` and raises where it still names parameters the model lacks.
    """
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft without transformers-5 conversions rewrites nothing
        return
    holder = hidden[0] if hidden else next(iter(shown.values()))
    pack = _pack_of(model, holder[1])
    if hidden:
        remedy = (
            f"Leave the experts' names out of target_modules (the attention, the shared expert and the router "
            f"still take adapters), {_remedy(pack)}."
        )
    else:
        names = sorted(
            {path[len(holder[0]) + 1 :].split(".")[-1] for path, (at, _) in shown.items() if at == holder[0]}
        )
        remedy = (
            f"Name the experts' linears as this model has them (target_modules={names}, or a subset), {_remedy(pack)}."
        )
    probe = copy.deepcopy(config)
    try:
        convert_peft_config_for_transformers(probe, model=model, conversions=None)
    except ValueError as exc:
        raise AdapterError(
            f"PEFT cannot map this adapter's targets onto the experts of pack {pack!r} ({exc}). {remedy}"
        ) from exc
    parameters = [name for name, _ in model.named_parameters()]
    added = set(getattr(probe, "target_parameters", None) or ()) - set(getattr(config, "target_parameters", None) or ())
    missing = sorted(name for name in added if not any(key == name or key.endswith(f".{name}") for key in parameters))
    if missing:
        raise AdapterError(
            f"on this transformers release PEFT puts this adapter's expert targets on the experts' 3-D parameters "
            f"{missing}, which pack {pack!r} holds as one nn.Linear per expert ({holder[0]}): the adapter would "
            f"leave every expert out here but not on an unpatched model. {remedy}"
        )


def _exclude_hidden(config: Any, hidden: list[tuple[str, nn.Module]]) -> None:
    """Keep PEFT's lists of names off the modules under a ``hfpatch_hidden_from_adapters`` module.

    Such a module holds, as modules, what the original model holds as parameters
    (qwen-moe's per-expert ``nn.Linear`` experts): a list such as ``["gate_proj",
    "up_proj"]`` or ``"all-linear"`` does not reach them on the original model (where
    PEFT does not rewrite it, ``_refuse_converted_targets``), so it must not here, or
    the adapter would differ.  A regular expression (``target_modules`` as a string) is
    taken as written.
    """
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = getattr(config, "target_modules", None)
    if targets is None or (isinstance(targets, str) and targets != "all-linear"):
        return
    reached = [
        f"{name}.{child}"
        for name, module in hidden
        for child, submodule in module.named_modules()
        if child
        and (
            isinstance(submodule, nn.Linear)
            if targets == "all-linear"
            else bool(check_target_module_exists(config, f"{name}.{child}"))
        )
    ]
    if not reached:
        return
    excluded = getattr(config, "exclude_modules", None)
    if excluded is None:
        config.exclude_modules = reached
    elif isinstance(excluded, str):
        config.exclude_modules = "|".join([f"(?:{excluded})", *(re.escape(name) for name in reached)])
    else:
        config.exclude_modules = [*excluded, *reached]


def _hook(tuners: ModuleType) -> None:
    """Wrap ``tuners.BaseTuner.inject_adapter`` so that it runs ``prepare_model`` first (once)."""
    base = tuners.BaseTuner
    original = base.__dict__["inject_adapter"]
    if getattr(original, _HOOKED, False):
        return

    @functools.wraps(original)
    def inject_adapter(self: Any, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        config = getattr(self, "peft_config", {}).get(adapter_name)
        if config is None:
            return original(self, model, adapter_name, *args, **kwargs)
        excluded = getattr(config, "exclude_modules", None)
        prepare_model(model, config)
        try:
            return original(self, model, adapter_name, *args, **kwargs)
        finally:
            # the exclusions are for this model's modules: the saved adapter_config keeps the user's
            if hasattr(config, "exclude_modules"):
                config.exclude_modules = excluded
            _merge_in_place_on_parts(model)

    setattr(inject_adapter, _HOOKED, True)
    base.inject_adapter = inject_adapter


def _merge_in_place_on_parts(model: nn.Module) -> None:
    """Hook ``merge`` of the adapter layer classes that wrap a ``PackedPart`` in ``model`` (once per class)."""
    for module in model.modules():
        get_base_layer = getattr(module, "get_base_layer", None)
        if get_base_layer is None or not isinstance(get_base_layer(), PackedPart):
            continue
        cls = type(module)
        merge = getattr(cls, "merge", None)
        if merge is not None and not getattr(merge, _HOOKED, False):
            cls.merge = _safe_merge_in_place(merge)  # type: ignore[attr-defined]


def _safe_merge_in_place(merge: Any) -> Any:
    """``merge`` whose ``safe_merge=True`` works on a fused projection's part.

    PEFT's safe merge adds the delta to a copy of the weight, checks it for NaNs and then
    rebinds ``weight.data`` to the copy; a part's weight is a view of the fused rows, read
    at each access, so that rebinding would be lost and the merge silently missing.  On a
    part the merge is done in place and the check runs after it: a weight that is not
    finite is put back as it was, with PEFT's own error, as its safe merge leaves it."""

    @functools.wraps(merge)
    def guarded(self: Any, safe_merge: bool = False, adapter_names: Any = None) -> Any:
        base = self.get_base_layer()
        if not safe_merge or not isinstance(base, PackedPart):
            return merge(self, safe_merge=safe_merge, adapter_names=adapter_names)
        tensors = [tensor for tensor in (base.weight, base.bias) if tensor is not None]
        kept, merged = [tensor.detach().clone() for tensor in tensors], list(self.merged_adapters)
        result = merge(self, safe_merge=False, adapter_names=adapter_names)
        now = [tensor for tensor in (base.weight, base.bias) if tensor is not None]
        if not all(bool(torch.isfinite(tensor).all()) for tensor in now):
            with torch.no_grad():
                for tensor, value in zip(now, kept, strict=True):
                    tensor.copy_(value)
            self.merged_adapters[:] = merged
            adapters = [name for name in (adapter_names or self.active_adapters) if name not in merged]
            raise ValueError(
                f"NaNs detected in the merged weights. The adapter {', '.join(adapters)} seems to be broken"
            )
        return result

    setattr(guarded, _HOOKED, True)
    return guarded


class _Watcher(importlib.abc.MetaPathFinder):
    """Hooks peft's ``BaseTuner`` as soon as its module has run, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TUNERS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader.exec_module = _hooking(spec.loader.exec_module, self)  # type: ignore[method-assign]
                return spec
        return None


def _hooking(execute: Any, watcher: _Watcher) -> Any:
    """``execute`` (a loader's ``exec_module``), then ``_hook`` on the module it ran."""

    def exec_module(module: ModuleType) -> None:
        execute(module)
        _hook(module)
        _unwatch(watcher)

    return exec_module


def _unwatch(watcher: _Watcher) -> None:
    with _lock:
        if watcher in sys.meta_path:
            sys.meta_path.remove(watcher)


def watch_peft() -> None:
    """Hook peft's adapter injection now if peft is imported, else when it is.  Idempotent, cheap."""
    _hook_conversions(load=False)
    tuners = sys.modules.get(_TUNERS)
    if tuners is not None:
        _hook(tuners)
        return
    with _lock:
        if not any(isinstance(finder, _Watcher) for finder in sys.meta_path):
            sys.meta_path.insert(0, _Watcher())


def concerns_adapters(classes: Sequence[type]) -> bool:
    """Whether any of ``classes`` (a plan's replacements) declares packed modules or
    ``hfpatch_hidden_from_adapters``: then PEFT's adapter injection must be hooked."""
    return any(getattr(cls, PACKED_MODULES, None) or hasattr(cls, HIDDEN_FROM_ADAPTERS) for cls in classes)
