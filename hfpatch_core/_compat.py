"""Every probe of the installed transformers, in one place.

hfpatch supports a range of transformers releases (``transformers>=5.3,<6``); where
they differ, the difference is tested here, by feature rather than by version number,
and the rest of hfpatch (and packs, which may import this module) asks these
functions.  Probes read module attributes only: they never import more of
transformers than the caller already did.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def class_keys_supported() -> bool:
    """Whether conversion lists are looked up by class name and per sub-model (5.24 does; 5.3 applies
    the root model type's list only)."""
    from transformers import conversion_mapping

    return hasattr(conversion_mapping, "extract_weight_conversions_for_model")


def user_registered_conversions() -> set[str] | None:
    """transformers' record of the conversion keys user code registered (``None`` before 5.24)."""
    from transformers import conversion_mapping

    keys: set[str] | None = getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", None)
    return keys


def conversion_cache() -> dict[str, Any]:
    """transformers' registry of conversion lists, built first if no load has built it yet."""
    from transformers import conversion_mapping

    if conversion_mapping._checkpoint_conversion_mapping_cache is None:
        conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds the cache
    cache: dict[str, Any] | None = conversion_mapping._checkpoint_conversion_mapping_cache
    assert cache is not None
    return cache


def prefix_change_type() -> tuple[type, ...] | type:
    """transformers' ``PrefixChange`` transform class, or ``()`` where it does not exist (``isinstance`` ready)."""
    from transformers import core_model_loading

    found: tuple[type, ...] | type = getattr(core_model_loading, "PrefixChange", ())
    return found


_router_probes: dict[type, bool] = {}


def router_returns_probabilities(router_class: type) -> bool:
    """Whether a top-k MoE router class returns softmax probabilities as its first output.

    transformers 5.3 overwrites ``router_logits`` with their softmax before returning
    them; later releases return the logits.  Found once per class by running it on one
    token with known weights (a replacement router takes its parent's convention).
    """
    found = _router_probes.get(router_class)
    if found is None:
        import types

        import torch

        config = types.SimpleNamespace(
            hidden_size=1, num_experts=2, num_local_experts=2, num_experts_per_tok=1, norm_topk_prob=False
        )
        probe: Any = router_class(config)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            probe.weight.copy_(torch.tensor([[3.0], [1.0]]))
            first = probe(torch.ones(1, 1))[0]
        # logits (3, 1) sum to 4, probabilities to 1
        found = _router_probes[router_class] = bool(abs(float(first.sum()) - 1.0) < 1e-3)
    return found


def fusion_patches() -> str | None:
    """How a load's ``fusion_config`` replaces module classes.

    ``None``: the release has no ``fusion_config`` (5.3).  ``"registered"``: transformers
    registers the fused classes with ``register_patch_mapping`` (and their transforms in
    the conversion registry) for good, before the load is planned (5.24).  ``"scoped"``:
    it passes them to ``apply_patches(mapping)`` for that load only, and appends the
    fused modules' transforms to the load's conversion list (5.25).
    """
    import sys

    from transformers import modeling_utils  # noqa: F401  (it imports fusion_mapping where there is one)

    module = sys.modules.get("transformers.fusion_mapping")
    if module is None:
        return None
    return "scoped" if hasattr(module, "get_fusion_patch_mapping") else "registered"


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
