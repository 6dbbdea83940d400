"""Experts as one ``nn.Linear`` per expert and projection, built from any experts class that
declares itself through transformers' ``use_experts_implementation``.

transformers 5 stores routed experts as 3-D parameters (``gate_up_proj`` / ``up_proj`` and
``down_proj``, optionally transposed, interleaved and with biases) and dispatches their
forward through ``use_experts_implementation``.  ``linear_experts_class(original, layout)``
derives, from such a class, a drop-in whose experts are ``nn.Linear`` children named as the
per-expert checkpoints name them (``experts.<e>.gate_proj`` or mixtral's ``experts.<e>.w1``),
and whose forward is the decorator's eager loop over those modules.  Where the checkpoint
itself stores gate and up interleaved in one 3-D tensor (gpt_oss), each expert keeps them
in one ``gate_up_proj`` linear, as stored: no GEMM reads every other column in place, so
split halves would be copies of the whole checkpoint's gate/up at load.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn
from transformers.integrations import moe

from hfpatch_core.authoring import runtime_class
from hfpatch_core.authoring.calibration import calibrating_all_experts, observed, report_unrouted

#: The pack's name, as its warnings name it.
PACK = "linear-experts"

__all__ = [
    "DEFAULT_NAMES",
    "ExpertLinears",
    "Layout",
    "LinearExperts",
    "linear_experts_class",
]

#: The per-expert names used when transformers' conversion mapping for the model type has
#: no converter stacking per-expert tensors into this class's 3-D parameters (its
#: checkpoints store the experts 3-D): the names of transformers' own gated MLPs, and of
#: most per-expert MoE checkpoints.
DEFAULT_NAMES: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one experts class stores its experts, and what its per-expert modules are called.

    Attributes:
        has_gate: a gated expert (``gate_up_proj``), else ``act(up(x))`` (``up_proj``).
        has_bias: the projections have biases (``<name>_bias`` parameters).
        is_transposed: the 3-D parameters are ``[E, in, out]`` rather than ``[E, out, in]``.
        is_concatenated: gate and up rows are ``[gate; up]`` rather than interleaved.
        has_post_expert_norm: a ``post_expert_norm`` module runs on each expert's output.
        custom_gate: the class defines its own ``_apply_gate`` (run on the gate/up output
            reassembled in the class's own row order).
        accumulate_fp32: the eager loop sums the experts' outputs in float32.
        names: the per-expert module names of gate (``None`` without a gate, or when joined),
            up (the joined gate/up when joined) and down.
        joined: gate and up are one per-expert linear (``names[1]``, ``gate_up_proj``) whose
            output rows are gate and up in the class's own order, for the class's gating.
    """

    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool
    has_post_expert_norm: bool
    custom_gate: bool
    accumulate_fp32: bool
    names: tuple[str | None, str, str]
    joined: bool = False

    def __post_init__(self) -> None:
        if self.joined and (not self.has_gate or self.names[0] is not None):
            raise ValueError(
                f"Layout(joined=True) holds gate and up in one linear named names[1]: it needs has_gate=True "
                f"and names[0] None, got has_gate={self.has_gate}, names={self.names}"
            )

    @property
    def parameters(self) -> tuple[str, ...]:
        """The 3-D parameters of the original class that the per-expert modules hold instead."""
        first = "gate_up_proj" if self.has_gate else "up_proj"
        names = (first, "down_proj")
        return names + tuple(f"{name}_bias" for name in names) if self.has_bias else names


class ExpertLinears(nn.Module):
    """One expert: ``nn.Linear`` children under the checkpoint's names (``gate_proj``, ``w1``, ...).

    It has no forward of its own: ``LinearExperts`` runs its linears, with the family's
    gating between them.
    """

    def __init__(
        self, names: tuple[str | None, str, str], hidden: int, intermediate: int, bias: bool, joined: bool = False
    ) -> None:
        super().__init__()
        gate, up, down = names
        self.names = names
        if gate is not None:
            self.add_module(gate, nn.Linear(hidden, intermediate, bias=bias))
        self.add_module(up, nn.Linear(hidden, 2 * intermediate if joined else intermediate, bias=bias))
        self.add_module(down, nn.Linear(intermediate, hidden, bias=bias))

    def projections(self) -> tuple[nn.Module | None, nn.Module, nn.Module]:
        """The gate (``None`` without one, or when joined), up (or gate/up) and down modules, whatever a tool
        replaced them with."""
        gate, up, down = self.names
        return (getattr(self, gate) if gate is not None else None, getattr(self, up), getattr(self, down))


