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
