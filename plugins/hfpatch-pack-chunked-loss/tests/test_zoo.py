"""The zoo's verdict (``hfpatch verify``, ``make zoo``) of the pack: a model step, checked by a training
step against vanilla's loss and gradients, on tiny checkpoints of several model types."""

from __future__ import annotations

from pathlib import Path

import hfpatch_pack_chunked_loss as chunked
import pytest
import torch

from hfpatch_core.testing.zoo import verdict_of


# llama4_text: its decoder is found by structure (get_decoder() is the model itself there)
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe", "llama4_text"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_exact_on_a_tiny_checkpoint(model_type: str, dtype: torch.dtype | None, tmp_path: Path) -> None:
    row = verdict_of("chunked-loss", model_type, tmp_path, generate_tokens=2, dtype=dtype)
    assert row.verdict == "exact", row.detail
    assert row.detail == f"model step {chunked.TARGET} [chunked-loss]"
    assert row.report.replaced == {} and row.report.apply_path is True
    assert row.report.step_loss_diff is not None and row.report.step_grad_diff is not None


def test_a_refusal_at_install_is_the_verdict_with_its_reason(tmp_path: Path) -> None:
    # big_bird's block-sparse attention swaps itself for full attention on the probe's short input
    row = verdict_of("chunked-loss", "big_bird", tmp_path, generate_tokens=0)
    assert row.verdict == "refused", row.detail
    assert row.detail.startswith(
        f"{chunked.TARGET}: the model's forward replaced its own modules on the probe's 4 tokens ("
    ), row.detail
    assert row.detail.endswith("the chunked loss cannot probe it without changing it"), row.detail


def test_a_model_whose_forward_the_probe_cannot_run_is_refused_with_the_error(tmp_path: Path) -> None:
    # git's forward raises on the probe's text-only loss: the model is left as it loaded, and that is a
    # refusal with the error, not a pack failure that fails the load in strict mode
    row = verdict_of("chunked-loss", "git", tmp_path, generate_tokens=0)
    assert row.verdict == "refused", row.detail
    assert row.detail.startswith(f"{chunked.TARGET}: probing the model's forward raised ValueError")


def test_a_checkpoint_vanilla_does_not_save_in_its_layout_is_no_pack_failure(tmp_path: Path) -> None:
    # bert-generation on transformers 5.3 saves LayerNorm's gamma/beta back as weight/bias: the
    # round-trip check fails for vanilla as for the pack, which changes no weight (5.25 saves it as read)
    row = verdict_of("chunked-loss", "bert-generation", tmp_path, generate_tokens=0)
    assert row.verdict in ("exact", "no checkpoint"), row.detail
    if row.verdict == "no checkpoint":
        assert row.detail.startswith("vanilla transformers does not save it in its source layout"), row.detail
