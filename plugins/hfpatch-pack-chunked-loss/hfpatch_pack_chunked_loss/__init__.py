"""hfpatch pack ``chunked-loss``: the causal-LM training loss without the tokens x vocabulary logits.

``install(model)`` finds the model's head and loss path by structure and by probing the model's
own forward (``detect``): the head must be a plain ``nn.Linear`` fed by the decoder's last hidden
state, the loss transformers' ``ForCausalLMLoss``, and what the forward does between them the
identity, a scale (cohere's ``logit_scale``, granite's ``logits_scaling``) or a soft-cap (gemma2's
``final_logit_softcapping``); the chunked loss is then compared with vanilla's own loss and
gradients on a probe.  Anything else is refused with the reason (``ChunkedLossRefused``).

Afterwards a training step (``labels`` given, ``model.train()``, autograd on) computes the loss
and its gradients chunk by chunk of tokens (``hfpatch_pack_chunked_loss.loss``), and ``.logits``
holds the last position's logits only; every other forward is vanilla's.  ``uninstall(model)``
reverts it.

Selected like any pack (``HF_PATCH_PACKS=chunked-loss``), it is a model step
(``hfpatch_core.ModelStep``, target ``causal-lm-loss``): every ``from_pretrained`` /
``from_config`` of a causal LM and ``hfpatch_core.apply`` install it on the loaded model, the plan
records it (or ``detect``'s refusal), and ``hfpatch_core.revert(model)`` uninstalls it.
"""

from __future__ import annotations

from .budget import BUDGET_ENV, DEFAULT_BUDGET, LOGIT_COPIES, budget_from_env, chunk_for
from .errors import ChunkedLossRefused
from .found import Installed, LossKind
from .install import install, installed, loss_computed_by, uninstall
from .logprobs import token_log_probs
from .loss import HeadTransform, chunked_causal_lm_loss
from .probe import detect
from .step import TARGET, install_step, provide_model_steps, provide_model_types, uninstall_step

__version__ = "0.1.0"

__all__ = [
    "BUDGET_ENV",
    "DEFAULT_BUDGET",
    "LOGIT_COPIES",
    "TARGET",
    "ChunkedLossRefused",
    "HeadTransform",
    "Installed",
    "LossKind",
    "budget_from_env",
    "chunk_for",
    "chunked_causal_lm_loss",
    "detect",
    "install",
    "install_step",
    "installed",
    "loss_computed_by",
    "provide_model_steps",
    "provide_model_types",
    "token_log_probs",
    "uninstall",
    "uninstall_step",
]
