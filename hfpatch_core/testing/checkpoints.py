"""Tiny configs and checkpoints: a model type's default config shrunk, saved with random weights.

``tiny_config(model_type)`` shrinks the size fields of a default config (``SHRINK``);
``tiny_checkpoint(model_type_or_config)`` saves a small random model of it with
``save_pretrained`` (safetensors), deterministic from a seed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..errors import HfPatchError

#: Values ``tiny_checkpoint`` gives the size fields of a default config, where present.
SHRINK: Mapping[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_window_layers": 2,
    "sliding_window": 64,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
}


#: The folder that holds the checkpoints ``tiny_checkpoint`` saves without a directory: one per
#: process, removed when the process exits (by the process that made it, not a forked child).
_scratch: dict[int, Path] = {}


def _remove(path: Path, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _scratch_directory() -> Path:
    pid = os.getpid()
    path = _scratch.get(pid)
    if path is None or not path.is_dir():
        path = _scratch[pid] = Path(tempfile.mkdtemp(prefix="hfpatch-tiny-"))
        atexit.register(_remove, path, pid)
    return path


class TinyCheckpointError(HfPatchError, ValueError):
    """A model type whose default config cannot be shrunk: pass an explicit config."""


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The default config of ``model_type`` with its size fields shrunk (``SHRINK``), then ``overrides``."""
    from transformers import AutoConfig

    from .._pipeline.model_types import unknown_model_type

    unknown = unknown_model_type(model_type)
    if unknown is not None:
        raise TinyCheckpointError(unknown)
    defaults = AutoConfig.for_model(model_type)
    values: dict[str, Any] = {}
    for name, value in SHRINK.items():
        current = getattr(defaults, name, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            values[name] = value
    if getattr(defaults, "head_dim", None) is not None:
        hidden = values.get("hidden_size", defaults.hidden_size)
        values["head_dim"] = hidden // values.get("num_attention_heads", defaults.num_attention_heads)
    vocab = values.get("vocab_size", getattr(defaults, "vocab_size", 0))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = getattr(defaults, name, None)
        if isinstance(token, int) and token >= vocab:
            values[name] = vocab - 1
    layers = values.get("num_hidden_layers")
    pattern = getattr(defaults, "layer_types", None)
    if isinstance(layers, int) and isinstance(pattern, list) and "full_attention" in pattern:
        # hybrid models (qwen3_next: 3 linear-attention layers, then 1 full) keep a full-attention layer
        shrunk = list(pattern[:layers])
        if "full_attention" not in shrunk:
            shrunk[-1] = "full_attention"
        values["layer_types"] = shrunk
    values.update(overrides)
    # built anew (not edited) so that derived fields such as layer_types follow the sizes
    try:
        return type(defaults)(**values)
    except Exception as exc:
        raise TinyCheckpointError(
            f"the shrunk default {model_type!r} config is invalid ({type(exc).__name__}: {exc}); "
            "pass an explicit config: tiny_checkpoint(MyConfig(...))"
        ) from exc


def _causal_lm_class(config: Any) -> type[nn.Module]:
    from .._pipeline.model_types import model_class_for

    return model_class_for(config)


def tiny_checkpoint(
    model_type_or_config: Any, directory: str | Path | None = None, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Save a small random checkpoint of a model type (or of an explicit config).

    Args:
        model_type_or_config: ``"llama"``, ``"qwen2_moe"``, ... or a config object.
        directory: where to save; the caller owns it.  Default: a new folder in a
            temporary directory that is removed, with everything in it, when this
            process exits (pass a directory to keep the checkpoint longer).
        seed: the random seed of the weights.
        config_overrides: config fields to set after shrinking.

    Raises:
        TinyCheckpointError: the shrunk default config does not build a model; pass a config.
    """
    if isinstance(model_type_or_config, str):
        config = tiny_config(model_type_or_config, **config_overrides)
    else:
        config = model_type_or_config
        for name, value in config_overrides.items():
            setattr(config, name, value)
    target = Path(directory) if directory is not None else Path(tempfile.mkdtemp(dir=_scratch_directory()))
    from .._runtime.scope import vanilla

    try:
        with vanilla():
            torch.manual_seed(seed)
            model: Any = _causal_lm_class(config)(config)
            model.save_pretrained(target)
    except Exception as exc:
        raise TinyCheckpointError(
            f"could not build a tiny {getattr(config, 'model_type', config)!r} checkpoint from its shrunk default "
            f"config ({type(exc).__name__}: {exc}); pass an explicit config: tiny_checkpoint(MyConfig(...))"
        ) from exc
    return target


@contextlib.contextmanager
def source_checkpoint(checkpoint_or_model_type: str | Path) -> Iterator[Path]:
    """The checkpoint directory given, or a tiny checkpoint of the model type given (removed
    afterwards): what the equivalence and training checks compare on."""
    source = Path(checkpoint_or_model_type)
    if source.is_dir():
        yield source
        return
    with tempfile.TemporaryDirectory(prefix="hfpatch-tiny-") as directory:
        yield tiny_checkpoint(str(checkpoint_or_model_type), Path(directory) / "checkpoint")
