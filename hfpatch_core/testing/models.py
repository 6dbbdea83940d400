"""Loading a model with or without packs, and the inputs, logits and tensors tests compare.

``load_model`` (a load with the pack enabled, or a vanilla one), ``padded_batch`` and
``logits_of`` (a left-padded batch and its logits), ``safetensors_of`` (the tensors a
checkpoint directory holds).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def _enabled(packs: str, strict: bool = True) -> contextlib.AbstractContextManager[Any]:
    """hfpatch enabled for ``packs`` inside the block, for this thread or task only."""
    from .._session.loaders import enabled

    return enabled(packs, strict=strict)


def load_model(
    path: str | Path, packs: str | None = None, *, strict: bool = True, model_class: Any = None, **kwargs: Any
) -> Any:
    """``from_pretrained`` as a user would call it, with hfpatch enabled for ``packs`` or not at all.

    hfpatch is enabled only for the load, and for this thread or task only (an
    ``hfpatch_core.enabled()`` block): afterwards it is as before the call (disabled, in a
    test that starts disabled), also when the load raises, and loads in other threads
    never see ``packs``.  With ``packs=None`` the
    model is vanilla transformers, also where hfpatch is enabled (``hfpatch run -- pytest``).

    Args:
        path: the checkpoint directory (or hub id).
        packs: which packs to enable, in ``HF_PATCH_PACKS`` syntax (``"my-pack"``,
            ``"qwen-moe,fused-dense@+2"``); ``None`` for a vanilla load.
        strict: make every pack failure an error (not a ``PackWarning``).
        model_class: the class whose ``from_pretrained`` loads (default
            ``causal_lm_loader(path)``: ``AutoModelForCausalLM``, or the class the
            checkpoint names where that has no class for its config).
        kwargs: passed on to ``from_pretrained`` (``dtype=``, ``attn_implementation=``, ...).

    Returns:
        The model, in eval mode (with ``output_loading_info=True``, ``(model, info)``).

    Raises:
        SelectionError: ``packs`` is malformed or names a pack that is not installed.
        PackError: strict mode, and a selected pack failed.
        Exception: whatever ``from_pretrained`` raises.
    """
    from .._scope import vanilla

    if model_class is None:
        model_class = causal_lm_loader(path)
    with _enabled(packs, strict) if packs is not None else vanilla():
        result = model_class.from_pretrained(path, **kwargs)
    # output_loading_info=True gives (model, info)
    (result[0] if isinstance(result, tuple) else result).eval()
    return result


def causal_lm_loader(path: str | Path) -> Any:
    """The class that loads the causal LM of ``path``: ``AutoModelForCausalLM``, or, for a checkpoint
    whose config it maps to no class, the class its ``config.json`` names in ``architectures``.

    A text-only causal LM of a composite model type (``MllamaForCausalLM`` saved with its
    ``MllamaTextConfig``, a musicgen decoder) is such a checkpoint: ``AutoModelForCausalLM``
    refuses its config, and a user loads it with its own class.
    """
    import json

    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_file = Path(path) / "config.json"
    if not config_file.is_file():  # a hub id, or no checkpoint: from_pretrained says what is wrong
        return AutoModelForCausalLM
    saved = json.loads(config_file.read_text())
    if saved.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    for name in saved.get("architectures") or ():
        named = getattr(transformers, name, None)
        if isinstance(named, type) and hasattr(named, "from_pretrained"):
            return named
    return AutoModelForCausalLM


def text_config_of(config: Any) -> Any:
    """The config of the text model of ``config``: itself, or a composite model's text sub-config.

    A composite model (an image-text model such as ``got_ocr2``, whose causal LM wraps a
    text sub-model) keeps ``vocab_size``, the token ids and the layer sizes in its text
    config (``config.get_text_config()``); its outer config has none of them.
    """
    get = getattr(config, "get_text_config", None)
    text = get() if callable(get) else None
    return text if text is not None else config


#: Token ids of a text config that a prompt may hold (the others of a composite config stand for an image, ...).
_TEXT_TOKENS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id"})


def text_token_ids(config: Any, start: int = 3) -> torch.Tensor:
    """The token ids from ``start`` to the text vocabulary's end that a text-only prompt may hold.

    For a composite config, those its outer config names for another modality
    (``image_token_id``, ``video_token_index``, ...) are left out: a prompt holding one makes
    the model's forward ask for pixels.  For a text-only config, every id from ``start``.

    Returns:
        An ``int64`` tensor of the ids, ascending.
    """
    text = text_config_of(config)
    vocab = int(text.vocab_size)
    special: set[int] = set()
    if text is not config:
        for name, value in config.to_dict().items():
            if (
                name.endswith(("_token_id", "_token_index", "_token_ids"))
                and name not in _TEXT_TOKENS
                and isinstance(value, int)
                and not isinstance(value, bool)
            ):
                special.add(value)
    return torch.tensor([token for token in range(start, vocab) if token not in special], dtype=torch.int64)


def token_batch(
    vocab_size: int,
    length: int,
    pads: Sequence[tuple[int, int]],
    *,
    generator: torch.Generator,
    pad_token_id: int | None,
    low: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``length`` random tokens, row ``i`` padded by ``pads[i]`` (left, right): the one batch
    builder of the comparisons, the training checks and the Trainer dataset.

    Tokens are drawn from ``low .. vocab_size - 1`` with ``generator``; padded positions have a 0
    in the mask and hold ``pad_token_id`` (``None``: left as drawn, masked only).

    Returns:
        ``input_ids`` and ``attention_mask``, ``int64`` of shape ``(len(pads), length)``.
    """
    ids = torch.randint(low, vocab_size, (len(pads), length), generator=generator)
    mask = torch.ones_like(ids)
    for row, (left, right) in enumerate(pads):
        mask[row, :left] = 0
        if right:
            mask[row, -right:] = 0
    if pad_token_id is not None:
        ids[mask == 0] = pad_token_id
    return ids, mask


