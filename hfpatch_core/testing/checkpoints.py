"""Tiny checkpoints: a model type's default config shrunk, saved with random weights.

``tiny_config(model_type)`` shrinks the size fields of a default config (``SHRINK``; ``configs``
builds it); ``tiny_checkpoint(model_type_or_config)`` saves a small random model of it with
``save_pretrained`` (safetensors), deterministic from a seed; ``check_tiny_checkpoint`` says
whether a model type's checkpoint loads and runs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..authoring.meta import meta_init_skipped
from .configs import TINY_DECODER, TinyCheckpointError, tiny_config
from .sizes import SHRINK, text_config

__all__ = [
    "SHRINK",
    "TINY_DECODER",
    "TINY_PARAMETERS",
    "TinyCheckpointError",
    "check_tiny_checkpoint",
    "parameter_count",
    "source_checkpoint",
    "tiny_checkpoint",
    "tiny_config",
]

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


def _causal_lm_class(config: Any) -> type[nn.Module]:
    from .._pipeline.model_types import model_class_for

    return model_class_for(config)


def _config_for(model_class: Any, config: Any) -> Any:
    """The config ``model_class`` is built from: ``config``, or its text sub-config where the class
    takes that (emu3, llama4, qwen3_5: a text-only causal LM of a composite model type)."""
    wanted = getattr(model_class, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return config
    try:
        text = config.get_text_config()
    except Exception:  # several text configs (musicgen: text encoder and decoder): the one of the class
        text = None
    if isinstance(text, wanted):
        return text
    # not a text config a load reads out of the composite one: the checkpoint keeps the sub-config
    inner = [getattr(config, name, None) for name in getattr(type(config), "sub_configs", {})]
    return next((sub for sub in inner if isinstance(sub, wanted)), config)


def _built_from(config: Any) -> tuple[type[nn.Module], Any, bool]:
    """The class ``tiny_checkpoint`` builds for ``config``, the config it builds it from, and whether
    the checkpoint keeps the composite config (a text-only causal LM of a composite model type).

    A composite model whose full model needs a library that is not installed (gemma3n's vision
    tower needs timm and PIL) gives its text model's causal LM, saved with its text config alone:
    a checkpoint of the text model, which loads without the library."""
    from .._scope import vanilla

    model_class = _causal_lm_class(config)
    own = _config_for(model_class, config)
    text = text_config(config)
    if own is config and text is not None and text is not config:
        try:
            with vanilla(), torch.device("meta"), meta_init_skipped():
                model_class(own)
        except ImportError:
            return _causal_lm_class(text), text, False
    return model_class, own, own is not config and text is own


#: The most parameters a tiny checkpoint of a model type has (what ``check_tiny_checkpoint`` holds it to).
TINY_PARAMETERS = 20_000_000

#: Above this, ``tiny_checkpoint`` refuses a model type's shrunk config before building anything.
_MOST_PARAMETERS = 100_000_000


def parameter_count(config: Any) -> int:
    """The parameters of the causal LM ``tiny_checkpoint`` builds from ``config``, counted on the meta device."""
    from .._scope import vanilla

    model_class, own, _ = _built_from(config)
    with vanilla(), torch.device("meta"), meta_init_skipped():
        model = model_class(own)
    return sum(parameter.numel() for parameter in model.parameters())


def check_tiny_checkpoint(model_type: str) -> str | None:
    """Why ``tiny_checkpoint(model_type)`` gives no working checkpoint, or ``None`` when it does.

    Working: the shrunk config builds a causal LM of at most ``TINY_PARAMETERS`` parameters,
    which saves, loads again with ``AutoModelForCausalLM`` (or the class the checkpoint names where
    that maps none: ``causal_lm_loader``; no weight missing, unexpected or mismatched, no buffer
    left unwritten: the load runs with uninitialized memory filled with NaN, so such a buffer
    fails on every host) and gives finite logits for a left-padded batch of text tokens.

    Returns:
        ``None``, or ``"<stage>: <error>"`` with stage ``config``, ``size``, ``save``,
        ``load`` or ``forward``.
    """
    from .._scope import vanilla
    from .models import causal_lm_loader, text_token_ids

    stage = "config"
    try:
        config = tiny_config(model_type)
        stage = "size"
        count = parameter_count(config)
        if count > TINY_PARAMETERS:
            return f"size: {count:,} parameters (at most {TINY_PARAMETERS:,})"
        with tempfile.TemporaryDirectory(prefix="hfpatch-tiny-") as directory:
            stage = "save"
            path = tiny_checkpoint(config, Path(directory) / "checkpoint")
            stage = "load"
            with vanilla(), _uninitialized_memory_as_nan():
                loaded: Any = causal_lm_loader(path).from_pretrained(path, output_loading_info=True)
            model, info = loaded
            unset = _unset_buffers(model)
            if unset:
                return f"load: from_pretrained left buffers uninitialized: {', '.join(unset[:3])}"
            wrong = {kind: sorted(map(str, info.get(kind) or ())) for kind in ("missing_keys", "unexpected_keys")}
            wrong["mismatched_keys"] = sorted(str(entry[0]) for entry in info.get("mismatched_keys") or ())
            problems = [f"{kind.replace('_', ' ')} {', '.join(keys[:3])}" for kind, keys in wrong.items() if keys]
            if problems:
                return f"load: {'; '.join(problems)}"
            stage = "forward"
            tokens = text_token_ids(model.config)
            ids = tokens[torch.randint(0, len(tokens), (2, 10), generator=torch.Generator().manual_seed(0))]
            mask = torch.ones_like(ids)
            mask[1, :3] = 0
            with torch.no_grad():
                logits = model.eval()(input_ids=ids, attention_mask=mask).logits
            if not torch.isfinite(logits).all():
                return "forward: logits not finite"
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc, TinyCheckpointError) and exc.__cause__ is not None else exc
        message = " ".join(str(cause).split())
        return f"{stage}: {type(cause).__name__}: {message[:300]}"
    return None


@contextlib.contextmanager
def _uninitialized_memory_as_nan() -> Iterator[None]:
    """Fill the memory torch allocates without writing (``torch.empty``) with NaN while in the block.

    A buffer the loader allocates but never writes (transformers 5.3 leaves recurrent_gemma's
    rotary ``inv_freq`` so: not in the checkpoint, not in ``_init_weights``) holds whatever the
    allocator gave it: finite on one host or run, NaN on the next.  Filled with NaN it fails the
    same way every time."""
    import warnings

    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        with warnings.catch_warnings():
            # an op without a deterministic kernel warns (warn_only); the load's results are not compared
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation")
            yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def _unset_buffers(model: nn.Module) -> list[str]:
    """The floating-point buffers that hold nothing but NaN: what a load under
    ``_uninitialized_memory_as_nan`` allocated and never wrote."""
    return [
        name
        for name, buffer in model.named_buffers()
        if buffer.is_floating_point() and buffer.numel() and bool(torch.isnan(buffer).all())
    ]


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
        try:
            count = parameter_count(config)
        except Exception as exc:
            raise TinyCheckpointError(
                f"could not build a tiny {model_type_or_config!r} model from its shrunk default config "
                f"({type(exc).__name__}: {exc}); pass an explicit config: tiny_checkpoint(MyConfig(...))"
            ) from exc
        if count > _MOST_PARAMETERS:  # counted on the meta device: nothing that size is ever built
            raise TinyCheckpointError(
                f"the shrunk default {model_type_or_config!r} config still has {count:,} parameters (a tiny "
                f"checkpoint has at most {TINY_PARAMETERS:,}); pass an explicit config: tiny_checkpoint(MyConfig(...))"
            )
    else:
        config = model_type_or_config
        for name, value in config_overrides.items():
            setattr(config, name, value)
    target = Path(directory) if directory is not None else Path(tempfile.mkdtemp(dir=_scratch_directory()))
    from .._scope import vanilla

    try:
        with vanilla():
            torch.manual_seed(seed)
            model_class, own, composite = _built_from(config)
            model: Any = model_class(own)
            model.save_pretrained(target)
            if composite:
                # the checkpoint keeps the composite config, as a released one does: a load reads
                # the text config out of it
                config.save_pretrained(target)
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
