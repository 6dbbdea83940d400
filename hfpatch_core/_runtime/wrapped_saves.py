"""What a refused save owes the tool that wrapped it: the model back as that tool leaves it.

llm-compressor's ``save_pretrained_wrapper`` (0.14) converts the model to accelerate's
offloading (``to_accelerate``) before it calls the model's ``save_pretrained`` and back
(``from_accelerate``) after it, with no ``try`` / ``finally``: when hfpatch refuses the
save (a tensor family a pack cannot split back), the model is left with its weights
offloaded to the meta device behind accelerate's hooks, and the next ``save_pretrained``
fails inside llm-compressor (``aten::equal`` on meta tensors).  The conversion back is the
wrapper's own, called from the wrapper's own module, so that the model is what a
successful save leaves, and a retry saves.
"""

from __future__ import annotations

import sys
import types
from typing import Any

#: The module and function of llm-compressor's save wrapper, and the name of the function it
#: calls after a successful save.
_WRAPPER = ("llmcompressor.transformers.compression.compressed_tensors_utils", "save_pretrained_wrapper")
_UNDO = "from_accelerate"


def _wrapper_frame(frame: types.FrameType | None) -> types.FrameType | None:
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == _WRAPPER:
            return frame
        frame = frame.f_back
    return None


def undo_wrapper_conversion(model: Any, error: BaseException) -> None:
    """After a save of ``model`` failed with ``error``: undo what a calling llm-compressor save
    wrapper did before the save and would have undone after it (nothing without such a caller).

    A failure of the undo is added to ``error``'s notes rather than raised: the refusal is
    what the user must see.
    """
    frame = _wrapper_frame(sys._getframe(1))
    undo = frame.f_globals.get(_UNDO) if frame is not None else None
    if not callable(undo) or not any(hasattr(module, "_hf_hook") for module in model.modules()):
        return
    try:
        undo(model)
    except Exception as exc:  # the refusal stays the error raised
        error.add_note(
            f"hfpatch could not convert {type(model).__name__} back from accelerate's offloading after the refused "
            f"save ({type(exc).__name__}: {exc}); load it again before saving."
        )
