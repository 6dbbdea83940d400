"""The pack's replayable top-k routers, and where a model's routers are.

While a model of a covered family loads, the pack replaces its ``*TopKRouter`` with a
subclass of it (``ReplayableRouter`` plus the original) that keeps the original's
constructor, ``weight`` parameter and outputs, so checkpoints load unchanged and the
forward is bit-identical outside a replay. Inside one, the router still runs its own
forward, then swaps in the replayed experts and recomputes their scores from its live
logits, so that gradients keep reaching the router weight.

The router finds its replay in ``scope`` (which ``replay_routing`` fills), so this
module does not import the replay: imports point one way, ``values`` <- ``scope`` <-
``routers`` <- ``replay`` / ``recording``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.flex_olmo.modeling_flex_olmo import FlexOlmoTopKRouter
from transformers.models.minimax.modeling_minimax import MiniMaxTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

from .scope import _replay_of
from .values import RoutingError

__all__ = ["REPLAYABLE_ROUTERS", "ReplayableRouter", "router_returns_probabilities", "routers_of"]


_router_probes: dict[type, bool] = {}


def router_returns_probabilities(router_class: type) -> bool:
    """Whether a top-k MoE router class returns softmax probabilities as its first output.

    A probe of the installed transformers that only this pack needs, so it lives here.

    transformers 5.3 overwrites ``router_logits`` with their softmax before returning
    them; later releases return the logits.  Found once per class by running it on one
    token with known weights (a replacement router takes its parent's convention).
    """
    found = _router_probes.get(router_class)
    if found is None:
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


class ReplayableRouter(nn.Module):
    """Mixin of the pack's routers: the parent's router, plus the replay of a selection.

    A subclass derives from this class and one transformers ``*TopKRouter``, keeping its
    constructor, parameters and forward contract ``(router_logits, router_scores,
    router_indices)``. Outside ``replay_routing`` the forward is the parent's, so
    the outputs are bit-identical. During a replay the parent runs as usual, then:

    * ``router_indices`` are the replayed ones (the live ones for ``LIVE`` rows);
    * ``router_scores`` are the softmax of the live logits gathered at those indices,
      renormalised over the top-k as the family does, in the parent's score dtype: what
      the parent returns when its own top-k picks those experts, with gradients flowing
      into the router weight;
    * ``router_logits`` (the first output, which the load-balancing loss and
      ``output_router_logits`` read) is the parent's, unchanged.
    """

    #: The transformers router class this one replays (set for each subclass).
    original: ClassVar[type[nn.Module]]
    #: Whether the family renormalises the top-k probabilities always (Mixtral, MiniMax)
    #: rather than when ``config.norm_topk_prob`` is set (the Qwen / OLMoE families).
    always_renormalises: ClassVar[bool] = False

    top_k: int
    num_experts: int
    weight: nn.Parameter

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        parents = [base for base in cls.__bases__ if base is not ReplayableRouter]
        if parents:
            cls.original = parents[0]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        replay = _replay_of(self)  # in a recomputation: what this forward pass replayed (scope)
        logits, scores, live_indices = super().forward(hidden_states)
        if replay is None:
            return logits, scores, live_indices
        indices, live = replay.on(live_indices, self.top_k)
        if live is not None:
            indices = torch.where(live[:, None], live_indices, indices)
        if router_returns_probabilities(type(self).original):
            probabilities = logits.float()
        else:
            probabilities = F.softmax(logits, dim=-1, dtype=torch.float)
        top = probabilities.gather(1, indices)
        if self.always_renormalises or getattr(self, "norm_topk_prob", False):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(scores.dtype), indices


class ReplayableQwen2MoeTopKRouter(ReplayableRouter, Qwen2MoeTopKRouter):
    """``Qwen2MoeTopKRouter`` with replay (softmax top-k, renormalised when ``norm_topk_prob``)."""


class ReplayableQwen3MoeTopKRouter(ReplayableRouter, Qwen3MoeTopKRouter):
    """``Qwen3MoeTopKRouter`` with replay (softmax top-k, renormalised when ``norm_topk_prob``)."""


class ReplayableQwen3NextTopKRouter(ReplayableRouter, Qwen3NextTopKRouter):
    """``Qwen3NextTopKRouter`` with replay (softmax top-k, renormalised when ``norm_topk_prob``)."""


class ReplayableOlmoeTopKRouter(ReplayableRouter, OlmoeTopKRouter):
    """``OlmoeTopKRouter`` with replay (softmax top-k, renormalised when ``norm_topk_prob``)."""


class ReplayableFlexOlmoTopKRouter(ReplayableRouter, FlexOlmoTopKRouter):
    """``FlexOlmoTopKRouter`` with replay (softmax top-k, renormalised when ``norm_topk_prob``)."""


class ReplayableMixtralTopKRouter(ReplayableRouter, MixtralTopKRouter):
    """``MixtralTopKRouter`` with replay (softmax top-k, always renormalised, float32 scores)."""

    always_renormalises = True


class ReplayableMiniMaxTopKRouter(ReplayableRouter, MiniMaxTopKRouter):
    """``MiniMaxTopKRouter`` with replay (softmax top-k, always renormalised, float32 scores)."""

    always_renormalises = True


#: The pack's routers, by the model type whose router they replace.
REPLAYABLE_ROUTERS: Mapping[str, type[ReplayableRouter]] = types.MappingProxyType(
    {
        "qwen2_moe": ReplayableQwen2MoeTopKRouter,
        "qwen3_moe": ReplayableQwen3MoeTopKRouter,
        "qwen3_next": ReplayableQwen3NextTopKRouter,
        "olmoe": ReplayableOlmoeTopKRouter,
        "flex_olmo": ReplayableFlexOlmoTopKRouter,
        "mixtral": ReplayableMixtralTopKRouter,
        "minimax": ReplayableMiniMaxTopKRouter,
    }
)

_ROUTER_CLASSES = tuple(router.original for router in REPLAYABLE_ROUTERS.values())


def routers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every router of a covered family in ``model``, in module order.

    Raises:
        RoutingError: ``model`` has none (not an MoE model of a family this pack covers).
    """
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, _ROUTER_CLASSES)]
    if not found:
        families = ", ".join(sorted(REPLAYABLE_ROUTERS))
        raise RoutingError(
            f"{type(model).__name__} has no MoE router of a family hfpatch-pack-moe-replay covers ({families}); "
            "pass the model (or its base model) of one of those families."
        )
    return found
