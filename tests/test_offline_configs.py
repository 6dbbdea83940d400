"""Building a model type's config for a probe never reaches the Hub.

A few default configs fetch a sub-model's config from the Hub while they are built (edgetam's
backbone on transformers 5.3).  Online, without a network, each waited through huggingface_hub's
retries (~46 s): `hfpatch check` of a pack that decides from the config spent 92 of its 98 s
there on 5.3.  ``config_for_model`` builds with the Hub offline: such a config fails at once.
"""

from __future__ import annotations

import contextlib

import huggingface_hub.constants
import huggingface_hub.file_download
import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from hfpatch_core._pipeline.model_types import config_for_model, default_config
from hfpatch_core.testing import TinyCheckpointError, tiny_config


def test_no_default_or_tiny_config_asks_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def metadata(url: str, *args: object, **kwargs: object) -> None:
        asked.append(url)
        raise OSError("no network in this test")

    # what hf_hub_download calls first when it may go online (it does not when offline)
    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", metadata)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    built = 0
    for model_type in CONFIG_MAPPING_NAMES:
        built += default_config(model_type) is not None
        with contextlib.suppress(TinyCheckpointError):
            tiny_config(model_type)
    assert asked == []
    assert built > 0.9 * len(CONFIG_MAPPING_NAMES)  # the configs were built, not all refused
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False  # put back


def test_the_hub_is_back_online_after_a_config_that_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError):
        config_for_model("no-such-model-type")
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False
