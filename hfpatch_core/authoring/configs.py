"""Which part of a model's config a pack reads its decoder's sizes from."""

from __future__ import annotations

from typing import Any

__all__ = ["text_decoder_config"]


def text_decoder_config(config: Any) -> Any:
    """The config of the text decoder of ``config``: a composite model's text sub-config, else ``config``.

    ``config.get_text_config()``, except where it raises ``ValueError`` because the model has a
    text encoder and a decoder (musicgen's ``text_encoder`` and ``decoder``): the layers a pack
    replaces (attention, MLPs, experts, the head) are the decoder's, so then the decoder's
    (``get_text_config(decoder=True)``).  Not that for every model: on an encoder-decoder config
    without sub-configs (bart) transformers 5.3 answers ``decoder=True`` with a copy of the
    config less its encoder's fields, which is not the config the model is built from.
    ``None`` gives ``None``.
    """
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    try:
        text = get()
    except ValueError:  # "Multiple valid text configs were found"
        text = get(decoder=True)
    return config if text is None else text
