"""What the commands ask packs with, and where they keep the answers: the tiny config of a model
type (``probe_config``), the on-disk cache of packs' answers (``answers_cache``) and the
hook guard every hook is called under.  ``check``, ``verify``, ``list`` and ``lock`` pass these
to the pipeline's ``checking``, ``conflicts`` and ``probing``, which compute; the commands show."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from .cache import Cache, core_key

if TYPE_CHECKING:
    from .._pipeline.gathering import HookGuard


@functools.cache
def probe_config(model_type: str) -> Any:
    """The config check and verify call a pack's hooks with: the model type's tiny config (built
    once per process), else its default config, else ``None``."""
    from transformers.utils import logging as hf_logging

    from .._pipeline.model_types import default_config
    from ..testing import tiny_config

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.CRITICAL)  # some default configs log errors while they are shrunk
    try:
        return tiny_config(model_type)
    except Exception:  # a config that cannot be shrunk (or built) is asked as it is
        return default_config(model_type)
    finally:
        hf_logging.set_verbosity(verbosity)


def answers_cache() -> Cache:
    """Where what one pack's hooks answer is kept: named by the installed transformers and
    hfpatch-core (``cache.core_key``), the pack's version and source hash in each entry's name."""
    return Cache("pack-answers", core_key())


def hook_guard() -> HookGuard:
    """What the packs' hooks are called under, as for a load (``snapshot.HOOK_GUARD``)."""
    from .._runtime.snapshot import HOOK_GUARD

    return HOOK_GUARD
