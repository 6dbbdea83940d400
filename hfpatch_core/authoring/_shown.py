"""Adapters on the linears of modules a pack shows to them (``hfpatch_hidden_from_adapters = False``).

linear-experts holds as one ``nn.Linear`` per expert what transformers 5 holds as 3-D
parameters; PEFT (and transformers 5.3's copy of its code) rewrites expert names in
``target_modules`` into ``target_parameters`` on those 3-D parameters, and turns the model
type's converters into ones for an adapter's weights.  Here both are kept off such linears:
``_keep_on_linears`` wraps the rewrite, ``_own_conversions`` the converters an adapter load
uses, and ``_hook_conversions`` installs both where their modules are imported.
``hfpatch_core.authoring.peft`` calls them.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
import threading
from typing import Any

import torch.nn as nn

from ..conversion import pattern_regex, source_patterns_of, target_patterns_of

#: The class attribute of a module holding as submodules what the original model holds as
#: parameters.  ``True``: PEFT's lists of names must not reach them (``peft._exclude_hidden``),
#: the original model has no such modules.  ``False``: they are ``nn.Linear`` under the names
#: per-expert checkpoints use, and adapters reach them by those names (``_keep_on_linears``).
HIDDEN_FROM_ADAPTERS = "hfpatch_hidden_from_adapters"
#: Where PEFT (and transformers 5.3's own copy, used by its ``load_adapter``) rewrites
#: transformers-4 expert targets for transformers 5's 3-D experts.
_CONVERSIONS = ("peft.utils.transformers_weight_conversion", "transformers.integrations.peft")
#: set on a function once wrapped, so that it is wrapped once
_HOOKED = "_hfpatch_hooked"
_lock = threading.Lock()


def _shown_linears(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Path -> ``(path, module)`` of the shown module above it, for each ``nn.Linear`` (or adapter layer
    wrapping one) under a module whose class declares ``hfpatch_hidden_from_adapters = False``."""
    found: dict[str, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        if getattr(type(module), HIDDEN_FROM_ADAPTERS, None) is not False:
            continue
        wrapped: list[str] = []  # an adapter layer's own linears (lora_A.default, base_layer) are not targets
        for child, submodule in module.named_modules():
            if not child or any(child.startswith(f"{outer}.") for outer in wrapped):
                continue
            get_base_layer = getattr(submodule, "get_base_layer", None)
            if callable(get_base_layer):
                wrapped.append(child)
                submodule = get_base_layer()
            if isinstance(submodule, nn.Linear):
                found[f"{name}.{child}" if name else child] = (name, module)
    return found


def _reaches(target: str, path: str) -> bool:
    """Whether the ``target_modules`` list entry ``target`` names the module at ``path`` (PEFT's rule)."""
    return path == target or path.endswith(f".{target}")


def _keep_on_linears(convert: Any) -> Any:
    """``convert`` (PEFT's ``convert_peft_config_for_transformers``) kept off the shown experts' linears.

    PEFT (on transformers 5) rewrites expert names in ``target_modules`` (mixtral's ``w1`` /
    ``w3`` / ``w2``, ``gate_proj`` / ``up_proj`` / ``down_proj``) into ``target_parameters``
    on the original model's 3-D experts, for every model type transformers has a
    conversion mapping for.  A model whose experts a pack made ``nn.Linear`` modules has no
    such parameters: the entries that name one of those linears are taken out before the
    rewrite and put back after it, so they reach the linears as on a per-expert model,
    while the rest (the router's ``gate``, which stays a parameter) is rewritten as usual.
    A pattern (``target_modules`` as a string: a regular expression, ``"all-linear"``) that
    reaches one of them is taken as written.  transformers 5.3's copy returns a converted
    copy, PEFT's converts in place: both are kept as they are.
    """
    if getattr(convert, _HOOKED, False):
        return convert

    @functools.wraps(convert)
    def keeping(peft_config: Any, model: nn.Module, conversions: Any = None) -> Any:
        targets: Any = getattr(peft_config, "target_modules", None)
        linears = _shown_linears(model) if targets else {}
        if not linears:
            return convert(peft_config, model=model, conversions=conversions)
        if isinstance(targets, str):
            everything = targets.lower() == "all-linear"
            if everything or any(re.fullmatch(targets, path) for path in linears):
                return peft_config
            return convert(peft_config, model=model, conversions=conversions)
        kept = [target for target in targets if any(_reaches(target, path) for path in linears)]
        if not kept:
            return convert(peft_config, model=model, conversions=conversions)
        reduced = type(targets)(target for target in targets if target not in kept)
        peft_config.target_modules = reduced
        try:
            result = convert(peft_config, model=model, conversions=conversions)
        finally:
            converted = peft_config.target_modules
            peft_config.target_modules = targets
        if result is not None and result is not peft_config:  # transformers 5.3: a converted copy
            converted = result.target_modules
        else:
            result = peft_config
        result.target_modules = targets if converted is reduced else type(converted)([*converted, *kept])
        return result

    setattr(keeping, _HOOKED, True)
    return keeping


def _own_conversions(get_mapping: Any) -> Any:
    """``get_mapping`` (transformers' ``get_model_conversion_mapping``, as PEFT's adapter loads
    call it) without the converters that concern a shown module's per-expert linears.

    Loading an adapter (``PeftModel.from_pretrained``, ``model.load_adapter``), PEFT and
    transformers turn the model type's converters into ones for the adapter's weights, so
    that an adapter saved on a per-expert model lands on the 3-D experts; on a model whose
    experts are per-expert ``nn.Linear`` (shown, ``_keep_on_linears``), those converters
    would move the weights of the adapters on them to parameters the model lacks.  A
    converter is left out when it concerns the shown linears or the modules holding them (a
    pattern's stem ends one of their paths: the per-expert weights it stacks, the 3-D
    tensors it realigns) and no parameter of the model has a target's name (it is not this
    model's), or when a target pattern matches one (it builds the linears from a checkpoint's
    layout, as a pack's split of 3-D experts does: the adapter names the linears themselves).
    Patterns read as transformers reads them (``conversion.pattern_regex``).
    """
    if getattr(get_mapping, _HOOKED, False):
        return get_mapping

    @functools.wraps(get_mapping)
    def own(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        conversions = get_mapping(model, *args, **kwargs)
        linears = _shown_linears(model) if isinstance(model, nn.Module) else {}
        if not linears or not conversions:
            return conversions
        weights = [f"{path}.weight" for path in linears]
        # the linears and the modules holding them: a pattern's stem (``mlp.experts.*.w1`` of
        # ``...w1.weight``, ``mlp.experts`` of ``mlp.experts.gate_up_proj``) ending one concerns them
        holders = [*linears, *{at for at, _ in linears.values()}]
        parameters = [name for name, _ in model.named_parameters()]

        def matches(pattern: str, paths: list[str]) -> bool:
            compiled = pattern_regex(pattern)
            return compiled is not None and any(compiled.search(path) for path in paths)

        def concerns(pattern: str) -> bool:
            return matches(f"(?:{pattern.rsplit('.', 1)[0]})$", holders)

        def foreign(conversion: Any) -> bool:
            sources = source_patterns_of(conversion)
            targets = target_patterns_of(conversion)
            if any(matches(target, weights) for target in targets):
                return True  # builds the linears' weights from another layout (a pack's split of 3-D tensors)
            if not targets or not any(concerns(pattern) for pattern in (*sources, *targets)):
                return False
            return not any(target in name for target in targets for name in parameters)

        return [conversion for conversion in conversions if not foreign(conversion)]

    setattr(own, _HOOKED, True)
    return own


def _hook_conversions(*, load: bool = True) -> None:
    """Keep the expert-target rewrites of PEFT and of transformers 5.3 off the shown experts'
    linears (``_keep_on_linears``), and their adapter weights off the converters that stack
    per-expert weights (``_own_conversions``), in each of their modules that is imported
    (PEFT's also imported here with ``load``: it is imported only when an adapter is put in,
    and must not be while peft itself is being imported)."""
    for name in _CONVERSIONS:
        module = sys.modules.get(name)
        if module is None and load and name == _CONVERSIONS[0]:
            try:
                module = importlib.import_module(name)
            except ImportError:  # a peft without transformers-5 conversions rewrites nothing
                continue
        if module is None:
            continue
        with _lock:
            for attribute, wrap in (
                ("convert_peft_config_for_transformers", _keep_on_linears),
                ("get_model_conversion_mapping", _own_conversions),
            ):
                function = getattr(module, attribute, None)
                if function is not None and not getattr(function, _HOOKED, False):
                    setattr(module, attribute, wrap(function))
