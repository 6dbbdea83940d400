"""Composite (image-text) MoE models: exact, or refused with the reason (issue 40: aria, kimi_k25,
inkling2, unlimited_ocr, ... failed with WeightLayoutError or a registry change in provide_patches).

The verdicts are the zoo's (``hfpatch_core.testing.zoo.verdict_of``: tiny checkpoint, load, fp32
logits, generation, save round trip, the apply path). A model type the installed transformers does
not have is not asked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from hfpatch_core.testing.zoo import verdict_of

PACK = "linear-experts"

CASES = {
    # its experts live in the composite's own modeling module: the composite's load claims them
    "aria": ("exact", "AriaExperts <- LinearAriaExperts"),
    # (Glm4vMoeTextExperts on 5.25; Glm4vMoeTextNaiveMoe on 5.3, where its tiny checkpoint builds
    # since tiny configs find mrope_section in the config's source)
    "glm4v_moe": ("exact", "Glm4vMoeText"),
    # the composite's own list stacks its deepseek_v3 text model's per-expert weights, unscoped and
    # before the text model's list: the text model's claim would not receive them
    "kimi_k25": ("refused", "DeepseekV3Experts: the composite model's conversion lists"),
    # the text model's list stacks the per-expert weights the composite's split expects 3-D
    "unlimited_ocr": ("refused", "UnlimitedOcrTextExperts: the composite model's conversion lists"),
}
PRESENT = [model_type for model_type in CASES if model_type in CONFIG_MAPPING_NAMES]


@pytest.mark.parametrize("model_type", PRESENT)
def test_a_composite_moe_model_is_never_a_failure(model_type: str, tmp_path: Path) -> None:
    row = verdict_of(PACK, model_type, tmp_path, generate_tokens=4)
    assert row.verdict != "failed", row
    if row.verdict == "refused":
        assert ": " in row.detail  # the class, then why
    if row.verdict == "exact" or model_type in NEWEST_VERDICTS_HOLD_FROM:
        verdict, detail = CASES[model_type]
        assert row.verdict == verdict and row.detail.startswith(detail), row


#: Where transformers converts each sub-model with its own scoped list (5.25's loader; what the
#: verdicts above are about), the exact verdicts: a release without it (5.3) may not claim the type
#: (not applicable) or not build its tiny checkpoint (no checkpoint), never fail.
NEWEST_VERDICTS_HOLD_FROM = {"kimi_k25", "unlimited_ocr"} if "kimi_k25" in CONFIG_MAPPING_NAMES else set()


def test_at_least_one_composite_moe_model_is_in_this_transformers() -> None:
    # the oldest supported release has aria and glm4v_moe: the parametrised test above runs there too
    assert PRESENT


UNDECLARED = [t for t in ("dbrx", "jetmoe", "llama4_text") if t in CONFIG_MAPPING_NAMES]


@pytest.mark.parametrize("model_type", UNDECLARED)
def test_experts_not_declared_through_use_experts_implementation_are_refused_with_the_reason(
    model_type: str, tmp_path: Path
) -> None:
    # issue 37.7: they were "not applicable", a blind spot of the zoo's denominator
    row = verdict_of(PACK, model_type, tmp_path, generate_tokens=4)
    assert row.verdict == "refused", row
    assert "one slice per expert" in row.detail and "does not declare it" in row.detail
