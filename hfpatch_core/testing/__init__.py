"""Proving that a pack keeps a model correct: tiny checkpoints and one assertion.

``tiny_checkpoint(model_type)`` builds a small random checkpoint with
``save_pretrained`` (safetensors), deterministic from a seed.
``assert_pack_equivalent(pack, checkpoint_or_model_type)`` loads it with and without the
pack and checks, reporting every failure at once, that

* the expected classes were replaced, and nothing else;
* no weight is missing or unexpected;
* logits match (fp32 ``atol=1e-5``; bf16: ``BF16_ATOL`` or ``BF16_CALIBRATION`` times
  vanilla's own bf16 rounding, measured in the run) on a padded batch, top-k decisions
  (MoE routing) held equal on both sides (``HeldRouting``);
* greedy generation of ``generate_tokens`` tokens matches;
* ``save_pretrained`` restores the source layout, and a vanilla reload matches;
* with ``train_steps=N``: N AdamW steps give the same losses, gradients and parameters
  (``check_training_equivalence``, docs/training.md).

A pack that changes outputs on purpose passes ``expect="different"`` (or a larger
``atol``) and keeps the structural and round-trip checks.  When outputs differ, the
message names the first decoder layer and module whose output diverges.

For a pack's own tests: ``load_model`` (a load with the pack enabled, or a vanilla one),
``padded_batch`` and ``logits_of`` (a left-padded batch and its logits),
``safetensors_of`` (the tensors a checkpoint directory holds), ``install_pack`` (a rival
pack from source) and ``discover_from_wheel`` (the pack as ``pip install`` gives it).

The same checks back ``hfpatch verify``; the pytest fixtures live in
``hfpatch_core.pytest_plugin``.

The helpers live in one module per job, and every name is importable from here:
``configs`` (``tiny_config``, ``TINY_DECODER``; its shrinking rules in ``sizes`` (``SHRINK``),
``attention_sizes`` and ``layer_kinds``), ``checkpoints`` (``tiny_checkpoint``,
``check_tiny_checkpoint``; the names of ``configs`` are importable from it too), ``installs``
(``install_pack``, ``install_wheel``, ``discover_from_wheel``), ``models`` (``load_model``,
``padded_batch``, ``logits_of``, ``safetensors_of``, ``reloaded_in_a_fresh_process``), ``equivalence``
(``check_pack_equivalence``, ``assert_pack_equivalent``, ``Report``), ``training``
(``check_training_equivalence``, ``TrainingReport``, ``TrainingTolerances``,
``training_batches``, ``adapter_steps``), ``routing`` (``HeldRouting``) and ``trainer`` (``trainer_losses``,
``TrainerBatches``: short ``transformers.Trainer`` runs for checkpoint and resume tests).
"""

from __future__ import annotations

from .checkpoints import TINY_PARAMETERS, check_tiny_checkpoint, tiny_checkpoint
from .configs import TINY_DECODER, TinyCheckpointError, tiny_config
from .equivalence import (
    BF16_ATOL,
    BF16_CALIBRATION,
    EquivalenceError,
    Report,
    assert_pack_equivalent,
    check_pack_equivalence,
)
from .installs import DiscoveredWheel, discover_from_wheel, install_pack, install_wheel
from .models import (
    load_model,
    logits_of,
    padded_batch,
    reloaded_in_a_fresh_process,
    safetensors_of,
    text_config_of,
    text_token_ids,
)
from .routing import HeldRouting
from .sizes import SHRINK
from .trainer import TrainerBatches, trainer_losses
from .training import (
    BF16_TOLERANCES,
    FP32_TOLERANCES,
    TrainingReport,
    TrainingTolerances,
    adapter_steps,
    check_training_equivalence,
    training_batches,
)

__all__ = [
    "BF16_ATOL",
    "BF16_CALIBRATION",
    "BF16_TOLERANCES",
    "FP32_TOLERANCES",
    "SHRINK",
    "TINY_DECODER",
    "TINY_PARAMETERS",
    "DiscoveredWheel",
    "EquivalenceError",
    "HeldRouting",
    "Report",
    "TinyCheckpointError",
    "TrainerBatches",
    "TrainingReport",
    "TrainingTolerances",
    "adapter_steps",
    "assert_pack_equivalent",
    "check_pack_equivalence",
    "check_tiny_checkpoint",
    "check_training_equivalence",
    "discover_from_wheel",
    "install_pack",
    "install_wheel",
    "load_model",
    "logits_of",
    "padded_batch",
    "reloaded_in_a_fresh_process",
    "safetensors_of",
    "text_config_of",
    "text_token_ids",
    "tiny_checkpoint",
    "tiny_config",
    "trainer_losses",
    "training_batches",
]
