"""Experts as one ``nn.Linear`` triple per expert, instead of two 3-D parameters.

transformers 5 stores the routed experts of ``Qwen2MoeExperts`` / ``Qwen3MoeExperts`` as
two fused parameters (``gate_up_proj``: ``[E, 2 * I, H]``, ``down_proj``: ``[E, H, I]``)
and fuses the per-expert checkpoint tensors into them while loading.  Tools that work
module by module (quantizers and LoRA/PEFT adapters that replace ``nn.Linear``, hooks
that observe ``nn.Linear`` inputs for calibration) never see those experts.
``PerExpertExperts`` keeps the checkpoint's own per-expert layout
(``mlp.experts.<e>.{gate,up,down}_proj.weight``) as real ``nn.Linear`` modules, so the
checkpoint loads into it without renaming and every expert is reachable.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn
from transformers.activations import ACT2FN

from hfpatch_core.authoring.calibration import calibrating_all_experts, observed, report_unrouted

#: The pack's name, as its warnings name it.
PACK = "qwen-moe"


class ExpertMLP(nn.Module):
    """One routed expert: the gated MLP ``down(act(gate(x)) * up(x))``, without bias.

    The pack's own class rather than the family's ``Qwen2MoeMLP``: another pack may
    replace that class (a fused MLP, say), and the experts must keep the checkpoint's
    ``gate_proj`` / ``up_proj`` / ``down_proj`` names whatever else is patched.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))
        return output


