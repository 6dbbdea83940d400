"""Candidates built small: one instance of a real module class to probe, without its real sizes.

A structural pack decides what a class computes by running it (``docs/examples/rms-norm``).
One instance of a real model's MLP, attention or experts, at the load's sizes, is hundreds of
megabytes to gigabytes; the same class built from the same config with its sizes scaled down
(hidden and intermediate sizes, heads, experts, layers, vocabulary) computes the same thing on
a few kilobytes.  ``shrunk_config`` scales a config down; ``shrunk_instance`` builds the model
of that config on the CPU, as vanilla transformers builds it, and returns the first module of
the class asked for, its parameters drawn at random from a seed.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .._scope import vanilla
from ..context import LoadContext
from .randomness import isolated_rng

__all__ = ["SHRUNK_SIZES", "shrunk_config", "shrunk_instance"]

#: The size fields ``shrunk_config`` lowers (where a config or sub-config has them, and larger):
#: small enough that a model of them is kilobytes, large enough that every head, expert and
#: group is still more than one (a probe that sees one head cannot tell them apart).
SHRUNK_SIZES: Mapping[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "d_model": 64,
    "n_embd": 64,
    "n_head": 4,
    "n_layer": 2,
    "num_layers": 2,
    "ffn_dim": 128,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}


def shrunk_config(config: Any, sizes: Mapping[str, int] | None = None) -> Any:
    """A copy of ``config`` with its size fields, and its sub-configs', lowered to ``sizes``.

    Each field of ``sizes`` (default ``SHRUNK_SIZES``) that the config holds as an integer larger
    than the small value is set to it; ``config`` itself is not changed.  Fields a config derived
    from the sizes when it was built (a ``head_dim`` left unset) are not derived again: the
    ones a module reads are in ``SHRUNK_SIZES``, so that they stay consistent.

    Args:
        config: a transformers config (a hook's ``context.config``).
        sizes: field -> the value to lower it to.

    Returns:
        The shrunk copy.
    """
    from transformers import PretrainedConfig

    small = dict(SHRUNK_SIZES if sizes is None else sizes)
    shrunk = copy.deepcopy(config)
    pending, seen = [shrunk], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for name, value in small.items():
            found = vars(current).get(name)
            if isinstance(found, int) and not isinstance(found, bool) and found > value:
                setattr(current, name, value)
        pending.extend(value for value in vars(current).values() if isinstance(value, PretrainedConfig))
    return shrunk


def shrunk_instance(
    model_class: type[nn.Module] | LoadContext,
    module_class: type[nn.Module],
    config: Any = None,
    *,
    sizes: Mapping[str, int] | None = None,
    seed: int = 0,
) -> nn.Module:
    """The first ``module_class`` module of ``model_class(shrunk_config(config))``, built on the CPU.

    The model is built as vanilla transformers builds it (no pack applies, hfpatch's loader
    wrappers skip it: safe from inside a hook, as ``build_on_meta``; under ``isolated_rng``, so
    the caller's random stream is left as it was), with its sizes scaled
    down (``shrunk_config``), so that its buffers are computed as the model computes them; then
    every parameter of the module is drawn from a standard normal distribution seeded by
    ``seed`` (a probe compares computations, and transformers' initial values, ones and zeros,
    hide differences such as ``weight * x`` against ``(1 + weight) * x``).

    Args:
        model_class: a transformers model class, or a hook's ``LoadContext`` (its class and config).
        module_class: the class of the module wanted (compared by identity).
        config: the config to shrink (default: the context's).
        sizes: as ``shrunk_config``'s.
        seed: the seed of the parameters' values.

    Returns:
        The module, on the CPU, in float32 (a submodule of the shrunk model, which is not kept).

    Raises:
        ValueError: a context whose class transformers does not export, or with no config.
        LookupError: the shrunk model has no ``module_class`` module (a class built only at
            some sizes, or only by another model class).
        Exception: whatever building the shrunk model raises (a config whose sizes must agree
            in a way the shrinking breaks).
    """
    if isinstance(model_class, LoadContext):
        context = model_class
        found, config = context.model_class, config if config is not None else context.config
        if found is None or config is None:
            missing = "no config" if config is None else f"transformers exports no class {context.model_class_name!r}"
            raise ValueError(f"shrunk_instance({context.model_class_name} load): {missing}; pass a class and a config")
        model_class = found
    elif config is None:
        raise ValueError(f"shrunk_instance({model_class.__name__}, ...): pass the config to shrink")
    small = shrunk_config(config, sizes)
    # hooks of a nested load run under transformers' meta default device: the probe is built on the CPU
    # building draws initial weights: from generators of the probe's own, not the caller's stream
    with vanilla(), torch.device("cpu"), warnings.catch_warnings(), isolated_rng(seed):
        warnings.simplefilter("ignore")  # what building a small model says is not the load's business
        model = model_class(small)
    module = next((module for module in model.modules() if type(module) is module_class), None)
    if module is None:
        raise LookupError(
            f"{model_class.__name__} built with its sizes shrunk has no {module_class.__name__} module; "
            "probe an instance of the load's own model instead (build_on_meta)"
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float32))
    return module
