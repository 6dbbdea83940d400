"""What one equivalence run measures (``Report``) and what its checks share (``Comparison``).

Kept apart from ``equivalence``, which runs the checks, so that ``applying`` (the apply-path
check) can take a typed ``Comparison`` without importing the module that imports it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import torch

from .training import TrainingReport

__all__ = ["Comparison", "Report"]


@dataclasses.dataclass
class Report:
    """What ``check_pack_equivalence`` measured, and every failure it found."""

    pack: str
    model_type: str
    replaced: dict[str, str] = dataclasses.field(default_factory=dict)
    max_abs_diff: float | None = None
    generation_match: bool | None = None
    round_trip: bool | None = None
    apply_path: bool | None = None
    #: the logits tolerance applied (in bf16 by default the calibrated one, see ``BF16_ATOL``)
    atol: float | None = None
    #: how many top-k decisions (MoE routes) of the patched model differed from vanilla's by a
    #: tie and were held to vanilla's in the logits comparison
    forced_routes: int | None = None
    #: the model steps installed on the loaded model (``target [pack]``), checked by a training step
    steps: list[str] = dataclasses.field(default_factory=list)
    #: the training step's loss difference from vanilla's, relative, and its largest gradient difference
    step_loss_diff: float | None = None
    step_grad_diff: float | None = None
    #: one report per gradient checkpointing setting, with ``train_steps``
    training: list[TrainingReport] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    plan: Any = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "plan"}
        fields["training"] = [training.to_json() for training in self.training]
        fingerprint = self.plan.fingerprint if self.plan is not None else None
        return {**fields, "fingerprint": fingerprint, "ok": self.ok}


@dataclasses.dataclass
class Comparison:
    """What the checks of one ``check_pack_equivalence`` run share: both models, the batch, the settings."""

    report: Report
    source: Path
    dtype: torch.dtype
    tolerance: float
    expect: Literal["same", "different"]
    vanilla: Any
    patched: Any
    ids: torch.Tensor
    mask: torch.Tensor
    #: the vanilla model's logits on ``ids`` and ``mask``
    reference: torch.Tensor
    #: raise ``tolerance`` to ``BF16_CALIBRATION`` times bf16's own difference (no ``atol`` given)
    calibrate: bool = False

    def fail(self, message: str) -> None:
        self.report.failures.append(message)