def padded_batch(vocab_size: int, *, pad_token_id: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three random prompts of 12, 8 and 5 tokens, left-padded to 12: ``(input_ids, attention_mask)``.

    The tokens are drawn from ``3 .. vocab_size - 1`` (clear of the usual special ids 0-2),
    deterministic from ``seed``; padded positions hold ``pad_token_id`` and a 0 in the mask.

    Args:
        vocab_size: the model's vocabulary size.
        pad_token_id: the token id of the padding.
        seed: the random seed of the tokens.

    Returns:
        ``input_ids`` and ``attention_mask``, both ``int64`` of shape ``(3, 12)``.

    Raises:
        ValueError: ``vocab_size`` is 3 or less, or ``pad_token_id`` is not in ``0 .. vocab_size - 1``.
    """
    if vocab_size <= 3:
        raise ValueError(f"vocab_size must be above 3 (tokens are drawn from 3 .. vocab_size - 1), got {vocab_size}")
    if not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id {pad_token_id} is not a token of a vocabulary of {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    return token_batch(vocab_size, 12, [(0, 0), (4, 0), (7, 0)], generator=generator, pad_token_id=pad_token_id)


def comparison_prompts(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts a pack's model is compared on: two of 10 tokens, the second left-padded by 3,
    drawn from the text model's vocabulary.

    A composite model (an image-text model whose causal LM wraps a text sub-model) reads its
    vocabulary from its text config, and a token that stands for an image, a video, ... would
    make its forward ask for pixels: those are drawn again from the text tokens.
    """
    vocab = int(text_config_of(config).vocab_size)
    generator = torch.Generator().manual_seed(1234)
    ids, mask = token_batch(vocab, 10, [(0, 0), (3, 0)], generator=generator, pad_token_id=None, low=1)
    allowed = text_token_ids(config, start=1)
    if len(allowed) < vocab - 1:
        ids = allowed[ids % len(allowed)]
    return ids, mask


def logits_of(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits for a batch, computed without gradients, as float32.

    Returns:
        A tensor of shape ``(batch, seq_len, vocab_size)``.
    """
    with torch.no_grad():
        result: torch.Tensor = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    return result


#: Run by ``reloaded_in_a_fresh_process``'s interpreter: argv[1] is the directory it was given.
_RELOAD = """
import json, sys, torch
from hfpatch_core.testing import logits_of

model = torch.load(sys.argv[1] + "/model.pt", weights_only=False)
input_ids, attention_mask = torch.load(sys.argv[1] + "/inputs.pt")
torch.save(logits_of(model, input_ids, attention_mask), sys.argv[1] + "/logits.pt")
print(json.dumps({name: type(module).__name__ for name, module in model.named_modules()}))
"""


def reloaded_in_a_fresh_process(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, directory: str | Path
) -> tuple[dict[str, str], torch.Tensor]:
    """``torch.save(model)`` here and ``torch.load`` in a new interpreter, which has built no class yet.

    What a pack whose replacement classes are built at runtime must survive (a checkpoint of
    the whole model, a copy sent to a worker): see ``hfpatch_core.authoring.runtime_class``.
    The new interpreter inherits this one's environment (``PYTHONPATH`` included).

    Args:
        model: the (patched) model.
        input_ids: a batch, as ``logits_of`` takes it.
        attention_mask: its mask, or ``None``.
        directory: where the pickled model, the batch and the logits are written.

    Returns:
        The class name of every module of the unpickled model, by module name
        (``named_modules``), and its logits for the batch (``logits_of``).

    Raises:
        RuntimeError: the new interpreter failed (a class that does not unpickle, say);
            the message holds its stderr.
    """
    import subprocess
    import sys

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model, directory / "model.pt")
    torch.save((input_ids, attention_mask), directory / "inputs.pt")
    found = subprocess.run([sys.executable, "-c", _RELOAD, str(directory)], capture_output=True, text=True, timeout=600)
    if found.returncode != 0:
        raise RuntimeError(f"the model did not reload in a fresh process:\n{found.stderr}")
    classes: dict[str, str] = json.loads(found.stdout.strip().splitlines()[-1])
    logits: torch.Tensor = torch.load(directory / "logits.pt")
    return classes, logits


def safetensors_of(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``directory`` (a saved checkpoint), by name.

    Compare a ``save_pretrained`` output with its source: names, shapes, dtypes, values.

    Returns:
        Tensor name -> tensor, read from all the files (sharded checkpoints included).

    Raises:
        FileNotFoundError: ``directory`` holds no ``*.safetensors`` file (or does not exist).
    """
    from safetensors import safe_open

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        state = "does not exist" if not directory.exists() else "holds no *.safetensors file"
        raise FileNotFoundError(f"{directory} {state}: is it a checkpoint saved with safetensors?")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                found[key] = handle.get_tensor(key)
    return found


def tensor_differences(original: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> list[str]:
    """The tensor names whose presence, shape or values differ between two checkpoints
    (``written``'s dtype is the one compared in)."""
    return [
        key
        for key in sorted(set(original) | set(written))
        if key not in original
        or key not in written
        or original[key].shape != written[key].shape
        or not torch.equal(original[key].to(written[key].dtype), written[key])
    ]
