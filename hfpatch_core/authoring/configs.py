"""Which part of a model's config a pack reads its decoder's sizes from."""

from __future__ import annotations

from typing import Any

__all__ = ["text_decoder_config"]


def text_decoder_config(config: Any) -> Any:
    """The config of the text decoder of ``config``: a composite model's text sub-config, else ``config``.

    ``config.get_text_config()`` searches the encoder's names too and raises ``ValueError`` where a
    model has both (musicgen's ``text_encoder`` and ``decoder``); the layers a pack replaces
    (attention, MLPs, experts, the head) are the decoder's, so this asks for the decoder's only
    (``get_text_config(decoder=True)``, in every release hfpatch supports).  ``None`` gives ``None``.
    """
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    text = get(decoder=True)
    return config if text is None else text