class LinearExperts(nn.Module):
    """Base of the classes ``linear_experts_class`` derives; see the module docstring.

    A derived class subclasses the original experts class too (its ``_apply_gate``, its
    attributes such as ``alpha`` / ``limit`` and its ``post_expert_norm`` are kept), with
    this class first in the method order: ``__init__`` runs the original constructor on
    the meta device (its 3-D parameters cost nothing), drops the 3-D parameters and adds
    one ``ExpertLinears`` child per expert, named ``0 .. E-1`` as in the checkpoint.
    """

    #: set on each derived class
    layout: ClassVar[Layout]
    original: ClassVar[type[nn.Module]]

    hfpatch_hidden_from_adapters = False
    #: How the per-expert linears shard in transformers' sharded loads (``sharding.plans_for``, derived
    #: from the model's own plans when the class is derived); ``None``: refused, for the reason in
    #: ``hfpatch_unsharded_reasons``.
    hfpatch_tp_plan: ClassVar[dict[str, str] | None] = None
    hfpatch_ep_plan: ClassVar[dict[str, str] | None] = None
    hfpatch_fsdp_plan: ClassVar[dict[str, str] | None] = None
    hfpatch_unsharded_reasons: ClassVar[dict[str, str]] = {}
    #: set by transformers' decorator on every instance, and by hfpatch when it cuts the experts to a rank's share
    _is_expert_parallel = False
    # transformers' hub kernels replace the forward of classes they know by name; this
    # forward must run, whatever kernel the original class's layer name maps to
    kernel_condition = staticmethod(lambda module: False)

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        device = torch.empty(0).device  # the device the model is being built on (meta while loading)
        with torch.device("meta"):
            self.original.__init__(self, config, *args, **kwargs)
        self._linearize(device)

    def _linearize(self, device: torch.device, values: dict[str, torch.Tensor] | None = None) -> None:
        """Replace the 3-D parameters by per-expert modules on ``device`` (filled from ``values`` if given)."""
        layout = self.layout
        shapes = {name: tuple(getattr(self, name).shape) for name in layout.parameters}
        dtype = getattr(self, layout.parameters[0]).dtype
        for name in layout.parameters:
            delattr(self, name)
        if device.type != "meta":
            for child in self.children():  # post_expert_norm and the like, built on meta above
                if any(tensor.is_meta for tensor in (*child.parameters(), *child.buffers())):
                    child.to_empty(device=device)
        first = shapes[layout.parameters[0]]
        experts = first[0]
        hidden = first[1] if layout.is_transposed else first[2]
        intermediate = shapes["down_proj"][1] if layout.is_transposed else shapes["down_proj"][2]
        self.num_experts = experts
        for index in range(experts):
            with torch.device(device):
                expert = ExpertLinears(layout.names, hidden, intermediate, layout.has_bias, layout.joined).to(dtype)
            if values is not None:
                _fill(expert, layout, values, index)
            self.add_module(str(index), expert)
        # transformers' _init_weights has a branch for the original class (an isinstance
        # check, which the patched name makes true here) that initialises the 3-D
        # parameters; this container has none: its nn.Linear children are initialised
        # like every other Linear.
        self._is_hf_initialized = True

    # --- a sequence of experts, as nn.ModuleList ----------------------------------------

    def experts(self) -> list[ExpertLinears]:
        """The experts this module holds, in order (``self[e]`` is the one named ``e``)."""
        return [module for module in self._modules.values() if isinstance(module, ExpertLinears)]

    def __getitem__(self, index: int) -> ExpertLinears:
        module = self._modules[str(index)]
        assert isinstance(module, ExpertLinears)
        return module

    def __len__(self) -> int:
        return len(self.experts())

    def __iter__(self) -> Iterator[ExpertLinears]:
        return iter(self.experts())

    def _experts_by_number(self) -> Mapping[str, nn.Module]:
        """The experts by the number ``forward`` is called with: the children themselves, or, once cut
        to a rank's share for expert parallelism, by local number (``"0"`` the first held), since they
        keep their global names (the checkpoint's keys) and transformers' token dispatch calls
        ``forward`` with local numbers (built once per module)."""
        if not self._is_expert_parallel:
            return self._modules  # type: ignore[return-value]
        local: dict[str, nn.Module] | None = self.__dict__.get("_local_by_number")
        if local is None:
            local = {str(number): expert for number, expert in enumerate(self.experts())}
            self.__dict__["_local_by_number"] = local
        return local

    # --- the forward ----------------------------------------------------------------------

    def _gate_joined(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gating of a joined gate/up output, whose rows are in the class's own (interleaved) order."""
        if self.layout.custom_gate:
            return self._apply_gate(gate_up)  # type: ignore[operator]
        return self.act_fn(gate_up[..., 0::2]) * gate_up[..., 1::2]  # type: ignore[operator]

    def _gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if not layout.custom_gate:
            return self.act_fn(gate) * up  # type: ignore[operator]
        if layout.is_concatenated:
            gate_up = torch.cat([gate, up], dim=-1)
        else:
            gate_up = torch.stack([gate, up], dim=-1).flatten(-2)
        return self._apply_gate(gate_up)  # type: ignore[operator]

    def _expert(self, expert: nn.Module, states: torch.Tensor) -> torch.Tensor:
        """One expert on ``states``: its modules read from ``_modules`` (whatever a quantizer put there),
        without ``nn.Module.__getattr__``'s fallback chain, which costs more than an int8 GEMV at batch 1."""
        layout = self.layout
        modules = expert._modules
        gate_name, up_name, down_name = layout.names
        if layout.joined:
            hidden = self._gate_joined(modules[up_name](states))  # type: ignore[misc]
        elif gate_name is None:
            hidden = self.act_fn(modules[up_name](states))  # type: ignore[misc, operator]
        else:
            gate = modules[gate_name](states)  # type: ignore[misc]
            up = modules[up_name](states)  # type: ignore[misc]
            hidden = self._gate(gate, up) if layout.custom_gate else self.act_fn(gate) * up  # type: ignore[operator]
        output: torch.Tensor = modules[down_name](hidden)  # type: ignore[misc]
        if layout.has_post_expert_norm:
            output = self.post_expert_norm(output)  # type: ignore[operator]
        return output

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The decorator's eager loop (``use_experts_implementation``'s reference), over ``nn.Linear`` experts.

        Every expert that has tokens runs once, in ascending order, on the rows
        ``torch.where`` lists (position-major), and its output times the routing weight is
        added to each token's sum in the same order and dtype (float32 where the family
        sums in float32).  An expert id equal to ``num_experts`` (transformers'
        expert-parallel sentinel) is skipped.  gpt_oss-style callers pass
        ``router_indices`` / ``routing_weights``, by position or by name.

        Bit for bit the reference loop's results; only the bookkeeping is cheaper (as in
        qwen-moe's ``PerExpertExperts``): one stable sort and one count per call instead
        of a one-hot mask, a ``nonzero`` and one ``torch.where`` per expert, and for a
        single token (a decode step) no gather or scatter at all: ``index_add_`` is a
        multi-threaded scatter on CPU, slow for one row, and on a busy machine each
        multi-threaded call can wait for a thread to be scheduled.

        Under a quantizer's calibration every expert sees every token, as
        ``hfpatch_core.authoring.calibration`` describes (llm-compressor's
        ``moe_calibrate_all_experts``, and an observed expert the router left idle).
        """
        index = top_k_index if top_k_index is not None else kwargs.get("router_indices")
        weights = top_k_weights if top_k_weights is not None else kwargs.get("routing_weights")
        if index is None or weights is None:
            raise TypeError(
                f"{type(self).__name__}.forward needs the routing: (hidden_states, top_k_index, top_k_weights)"
            )
        calibrating = calibrating_all_experts()
        if index.shape[0] == 1 and not calibrating:
            single = self._one_token(hidden_states, index, weights)
            if single is not None:
                return single
        return self._tokens(hidden_states, index, weights, calibrating)

    def _one_token(
        self, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor | None:
        """``forward`` for one token: its experts in ascending order, on the token itself.

        ``final.index_add_(0, [0], output)`` on one row is ``final += output``, so no
        mask, gather or scatter is needed.  Returns ``None`` (``_tokens`` then runs) when
        the router picked one expert twice for the token (the reference runs such an
        expert once, on both rows), or when a calibration observes the experts it skips.
        """
        hits = sorted((expert, position) for position, expert in enumerate(index[0].tolist()))
        picked = {expert for expert, _ in hits}
        if len(picked) < len(hits):
            return None
        modules = self._experts_by_number()
        idle = next((number for number in range(self.num_experts) if number not in picked), None)
        if idle is not None and str(idle) in modules and observed(modules[str(idle)]):
            return None  # a calibration observes the experts this token skips: _tokens runs them
        dtype = torch.float32 if self.layout.accumulate_fp32 else hidden_states.dtype
        # each position's weight as a [1, 1] column, all from one op: ``weights[:, position, None]``
        # is three view ops per expert
        columns = weights.unsqueeze(-1).unbind(1)
        final: torch.Tensor | None = None
        for expert, position in hits:
            if expert == self.num_experts:
                continue
            output = (self._expert(modules[str(expert)], hidden_states) * columns[position]).to(dtype)
            # the reference adds into zeros; adding 0.0 in place gives its bits (-0.0 becomes +0.0)
            # without a zeros tensor per call (``output`` is new here, and add keeps nothing for backward)
            final = output.add_(0.0) if final is None else final.add_(output)
        if final is None:  # every pick was the expert-parallel sentinel
            return torch.zeros_like(hidden_states)
        return final.to(hidden_states.dtype)

    def _tokens(
        self, hidden_states: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, calibrating: bool = False
    ) -> torch.Tensor:
        """``forward`` for any number of tokens: each expert's rows from one stable sort of the routing.

        ``calibrating``: every expert runs on every row, its routed rows kept (``forward`` says why).
        """
        tokens = index.shape[0]
        dtype = torch.float32 if self.layout.accumulate_fp32 else hidden_states.dtype
        final = torch.zeros_like(hidden_states, dtype=dtype)
        with torch.no_grad():
            # flattened position-major (position * tokens + token): a stable sort by expert then lists
            # each expert's (position, token) pairs in the order torch.where(mask[expert]) does
            flat = index.t().reshape(-1)
            counts: list[int] = torch.bincount(flat, minlength=self.num_experts + 1).tolist()
            order = torch.argsort(flat, stable=True)
            token_order = order % tokens
        sorted_weights = weights.t().reshape(-1)[order]
        modules = self._experts_by_number()
        # whether the first expert routed no token is observed decides, for this forward, whether
        # the others are asked (one check per forward outside calibration, not one per expert)
        watched: bool | None = None
        unseen: list[int] = []
        end = 0
        for expert, count in enumerate(counts[: self.num_experts]):
            module = modules.get(str(expert))
            if module is None:  # not held here (the routing's count is larger; a probe holds a few)
                continue
            if count == 0:
                if calibrating:
                    self._expert(module, hidden_states)  # observed on every token; routed nothing
                elif watched is not False and observed(module):
                    watched = True
                    self._expert(module, hidden_states)
                    unseen.append(expert)
                elif watched is None:
                    watched = False
                continue
            start, end = end, end + count
            token_index = token_order[start:end]
            if calibrating:  # one call on every token, its routed rows kept: llm-compressor's own experts
                output = self._expert(module, hidden_states)[token_index]
            else:
                output = self._expert(module, hidden_states[token_index])
            output = output * sorted_weights[start:end, None]
            final.index_add_(0, token_index, output.to(dtype))
        if unseen:
            report_unrouted(self, unseen, tokens, pack=PACK)
        return final.to(hidden_states.dtype)


def _fill(expert: ExpertLinears, layout: Layout, values: dict[str, torch.Tensor], index: int) -> None:
    """Copy expert ``index``'s rows of the original 3-D ``values`` into ``expert``'s linears."""
    gate: Any
    up: Any
    down: Any
    gate, up, down = expert.projections()

    def weight(name: str) -> torch.Tensor:
        tensor = values[name][index]
        return tensor.t() if layout.is_transposed else tensor  # [out, in]

    def halves(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layout.is_concatenated:
            first, second = tensor.chunk(2, dim=0)
            return first, second
        return tensor[0::2], tensor[1::2]

    with torch.no_grad():
        if layout.joined:
            up.weight.copy_(weight("gate_up_proj"))
            if layout.has_bias:
                up.bias.copy_(values["gate_up_proj_bias"][index])
        elif layout.has_gate:
            gate_weight, up_weight = halves(weight("gate_up_proj"))
            assert gate is not None
            gate.weight.copy_(gate_weight)
            up.weight.copy_(up_weight)
            if layout.has_bias:
                gate_bias, up_bias = halves(values["gate_up_proj_bias"][index])
                gate.bias.copy_(gate_bias)
                up.bias.copy_(up_bias)
        else:
            up.weight.copy_(weight("up_proj"))
            if layout.has_bias:
                up.bias.copy_(values["up_proj_bias"][index])
        down.weight.copy_(weight("down_proj"))
        if layout.has_bias:
            down.bias.copy_(values["down_proj_bias"][index])


_classes: dict[tuple[type, Layout, str], type[LinearExperts]] = {}
_classes_lock = threading.Lock()


def linear_experts_class(
    original: type[nn.Module], layout: Layout, plans: Mapping[str, Any] | None = None
) -> type[LinearExperts]:
    """The per-expert drop-in for ``original`` with ``layout`` (one class per triple, cached).

    Named ``Linear<Original>`` and defined in this module, so that the plan and
    ``hfpatch explain`` say which class it stands for.  ``plans``: class attributes
    declaring how it shards (``sharding.Plans.attributes``); without them, it is refused
    in every sharded load.
    """
    attributes = dict(plans or {})
    key = (original, layout, repr(sorted(attributes.items())))
    with _classes_lock:
        known = _classes.get(key)
        if known is None:
            # built at runtime, so it pickles as this call (torch.save of a whole model, a worker's copy)
            known = runtime_class(
                f"Linear{original.__name__}",
                (LinearExperts, original),
                {"layout": layout, "original": original, **attributes},
                module=__name__,
                rebuild=linear_experts_class,
                arguments=(original, layout, plans),
            )
            _classes[key] = known
        return known


def is_declared_experts(cls: type) -> bool:
    """Whether ``cls`` declares itself through ``use_experts_implementation`` (its forward is the decorator's)."""
    forward = getattr(cls, "forward", None)
    return getattr(forward, "__code__", None) is _DECORATED_FORWARD


def decorator_metadata(cls: type) -> dict[str, Any]:
    """The keyword arguments ``use_experts_implementation`` was given for ``cls`` (read from its wrapper's
    closure), with the decorator's defaults for those the installed release does not have.

    Where the decorator has no ``is_concatenated`` (5.3), a class with its own ``_apply_gate`` reads
    the gate/up rows in an order only that method knows (5.3's gpt_oss interleaves them),
    so it is reported as not concatenated: the rows stay joined, in the class's order.
    """
    import inspect

    found = inspect.getclosurevars(vars(cls)["__init__"]).nonlocals
    defaults = {
        "has_gate": True,
        "has_bias": False,
        "is_transposed": False,
        "is_concatenated": getattr(cls, "_apply_gate", None) is moe._default_apply_gate,
        "has_post_expert_norm": False,
    }
    return {name: bool(found.get(name, default)) for name, default in defaults.items()}


def eager_forward(cls: type) -> Any:
    """The class's own forward, which the decorator wraps: transformers' eager experts loop for it."""
    import inspect

    return inspect.getclosurevars(vars(cls)["forward"]).nonlocals["original_forward"]


def _decorated_forward_code() -> Any:
    class _Probe(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states

    decorated = moe.use_experts_implementation(_Probe)
    return decorated.forward.__code__


#: the code object of the forward ``use_experts_implementation`` installs (shared by every class it decorates)
_DECORATED_FORWARD = _decorated_forward_code()
