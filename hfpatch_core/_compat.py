"""Every probe of the installed transformers, in one place.

hfpatch supports a range of transformers releases (``transformers>=5.3,<6``); where
they differ, the difference is tested here, by feature rather than by version number,
and the rest of hfpatch (and packs, which may import this module) asks these
functions.  Probes read module attributes only: they never import more of
transformers than the caller already did.
"""

from __future__ import annotations

import copy
import functools
import importlib
import sys
import types
from typing import Any


def module(name: str) -> types.ModuleType:
    """``transformers.<name>``, from ``sys.modules`` once imported.

    Not ``from transformers import <name>`` on a load's path: importing a model class
    makes transformers put a new lazy package into ``sys.modules["transformers"]``, one
    without its submodules as attributes, and each such import then resolves the
    submodule through the lazy package's ``__getattr__`` (about 10 µs, several per load).
    """
    found = sys.modules.get(f"transformers.{name}")
    return found if found is not None else importlib.import_module(f"transformers.{name}")


@functools.cache
def class_keys_supported() -> bool:
    """Whether conversion lists are looked up by class name and per sub-model (5.24 does; 5.3 applies
    the root model type's list only)."""
    return hasattr(module("conversion_mapping"), "extract_weight_conversions_for_model")


def user_registered_conversions() -> set[str] | None:
    """transformers' record of the conversion keys user code registered (``None`` before 5.24)."""
    keys: set[str] | None = getattr(module("conversion_mapping"), "USER_REGISTERED_MAPPINGS", None)
    return keys


#: conversion key -> the list in force before hfpatch registered one for a load still in
#: progress (``None`` where there was none); kept by ``_runtime.application`` under ``LOAD_LOCK``.
displaced_conversions: dict[str, Any] = {}


def conversions_before_hfpatch(key: str) -> Any:
    """transformers' conversion list for ``key`` as transformers and user code left it (a copy).

    Inside a patched load the registry holds that load's composed list, which a load nested
    in it (a head class's base, built with ``AutoModel.from_config``) composes its own
    converters with; what the enclosing load's converters replaced is gone from it, and a
    nested converter replacing the same transform is no error (``planning``).
    """
    if key in displaced_conversions:
        return copy.deepcopy(displaced_conversions[key])
    return module("conversion_mapping").get_checkpoint_conversion_mapping(key)


def conversion_cache() -> dict[str, Any]:
    """transformers' registry of conversion lists, built first if no load has built it yet."""
    conversion_mapping = module("conversion_mapping")
    if conversion_mapping._checkpoint_conversion_mapping_cache is None:
        conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds the cache
    cache: dict[str, Any] | None = conversion_mapping._checkpoint_conversion_mapping_cache
    assert cache is not None
    return cache


def prefix_change_type() -> tuple[type, ...] | type:
    """transformers' ``PrefixChange`` transform class, or ``()`` where it does not exist (``isinstance`` ready)."""
    found: tuple[type, ...] | type = getattr(module("core_model_loading"), "PrefixChange", ())
    return found


def fusion_patches() -> str | None:
    """How a load's ``fusion_config`` replaces module classes.

    ``None``: the release has no ``fusion_config`` (5.3).  ``"registered"``: transformers
    registers the fused classes with ``register_patch_mapping`` (and their transforms in
    the conversion registry) for good, before the load is planned (5.24).  ``"scoped"``:
    it passes them to ``apply_patches(mapping)`` for that load only, and appends the
    fused modules' transforms to the load's conversion list (5.25).
    """
    module("modeling_utils")  # it imports fusion_mapping where there is one
    fusion_mapping = sys.modules.get("transformers.fusion_mapping")
    if fusion_mapping is None:
        return None
    return "scoped" if hasattr(fusion_mapping, "get_fusion_patch_mapping") else "registered"


def fusion_conflict_patterns(exc: BaseException) -> tuple[str, ...] | None:
    """The source patterns of the fused modules' transform that transformers (5.25) refused
    because a registered conversion has the same ones, or ``None`` if ``exc`` is not that."""
    import ast

    message = str(exc)
    marker = "conflict with its conversion mapping for source patterns "
    if not isinstance(exc, ValueError) or marker not in message:
        return None
    try:
        patterns = ast.literal_eval(message.split(marker, 1)[1].rstrip("."))
    except (ValueError, SyntaxError):
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    return tuple(str(pattern) for pattern in patterns)