class PerExpertExperts(nn.ModuleList):
    """Drop-in for ``Qwen2MoeExperts`` / ``Qwen3MoeExperts``, one ``ExpertMLP`` per expert.

    It *is* the ``nn.ModuleList`` (rather than holding one under another name) so that
    its children are called ``0 .. num_experts - 1``, exactly the checkpoint's
    ``mlp.experts.<e>.*`` keys: loading needs no renaming, only the removal of
    transformers' built-in fusion of those keys, and saving writes them back unchanged.

    Same constructor (``config``) and forward contract as the class it replaces.

    PEFT: transformers holds these experts as 3-D parameters, which a LoRA
    ``target_modules`` list (``["gate_proj", "up_proj"]``, ``"all-linear"``) either does
    not reach or, where PEFT rewrites the list for transformers 5 (qwen3_moe), reaches
    as ``target_parameters``; ``hfpatch_hidden_from_adapters`` keeps such lists off these
    experts in the first case and makes the second an ``AdapterError``, so that an
    adapter never means something else here than on an unpatched model.

    Under tensor parallelism the experts shard as the model's plan shards the 3-D experts:
    whole on every rank where it keeps them whole (qwen2_moe, and qwen3_moe on 5.25), each
    expert's linears cut like its gate/up and down where it cuts them (``hfpatch_tp_plan``).
    Under FSDP2 each expert's linears shard with their layer, as the model's
    plan wraps it; the checkpoint's per-expert tensors load into them unconverted.  Under
    expert parallelism (``DistributedConfig(ep_size=n)``) each rank keeps its share of the
    experts, as transformers shards the 3-D experts: hfpatch cuts the list to them before
    any weight is read (``hfpatch_ep_plan``'s ``local_experts``), keeping each expert's
    global number as its name, and transformers' token dispatch calls ``forward`` with
    local expert numbers.
    """

    hfpatch_hidden_from_adapters = True
    #: Where the model's tensor-parallel plan shards the 3-D experts (5.3's qwen3_moe:
    #: ``packed_colwise`` gate/up, ``rowwise`` down, and ``moe_tp_experts`` summing the ranks'
    #: partial outputs), each expert's linears shard the same way, by weight (a rule on the
    #: weight shards it without the per-module all-reduce, which ``moe_tp_experts`` does
    #: once for the whole module).  Where it does not (qwen2_moe, 5.25), nothing is added
    #: and the experts stay whole on every rank, as the model keeps its own.
    hfpatch_tp_plan: ClassVar[dict[str, str]] = {
        "*.gate_proj.weight": "colwise",
        "*.up_proj.weight": "colwise",
        "*.down_proj.weight": "rowwise",
    }
    hfpatch_fsdp_plan: ClassVar[dict[str, str]] = {}
    hfpatch_ep_plan: ClassVar[dict[str, str]] = {"*": "local_experts"}

    def __init__(self, config: Any) -> None:
        super().__init__(
            ExpertMLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act)
            for _ in range(config.num_experts)
        )
        self.num_experts = int(config.num_experts)
        self.hidden_dim = int(config.hidden_size)
        self.intermediate_dim = int(config.moe_intermediate_size)
        # While a load is patched, the family module's name ``Qwen2MoeExperts`` is this
        # class, so ``Qwen2MoePreTrainedModel._init_weights``'s
        # ``isinstance(module, Qwen2MoeExperts)`` branch would initialise
        # ``module.gate_up_proj`` (``from_config`` initialises while patched).  This
        # container has no tensors of its own (its experts' ``nn.Linear`` children are
        # initialised one by one like every other Linear), so it tells transformers'
        # initialisation to skip it.
        self._is_hf_initialized = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Route each token to its top-k experts and sum their weighted outputs.

        Args:
            hidden_states: ``[tokens, hidden]``.
            top_k_index: ``[tokens, top_k]`` expert ids: the position of the expert among
                the ones this module holds (all of them, or under expert parallelism this
                rank's, whose ids transformers makes local).  An id equal to
                ``num_experts`` means "not on this rank" (transformers' expert-parallel
                sentinel) and is skipped, as the original does.
            top_k_weights: ``[tokens, top_k]`` routing weights.

        Gives the original eager loop's results bit for bit: every expert that has tokens
        runs once, in ascending expert order, on the same rows in the same order as the
        original's ``torch.where(expert_mask[expert])`` (position-major, then token), and
        its weighted output is added to each token's sum in the same order and dtype.
        Only the bookkeeping is cheaper: one stable sort and one count per call instead of
        a one-hot mask and one ``torch.where`` per expert, and for a single token (a decode
        step) no gather or scatter at all (``index_add_`` is a multi-threaded scatter on
        CPU, slow for one row).

        A calibrating quantizer sees every expert on every token
        (``hfpatch_core.authoring.calibration``: llm-compressor's ``moe_calibrate_all_experts``,
        and an observed expert the router left idle, named in a ``PackWarning``).
        """
        calibrating = calibrating_all_experts()
        if top_k_index.shape[0] == 1 and not calibrating:
            single = self._one_token(hidden_states, top_k_index, top_k_weights)
            if single is not None:
                return single
        tokens = top_k_index.shape[0]
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # Flattened position-major (index = position * tokens + token): a stable sort by
            # expert then lists each expert's (position, token) pairs in torch.where's order.
            flat = top_k_index.t().reshape(-1)
            counts: list[int] = torch.bincount(flat, minlength=self.num_experts + 1).tolist()
            order = torch.argsort(flat, stable=True)
            token_order = order % tokens
        weights = top_k_weights.t().reshape(-1)[order]

        experts = self._held()
        # whether the first expert routed no token is observed decides, for this forward, whether
        # the others are asked (one check per forward outside calibration, not one per expert)
        watched: bool | None = None
        unseen: list[int] = []
        end = 0
        for expert_idx, count in enumerate(counts[: min(self.num_experts, len(experts))]):
            expert = experts[expert_idx]
            if count == 0:
                if calibrating:
                    expert(hidden_states)  # observed on every token; routed nothing
                elif watched is not False and observed(expert):
                    watched = True
                    expert(hidden_states)
                    unseen.append(expert_idx)
                elif watched is None:
                    watched = False
                continue
            start, end = end, end + count
            token_idx = token_order[start:end]
            if calibrating:  # one call on every token, its routed rows kept: llm-compressor's own experts
                current_hidden_states = expert(hidden_states)[token_idx]
            else:
                current_hidden_states = expert(hidden_states[token_idx])
            current_hidden_states = current_hidden_states * weights[start:end, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        if unseen:
            report_unrouted(self, unseen, tokens, pack=PACK)
        return final_hidden_states

    def _held(self) -> list[nn.Module]:
        """The experts this module holds, by local id: all of them, or this rank's share once
        cut for expert parallelism (named ``2``, ``3`` on the second of 2 ranks of 4 experts,
        which ``self[0]`` would not find)."""
        return list(self._modules.values())

    def _one_token(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor | None:
        """``forward`` for one token (a decode step): its experts in ascending order, on the token itself.

        ``final.index_add_(0, [0], output)`` on one row is ``final += output``, so no
        gather, mask or scatter is needed.  Returns ``None`` (the general path then runs)
        when the router picked one expert twice for the token (the original runs such an
        expert once, on both rows), or when a calibration observes the experts it skips.
        """
        hits = sorted((expert_idx, position) for position, expert_idx in enumerate(top_k_index[0].tolist()))
        picked = {expert_idx for expert_idx, _ in hits}
        if len(picked) < len(hits):
            return None
        experts = self._held()
        idle = next((expert_idx for expert_idx in range(len(experts)) if expert_idx not in picked), None)
        if idle is not None and observed(experts[idle]):
            return None  # a calibration observes the experts this token skips: the general path runs them
        final_hidden_states = torch.zeros_like(hidden_states)
        for expert_idx, position in hits:
            if expert_idx == self.num_experts:
                continue
            expert = experts[expert_idx]
            current_hidden_states = expert(hidden_states) * top_k_weights[:, position, None]
            final_hidden_states += current_hidden_states.to(final_hidden_states.dtype)
        return final_hidden_states
