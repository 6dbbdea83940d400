"""What a pack is told about the model being loaded."""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers


def _transformers_version() -> str:
    return str(transformers.__version__)


@dataclasses.dataclass(frozen=True)
class LoadContext:
    """The model a load is building, as seen by a pack's hooks.

    Attributes:
        model_type: the config's ``model_type`` (``"llama"``, ``"qwen2_moe"``), or ``None``
            when the class declares no config class.
        model_class_name: the class being instantiated, e.g. ``"LlamaForCausalLM"``.
        config: the model's config, or ``None`` where only the type is known
            (``hfpatch check`` on a model type whose default config cannot be built).
            In a ``from_pretrained`` / ``from_config`` load it is the very object the
            model is built with, keyword overrides (``num_hidden_layers=...``),
            ``attn_implementation`` and ``dtype`` applied; read it, do not change it.
        transformers_version: the installed transformers version.
        parent: for a sub-model built inside another load (the text model of a
            multimodal model), the outer load's context; ``None`` for a top-level load.
        parallel: the parallelisms transformers' loader shards this model with, from the
            ``from_pretrained`` arguments (``tp_plan``, ``distributed_config``,
            ``device_mesh``): some of ``"tp"``, ``"ep"``, ``"fsdp"``, ``"pp"``; empty for
            a load that is not sharded.  The same on every rank.
    """

    model_type: str | None
    model_class_name: str
    config: Any = dataclasses.field(default=None, compare=False, repr=False)
    transformers_version: str = dataclasses.field(default_factory=_transformers_version)
    parent: LoadContext | None = dataclasses.field(default=None, compare=False, repr=False)
    parallel: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model_class_name, str) or not self.model_class_name:
            raise TypeError(
                f"LoadContext.model_class_name must be a non-empty class name, got {self.model_class_name!r}"
            )
        if self.model_type is not None and not isinstance(self.model_type, str):
            raise TypeError(f"LoadContext.model_type must be a string or None, got {self.model_type!r}")
        parallel = (self.parallel,) if isinstance(self.parallel, str) else tuple(self.parallel)
        if not all(isinstance(mode, str) and mode for mode in parallel):
            raise TypeError(f"LoadContext.parallel must be parallelism names such as ('tp',), got {self.parallel!r}")
        object.__setattr__(self, "parallel", parallel)

    @property
    def model_class(self) -> type | None:
        """The class ``model_class_name`` names in transformers (``transformers.LlamaForCausalLM``), or
        ``None`` where transformers exports no class of that name (a custom-code model)."""
        found = getattr(transformers, self.model_class_name, None)
        return found if isinstance(found, type) else None

    @property
    def root(self) -> LoadContext:
        """The outermost load this context belongs to (itself for a top-level load)."""
        context = self
        while context.parent is not None:
            context = context.parent
        return context

    @classmethod
    def for_model(
        cls,
        model_class: type,
        config: Any = None,
        *,
        parent: LoadContext | None = None,
        parallel: tuple[str, ...] = (),
    ) -> LoadContext:
        """The context of instantiating ``model_class``, with ``config`` when it is known
        (``parallel``: see the attribute; a sub-model is sharded as its parent is)."""
        model_type = getattr(config, "model_type", None) or getattr(
            getattr(model_class, "config_class", None), "model_type", None
        )
        return cls(
            model_type=model_type or None,
            model_class_name=model_class.__name__,
            config=config,
            parent=parent,
            parallel=parallel or (parent.parallel if parent is not None else ()),
        )