def hub_kernels_on_by_default() -> bool:
    """Whether ``from_pretrained`` kernelizes with hub kernels unless told not to (5.25:
    ``use_kernels=None`` is on unless ``USE_HUB_KERNELS`` is false; before, off)."""
    from transformers.integrations import hub_kernels

    return hasattr(hub_kernels, "_ensure_kernels_enabled")


#: The parallelisms transformers' own loader can shard a model with, in the order hfpatch names them.
PARALLEL_MODES = ("tp", "ep", "fsdp", "pp")


def _size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def parallel_modes(distributed_config: Any = None, tp_plan: Any = None, device_mesh: Any = None) -> tuple[str, ...]:
    """Which parallelisms a ``from_pretrained`` call shards the model with, from its arguments.

    Read from what every rank passes alike (the loader's ``distributed_config``,
    ``tp_plan`` and ``device_mesh``), never from rank-local state, so that every rank
    reaches the same answer.  5.25 resolves ``tp_plan`` / ``tp_size`` into a
    ``DistributedConfig`` whose sizes say which parallelisms are on (``tp_size``,
    ``ep_size``, ``fsdp_size * dp_replicate_size``, ``pp_size`` above 1; ``tp_plan={}``
    applies no tensor-parallel rule, as with the expert-parallel plan alone); 5.3 has
    ``tp_plan`` (tensor parallelism over its ``device_mesh``) and
    ``DistributedConfig(enable_expert_parallel=True)``, which swaps the tensor-parallel
    plan for the expert-parallel one.

    Returns:
        A sub-tuple of ``PARALLEL_MODES``; empty for a load that is not sharded.
    """
    if isinstance(distributed_config, dict):
        distributed_config = types.SimpleNamespace(**distributed_config)
    found: set[str] = set()
    if distributed_config is not None and hasattr(distributed_config, "ep_size"):  # 5.25's sizes
        sizes = {
            "tp": _size(getattr(distributed_config, "tp_size", 1)),
            "ep": _size(getattr(distributed_config, "ep_size", 1)),
            "fsdp": _size(getattr(distributed_config, "fsdp_size", 1))
            * _size(getattr(distributed_config, "dp_replicate_size", 1)),
            "pp": _size(getattr(distributed_config, "pp_size", 1)),
        }
        found = {mode for mode, size in sizes.items() if size > 1}
        if getattr(distributed_config, "tp_plan", None) == {}:  # an explicit "no tensor-parallel rule" (EP alone)
            found.discard("tp")
    elif tp_plan is not None or device_mesh is not None or distributed_config is not None:  # 5.3
        mesh_size = int(device_mesh.size()) if device_mesh is not None and hasattr(device_mesh, "size") else 0
        if mesh_size > 1 or (mesh_size == 0 and _world_size() > 1):
            expert = bool(getattr(distributed_config, "enable_expert_parallel", False))
            found = {"ep"} if expert else {"tp"}
    return tuple(mode for mode in PARALLEL_MODES if mode in found)


def expert_mesh_of_loader() -> bool:
    """Whether ``from_pretrained`` shards experts on an expert mesh of its own, dispatching tokens to
    each rank's experts by local id (``DistributedConfig(ep_size=...)``, an ``ep_dispatch_experts``
    rule; 5.25).  5.3 has neither: its ``enable_expert_parallel`` swaps the tensor-parallel plan for
    the expert one on the tensor-parallel mesh, which qwen2_moe does not even define there."""
    from transformers.distributed import DistributedConfig

    return "ep_size" in getattr(DistributedConfig, "__dataclass_fields__", {})


def _world_size() -> int:
    import os

    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def no_init_weights() -> Any:
    """transformers' ``no_init_weights()`` context (the models built in it draw no initial values:
    torch's init functions and ``PreTrainedModel.init_weights``, ties included, do nothing), or
    ``None`` where this release has none (the model is then initialised as usual)."""
    for name in ("initialization", "modeling_utils"):
        found = getattr(module(name), "no_init_weights", None)
        if found is not None:
            return found()
    return None
