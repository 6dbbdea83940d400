"""Recording the experts an MoE model routes each token to, and replaying that routing.

* ``Routing`` is the value: one ``LongTensor`` of shape ``(tokens, top_k)`` per
  router (MoE layer), tokens ordered as the routers see them, ``batch × sequence``
  flattened row by row (``hidden_states.reshape(-1, hidden)``).
* ``record_routing`` collects a ``Routing`` from any model of a covered family,
  patched or not (forward hooks on its routers, removed when the block ends).
* ``replay_routing`` makes the pack's routers select the recorded experts, while
  their scores are recomputed from the live router weights, so gradients reach them.
* ``Routing.from_vllm`` / ``Routing.to_vllm`` convert vLLM's ``routed_experts``
  layout ``(seq_len, num_layers, top_k)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal

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

from hfpatch_core.errors import HfPatchError

__all__ = [
    "LIVE",
    "ReplayableRouter",
    "Routing",
    "RoutingError",
    "RoutingRecording",
    "record_routing",
    "replay_routing",
]

#: The expert id that marks a token "route live" in a ``Routing``: a row of
#: ``LIVE`` (padding added by ``Routing.padded`` / ``Routing.stack``) makes the
#: router keep its own top-k for that token during a replay.
LIVE = -1

_PACK = "moe-replay"


class RoutingError(HfPatchError, ValueError):
    """A routing is malformed, or does not fit the model or forward pass it is replayed on."""


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


# --- the value ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
    """The experts each token was routed to, per MoE layer: a frozen value.

    Attributes:
        layers: one ``torch.long`` tensor of shape ``(tokens, top_k)`` per router, in the
            model's module order (dense layers have no router and no entry). Row ``t`` is
            the ``t``-th token the router saw: ``batch × sequence`` flattened row by row,
            padding included. A row of ``LIVE`` (``-1``) means "keep the live top-k".
        batch_size: how many sequences the tokens are (``tokens == batch_size * seq_len``).

    The tensors are copied (detached, ``torch.long``) at construction, so later in-place
    changes to the inputs do not reach the routing. Two routings are equal when their
    batch sizes and every index are.

    Raises:
        RoutingError: no layer; a layer that is not a 2-D integer tensor; layers of
            different shapes; an id below ``-1``; a row mixing ``LIVE`` and expert ids;
            the same expert twice in a row; ``batch_size`` not dividing the token count.
    """

    layers: tuple[torch.Tensor, ...]
    batch_size: int = 1

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            raise RoutingError(
                "Routing(layers=...) takes a sequence of per-layer (tokens, top_k) tensors, got "
                f"{type(layers).__name__}; for vLLM's (seq_len, num_layers, top_k) array use Routing.from_vllm(array)."
            )
        if not layers:
            raise RoutingError("Routing(layers=()) has no layer; pass one (tokens, top_k) tensor per MoE layer.")
        converted = tuple(_index_tensor(layer, position) for position, layer in enumerate(layers))
        expected = _shape(converted[0])
        for position, layer in enumerate(converted):
            if _shape(layer) != expected:
                raise RoutingError(
                    f"Routing layer {position} has shape {_shape(layer)}, layer 0 has {expected}: every layer routes "
                    "the same tokens with the same top_k; pass tensors of one shape (tokens, top_k)."
                )
        batch_size = self.batch_size
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RoutingError(f"Routing batch_size must be a positive int, got {batch_size!r}.")
        if expected[0] % batch_size:
            raise RoutingError(
                f"Routing has {expected[0]} tokens, which batch_size={batch_size} does not divide: tokens are "
                "batch_size × seq_len (padding included); pad the sequences to one length (Routing.stack)."
            )
        for position, layer in enumerate(converted):
            _check_ids(layer, position)
        object.__setattr__(self, "layers", converted)
        object.__setattr__(self, "batch_size", batch_size)

    @property
    def num_layers(self) -> int:
        """How many routers (MoE layers) the routing covers."""
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        """How many tokens each router sees: ``batch_size * seq_len``."""
        return int(self.layers[0].shape[0])

    @property
    def seq_len(self) -> int:
        """The length of each sequence (padding included)."""
        return self.num_tokens // self.batch_size

    @property
    def top_k(self) -> int:
        """How many experts each token is routed to."""
        return int(self.layers[0].shape[1])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Routing):
            return NotImplemented
        return (
            self.batch_size == other.batch_size
            and self.num_layers == other.num_layers
            and all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(self.layers, other.layers, strict=True))
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, and tensors are mutable

    def __repr__(self) -> str:
        return (
            f"Routing(num_layers={self.num_layers}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"top_k={self.top_k})"
        )

    # --- vLLM ------------------------------------------------------------------------

    @classmethod
    def from_vllm(cls, routed_experts: Any) -> Routing:
        """The routing of vLLM's ``routed_experts`` array.

        Args:
            routed_experts: a numpy array or torch tensor of integer expert ids, shaped
                ``(seq_len, num_layers, top_k)`` (one request), or
                ``(batch, seq_len, num_layers, top_k)`` (sequences of one length).

        Returns:
            a ``Routing`` with ``batch_size`` 1 (or ``batch``), token ``t`` of layer
            ``l`` being ``routed_experts[t, l]``.

        Raises:
            RoutingError: the array has another number of dimensions, or invalid ids.
        """
        if isinstance(routed_experts, torch.Tensor):
            tensor = routed_experts.detach()
        else:
            import numpy

            tensor = torch.tensor(numpy.asarray(routed_experts))
        if tensor.dim() == 4:
            batch_size = int(tensor.shape[0])
            tensor = tensor.reshape(-1, *tensor.shape[2:])
        elif tensor.dim() == 3:
            batch_size = 1
        else:
            raise RoutingError(
                f"Routing.from_vllm expects vLLM's routed_experts layout (seq_len, num_layers, top_k), or "
                f"(batch, seq_len, num_layers, top_k), got shape {_shape(tensor)}."
            )
        return cls(tuple(tensor[:, layer, :] for layer in range(tensor.shape[1])), batch_size=batch_size)

    def to_vllm(self) -> torch.Tensor:
        """This routing in vLLM's ``routed_experts`` layout: the inverse of ``from_vllm``.

        Returns:
            a CPU ``torch.long`` tensor of shape ``(seq_len, num_layers, top_k)`` when
            ``batch_size`` is 1, else ``(batch_size, seq_len, num_layers, top_k)``
            (``.numpy()`` for an array). ``LIVE`` rows stay ``-1``.
        """
        stacked = torch.stack([layer.cpu() for layer in self.layers], dim=1)
        if self.batch_size == 1:
            return stacked
        return stacked.reshape(self.batch_size, self.seq_len, self.num_layers, self.top_k)

    # --- padding and batching ----------------------------------------------------------

    def padded(self, seq_len: int, *, side: Literal["left", "right"] = "right") -> Routing:
        """Each sequence extended to ``seq_len`` tokens with ``LIVE`` rows.

        Use it where the forward pass routes tokens the routing does not cover: the padding
        of a batch, or the last generated token (which ``generate`` never feeds back, so a
        routing recorded during ``generate`` has ``prompt + new_tokens - 1`` positions).

        Args:
            seq_len: the padded length, at least ``seq_len``.
            side: ``"right"`` appends, ``"left"`` prepends (for a left-padded batch).

        Returns:
            a new ``Routing`` with the same ``batch_size``.
        """
        if side not in ("left", "right"):
            raise RoutingError(f"Routing.padded(side={side!r}): side must be 'left' or 'right'.")
        if seq_len < self.seq_len:
            raise RoutingError(
                f"Routing.padded({seq_len}) is shorter than the routing's seq_len {self.seq_len}; "
                "pass a length of at least seq_len."
            )
        extra = seq_len - self.seq_len
        layers = []
        for layer in self.layers:
            rows = layer.reshape(self.batch_size, self.seq_len, self.top_k)
            padding = torch.full((self.batch_size, extra, self.top_k), LIVE, dtype=torch.long, device=layer.device)
            parts = (rows, padding) if side == "right" else (padding, rows)
            layers.append(torch.cat(parts, dim=1).reshape(-1, self.top_k))
        return Routing(tuple(layers), batch_size=self.batch_size)

    @classmethod
    def stack(
        cls,
        routings: Sequence[Routing],
        *,
        padding_side: Literal["left", "right"] = "right",
        seq_len: int | None = None,
    ) -> Routing:
        """One routing for a batch of sequences, padded to one length with ``LIVE`` rows.

        Args:
            routings: the routings of the batch's sequences (or sub-batches), in batch order,
                e.g. ``[Routing.from_vllm(output.routed_experts) for output in outputs]``.
            padding_side: where the tokenizer pads the training batch.
            seq_len: the padded length (default: the longest routing's).

        Returns:
            a ``Routing`` whose ``batch_size`` is the sum of theirs.

        Raises:
            RoutingError: no routing, or routings of different layer counts or top-k.
        """
        if not routings or not all(isinstance(routing, Routing) for routing in routings):
            raise RoutingError("Routing.stack takes a non-empty sequence of Routing objects.")
        first = routings[0]
        for position, routing in enumerate(routings):
            if (routing.num_layers, routing.top_k) != (first.num_layers, first.top_k):
                raise RoutingError(
                    f"Routing.stack: routing {position} has {routing.num_layers} layers of top_k {routing.top_k}, "
                    f"routing 0 has {first.num_layers} of top_k {first.top_k}; stack routings of one model."
                )
        length = max(routing.seq_len for routing in routings) if seq_len is None else seq_len
        padded = [routing.padded(length, side=padding_side) for routing in routings]
        layers = tuple(
            torch.cat([routing.layers[layer].to(first.layers[layer].device) for routing in padded])
            for layer in range(first.num_layers)
        )
        return cls(layers, batch_size=sum(routing.batch_size for routing in routings))


def _index_tensor(value: Any, position: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            import numpy

            value = torch.tensor(numpy.asarray(value))
        except (TypeError, ValueError) as exc:
            raise RoutingError(
                f"Routing layer {position} is {type(value).__name__}, not a tensor of expert ids ({exc})."
            ) from None
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise RoutingError(
            f"Routing layer {position} has dtype {value.dtype}; expert ids are integers (router_indices, or "
            "vLLM's routed_experts): pass an integer tensor."
        )
    if value.dim() != 2 or value.shape[0] == 0 or value.shape[1] == 0:
        raise RoutingError(
            f"Routing layer {position} has shape {_shape(value)}; each layer is (tokens, top_k) with tokens = "
            "batch × seq_len flattened row by row (for a (batch, seq_len, top_k) tensor use .reshape(-1, top_k))."
        )
    return value.detach().to(torch.long, copy=True).contiguous()


def _check_ids(layer: torch.Tensor, position: int) -> None:
    if bool((layer < LIVE).any()):
        raise RoutingError(
            f"Routing layer {position} holds expert id {int(layer.min())}; ids are >= 0, or {LIVE} (LIVE) for a "
            "token the router routes itself."
        )
    live = layer == LIVE
    mixed = live.any(dim=1) & ~live.all(dim=1)
    if bool(mixed.any()):
        token = int(mixed.nonzero()[0, 0])
        raise RoutingError(
            f"Routing layer {position}, token {token}: {layer[token].tolist()} mixes LIVE ({LIVE}) with expert ids; "
            "a token is either replayed (all top_k ids) or routed live (all LIVE)."
        )
    ordered = layer.sort(dim=1).values
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != LIVE)).any(dim=1)
    if bool(repeated.any()):
        token = int(repeated.nonzero()[0, 0])
        raise RoutingError(
            f"Routing layer {position}, token {token}: {layer[token].tolist()} names an expert twice; a router "
            "selects top_k distinct experts per token."
        )


# --- the routers ---------------------------------------------------------------------------


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
        replay = _replay_of(self)
        logits, scores, live_indices = super().forward(hidden_states)
        if replay is None:
            return logits, scores, live_indices
        indices, live = replay.on(live_indices, self)
        if live is not None:
            indices = torch.where(live[:, None], live_indices, indices)
        if _first_output_is_probabilities(type(self).original):
            probabilities = logits.float()
        else:
            probabilities = F.softmax(logits, dim=-1, dtype=torch.float)
        top = probabilities.gather(1, indices)
        if self.always_renormalises or getattr(self, "norm_topk_prob", False):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(scores.dtype), indices


_PROBED: dict[type[nn.Module], bool] = {}


def _first_output_is_probabilities(router_class: type[nn.Module]) -> bool:
    """Whether ``router_class`` returns softmax probabilities as its first output.

    transformers 5.3 overwrites ``router_logits`` with their softmax before returning
    them; later releases return the logits. The replay takes the parent's convention,
    found once by running the class on one token with known weights.
    """
    found = _PROBED.get(router_class)
    if found is None:
        config = types.SimpleNamespace(
            hidden_size=1, num_experts=2, num_local_experts=2, num_experts_per_tok=1, norm_topk_prob=False
        )
        probe: Any = router_class(config)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            probe.weight.copy_(torch.tensor([[3.0], [1.0]]))
            first = probe(torch.ones(1, 1))[0]
        # logits (3, 1) sum to 4, probabilities to 1
        found = _PROBED[router_class] = bool(abs(float(first.sum()) - 1.0) < 1e-3)
    return found


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


# --- replay ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _LayerReplay:
    """What one router replays: its layer's indices, and the rows that stay live."""

    layer: int
    name: str
    indices: torch.Tensor
    live: torch.Tensor | None
    _by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = dataclasses.field(default_factory=dict)

    def on(self, live_indices: torch.Tensor, router: ReplayableRouter) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The indices (and live rows) on ``live_indices``' device, checked against its token count."""
        rows = int(live_indices.shape[0])
        expected = (rows, int(router.top_k))
        if _shape(self.indices) != expected:
            raise RoutingError(
                f"replay_routing: layer {self.layer} ({self.name}) routes {rows} tokens in this forward pass, so it "
                f"expected routing of shape {expected}, got {_shape(self.indices)}. The routing must cover every "
                "token of the forward, batch × seq_len in order, padding included: a routing recorded during "
                "generate() lacks the last generated token (use routing.padded(seq_len)); sequences of different "
                "lengths are batched with Routing.stack(..., padding_side=...). One replay block replays one "
                "forward pass (plus its backward); do not call generate() inside it."
            )
        cached = self._by_device.get(live_indices.device)
        if cached is None:
            live = None if self.live is None else self.live.to(live_indices.device)
            cached = self._by_device[live_indices.device] = (self.indices.to(live_indices.device), live)
        return cached


_REPLAY: contextvars.ContextVar[Mapping[nn.Module, _LayerReplay] | None] = contextvars.ContextVar(
    "hfpatch_moe_replay", default=None
)
# The open replays of each router, for the recomputation of activation checkpointing
# inside a backward pass: autograd runs it on its own worker threads (one per GPU), which
# do not see the context of the thread that opened the replay.
_OPEN: dict[nn.Module, list[_LayerReplay]] = {}
_OPEN_LOCK = threading.Lock()


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _replay_of(router: nn.Module) -> _LayerReplay | None:
    active = _REPLAY.get()
    if active is not None:
        found = active.get(router)
        if found is not None:
            return found
    if not _OPEN or not _in_backward():
        return None
    with _OPEN_LOCK:
        owners = list(_OPEN.get(router, ()))
    if len(owners) > 1:
        raise RoutingError(
            f"replay_routing: router {owners[0].name} is recomputed in a backward pass on an autograd thread while "
            f"{len(owners)} replay blocks are open on this model in different threads, so which routing applies is "
            "ambiguous; run the backward passes of one model one at a time, or disable gradient checkpointing."
        )
    return owners[0] if owners else None


@contextlib.contextmanager
def replay_routing(model: nn.Module, routing: Routing) -> Iterator[None]:
    """Make ``model``'s routers select the experts of ``routing`` inside the block.

    Only ``model``'s routers and only the current thread (and context) are affected; the
    block leaves nothing behind, also when it raises. Each router's scores are recomputed
    from its live weights (see ``ReplayableRouter``), so ``loss.backward()`` trains
    them. With gradient checkpointing, call ``backward()`` inside the block: the
    recomputed forward must replay too (it does, also on autograd's GPU threads).

    Args:
        model: a model loaded with the ``moe-replay`` pack (``hfpatch_core.enable("moe-replay")``
            or ``HF_PATCH_PACKS``), or any module containing one.
        routing: from ``record_routing``, ``Routing.from_vllm`` or
            ``Routing.stack``, one layer per router of ``model``.

    Raises:
        RoutingError: here, when ``model`` has no replayable router or the routing's layer
            count, top-k or expert ids do not fit it; in the forward pass, when a layer
            routes another number of tokens than the routing holds.
    """
    if not isinstance(routing, Routing):
        raise RoutingError(
            f"replay_routing(model, routing): routing must be a Routing, got {type(routing).__name__}; build one "
            "with record_routing(model), Routing.from_vllm(routed_experts) or Routing(layers=...)."
        )
    routers = routers_of(model)
    vanilla = [name for name, router in routers if not isinstance(router, ReplayableRouter)]
    if vanilla:
        raise RoutingError(
            f"replay_routing: {type(model).__name__} was loaded without the {_PACK} pack (router {vanilla[0]} is "
            f"{type(dict(routers)[vanilla[0]]).__name__}); load it with hfpatch_core.enable({_PACK!r}) (or "
            f"HF_PATCH_PACKS={_PACK}) before from_pretrained."
        )
    names = [name for name, _ in routers]
    if routing.num_layers != len(routers):
        raise RoutingError(
            f"replay_routing: the routing has {routing.num_layers} layers, {type(model).__name__} has "
            f"{len(routers)} MoE routers ({', '.join(names)}); pass the routing recorded on (or returned by vLLM "
            "for) this architecture, one layer per MoE layer, dense layers excluded."
        )
    plan: dict[nn.Module, _LayerReplay] = {}
    for layer, ((name, router), indices) in enumerate(zip(routers, routing.layers, strict=True)):
        top_k, experts = int(getattr(router, "top_k", 0)), int(getattr(router, "num_experts", 0))
        if routing.top_k != top_k:
            raise RoutingError(
                f"replay_routing: layer {layer} ({name}) selects top_k={top_k} experts per token, so it expected "
                f"routing of shape ({routing.num_tokens}, {top_k}), got {_shape(indices)}; record the routing with "
                "the same num_experts_per_tok."
            )
        highest = int(indices.max())
        if highest >= experts:
            raise RoutingError(
                f"replay_routing: layer {layer} ({name}) has {experts} experts (ids 0..{experts - 1}), the routing "
                f"names expert {highest}; pass a routing recorded on a model with this config."
            )
        live = (indices == LIVE).all(dim=1)
        plan[router] = _LayerReplay(layer, name, indices, live if bool(live.any()) else None)
    outer = _REPLAY.get()
    token = _REPLAY.set({**outer, **plan} if outer else plan)
    with _OPEN_LOCK:
        for router, replay in plan.items():
            _OPEN.setdefault(router, []).append(replay)
    try:
        yield
    finally:
        _REPLAY.reset(token)
        with _OPEN_LOCK:
            for router, replay in plan.items():
                owners = _OPEN[router]
                owners.remove(replay)
                if not owners:
                    del _OPEN[router]


# --- recording -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Call:
    batch_size: int
    seq_len: int
    indices: torch.Tensor


_RECORDING: contextvars.ContextVar[tuple[RoutingRecording, ...]] = contextvars.ContextVar(
    "hfpatch_moe_recording", default=()
)


class RoutingRecording:
    """What ``record_routing`` collected: every router call of every forward pass in the block.

    Attributes:
        layer_names: the routers' module names, one per layer of the routing.
    """

    def __init__(self, layer_names: Sequence[str]) -> None:
        self.layer_names = tuple(layer_names)
        self._calls: list[list[_Call]] = [[] for _ in self.layer_names]
        self._pending: dict[int, tuple[int, int]] = {}

    def _before_block(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self not in _RECORDING.get():
            return
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            self._pending[layer] = (int(hidden.shape[0]), int(hidden.shape[1]))

    def _after_router(self, layer: int, output: Any) -> None:
        # the recomputation of gradient checkpointing repeats a forward already recorded
        if self not in _RECORDING.get() or _in_backward():
            return
        indices = output[2]
        rows = int(indices.shape[0])
        batch_size, seq_len = self._pending.pop(layer, (1, rows))
        if batch_size * seq_len != rows:  # the block was called on a flattened batch
            batch_size, seq_len = 1, rows
        self._calls[layer].append(_Call(batch_size, seq_len, indices.detach()))

    def _passes(self) -> int:
        counts = {len(calls) for calls in self._calls}
        if len(counts) > 1:
            detail = ", ".join(
                f"{name}: {len(calls)}" for name, calls in zip(self.layer_names, self._calls, strict=True)
            )
            raise RoutingError(
                f"record_routing: the routers ran different numbers of times ({detail}), so the calls cannot be "
                "matched into forward passes: a forward pass stopped half-way (an exception, or the block ended "
                "inside one); record complete forward passes."
            )
        return counts.pop()

    @property
    def steps(self) -> tuple[Routing, ...]:
        """One ``Routing`` per forward pass, in call order (for ``generate``: the prompt,
        then one token per sequence per step)."""
        return tuple(
            Routing(tuple(calls[step].indices for calls in self._calls), batch_size=self._calls[0][step].batch_size)
            for step in range(self._passes())
        )

    @property
    def routing(self) -> Routing:
        """The forward passes of the block as one routing over the whole sequences.

        Every forward pass is taken as the continuation of the previous one, which is what
        ``generate`` with a KV cache (the default) runs: the prompt (``batch × prompt_len``
        tokens), then ``batch × 1`` per new token. Per sequence, the passes' tokens are
        concatenated in order, so the result has ``batch_size`` sequences of
        ``prompt_len + new_tokens - 1`` tokens (the last generated token is never fed
        back); ``routing.padded(sequences.shape[1])`` covers a training forward over
        ``generate``'s output. A single forward pass gives its own routing. Generation
        without a KV cache, beam search or assisted decoding re-route tokens and do not
        concatenate like this: use ``steps`` there.

        Raises:
            RoutingError: nothing was recorded, or the passes have different batch sizes.
        """
        if not self._passes():
            raise RoutingError(
                "record_routing: no forward pass ran inside the block; call the model (or generate) inside "
                "`with record_routing(model) as recording:` and read recording.routing after it."
            )
        batch_sizes = [call.batch_size for call in self._calls[0]]
        if len(set(batch_sizes)) > 1:
            raise RoutingError(
                f"record_routing: the forward passes in the block have batch sizes {batch_sizes}, so they are not "
                "one generation; record each forward pass or generate() call in its own block, or read "
                "recording.steps."
            )
        batch_size = batch_sizes[0]
        layers = []
        for calls in self._calls:
            top_k = int(calls[0].indices.shape[1])
            parts = [call.indices.reshape(batch_size, call.seq_len, top_k) for call in calls]
            layers.append(torch.cat(parts, dim=1).reshape(-1, top_k))
        return Routing(tuple(layers), batch_size=batch_size)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecording]:
    """Record the experts ``model``'s routers select in the forward passes run inside the block.

    Works on any model of a covered family, loaded with the pack or not. Hooks are
    installed on the routers (and their MoE blocks, for the batch shape) for the block
    only, and record only calls made from the current thread and context. Indices stay on
    the routers' device. Recording inside ``replay_routing`` records the replayed
    selection.

    Example::

        with torch.no_grad(), record_routing(model) as recording:
            sequences = model.generate(**inputs, max_new_tokens=64)
        routing = recording.routing.padded(sequences.shape[1])
        with replay_routing(model, routing):
            model(sequences, attention_mask=mask).logits ...

    Yields:
        a ``RoutingRecording``; read its ``routing`` (or
        ``steps``) after the forward passes.

    Raises:
        RoutingError: ``model`` has no router of a covered family.
    """
    routers = routers_of(model)
    recording = RoutingRecording([name for name, _ in routers])
    handles = []
    try:
        for layer, (name, router) in enumerate(routers):
            block = model.get_submodule(name.rpartition(".")[0])

            def before(_module: nn.Module, args: Any, kwargs: Any, layer: int = layer) -> None:
                recording._before_block(layer, args, kwargs)

            def after(_module: nn.Module, _args: Any, output: Any, layer: int = layer) -> None:
                recording._after_router(layer, output)

            handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(router.register_forward_hook(after))
        token = _RECORDING.set((*_RECORDING.get(), recording))
        try:
            yield recording
        finally:
            _RECORDING.reset(token)
    finally:
        for handle in handles:
            handle.remove()
