"""chunked-loss under transformers' own sharded loads, for real: one ``torchrun`` (2 ranks, gloo, CPU).

The pack refuses a load that transformers shards (tensor parallelism, FSDP2) when it is planned,
with the reason: the model loads vanilla and gives the reference's logits and generation, and
``hfpatch verify --distributed`` reports the refusal, not an application.
"""

from __future__ import annotations

from pathlib import Path

import hfpatch_pack_chunked_loss as chunked
import pytest

from hfpatch_core.testing import tiny_checkpoint
from hfpatch_core.testing.distributed import verify_distributed


def has_load(mode: str) -> bool:
    """Whether the installed transformers loads sharded by ``mode`` (5.3 has no FSDP2 load)."""
    from transformers.distributed import DistributedConfig

    field = {"fsdp": "fsdp_size"}.get(mode)
    return field is None or field in getattr(DistributedConfig, "__dataclass_fields__", {})


def test_a_sharded_load_is_refused_with_the_reason(tmp_path: Path) -> None:
    modes = [mode for mode in ("tp", "fsdp") if has_load(mode)]
    if not modes:
        pytest.skip("the installed transformers has no sharded load")
    checkpoint = tiny_checkpoint("llama", tmp_path / "llama")
    for report in verify_distributed("chunked-loss", checkpoint, modes, model_type="llama"):
        assert report.outcome == "refused", report.detail
        assert report.ok
        assert f"{chunked.TARGET}: refused by 'chunked-loss'" in report.detail
        assert f"the load is sharded by transformers ({report.mode})" in report.detail
