"""A patched model's ``save_pretrained`` writes all of the checkpoint or nothing.

transformers writes ``config.json`` first and the weights last, converting each shard back
to the original layout as it goes: a conversion that fails half-way (a quantized tensor a
pack cannot split back) leaves a directory holding a config and no weights, which
``from_pretrained`` then loads as a randomly initialised model.  The save runs in a
staging directory beside the target instead, and its files are moved into the target
only once every one of them is written.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: The shard files transformers' ``save_pretrained`` removes from a directory it saves into
#: when the new save does not write them (``model-00001-of-00005.safetensors``).
_SHARD = re.compile(r"(?:model|pytorch_model)-\d{5}-of-\d{5}\.(?:safetensors|bin)")


def _remove_stale_shards(target: Path, written: set[str]) -> None:
    """What transformers does before writing into a directory: shards of an earlier save that
    this one does not write would be read with the new index, so they go."""
    for entry in target.iterdir():
        if entry.is_file() and _SHARD.fullmatch(entry.name) and entry.name not in written:
            entry.unlink()


def _move_into(staging: Path, target: Path, *, main: bool) -> None:
    target.mkdir(parents=True, exist_ok=True)
    written = {entry.name for entry in staging.iterdir()}
    if main:  # as transformers: only the main process cleans, so that no rank removes another's new shards
        _remove_stale_shards(target, written)
    for entry in staging.iterdir():
        destination = target / entry.name
        if entry.is_dir() and destination.is_dir():
            shutil.rmtree(destination)
        os.replace(entry, destination)


def staged_save(model: Any, directory: str | os.PathLike[str], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``type(model).save_pretrained(model, directory, *args, **kwargs)``, written into a staging
    directory beside ``directory`` and moved there once it succeeded; on failure the staging
    directory is removed and ``directory`` is as it was (not created if it did not exist, nor
    the folders above it that the save created for its staging).

    A ``directory`` that is an existing file is passed through (transformers' own error).
    """
    target = Path(directory)
    if target.is_file():
        return type(model).save_pretrained(model, directory, *args, **kwargs)
    created = [folder for folder in (target.parent, *target.parent.parents) if not folder.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.hfpatch-save-", dir=target.parent))
    options = dict(kwargs)
    if options.get("push_to_hub") and not options.get("repo_id"):
        options["repo_id"] = target.name  # transformers names the repository after the directory it saves into
    try:
        result = type(model).save_pretrained(model, str(staging), *args, **options)
        _move_into(staging, target, main=bool(options.get("is_main_process", True)))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        raise
    shutil.rmtree(staging, ignore_errors=True)  # emptied by the move
    return result


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove ``folders`` (the deepest first) while they are empty: those a failed save created."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (another writer's, or what the save moved in): kept, and those above it
            return
