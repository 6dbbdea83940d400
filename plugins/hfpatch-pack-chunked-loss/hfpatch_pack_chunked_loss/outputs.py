"""What the probe and the installed forward read of a model: its forward's signature, the hidden states a
sub-module returns, and the attributes an auxiliary loss's coefficient may be read from."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from hfpatch_core.authoring import text_decoder_config

__all__ = ["accepts", "coefficient_paths", "last_hidden", "router_arguments", "signature", "with_hidden"]


def last_hidden(output: Any) -> torch.Tensor | None:
    """The last hidden state a module returned (``last_hidden_state``, or a tuple's first tensor), or ``None``."""
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None and isinstance(output, tuple) and output:
        hidden = output[0]
    return hidden if isinstance(hidden, torch.Tensor) else None


def with_hidden(output: Any, hidden: torch.Tensor) -> Any:
    """``output`` with ``hidden`` as its last hidden state (what a forward hook returns to replace it)."""
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    output.last_hidden_state = hidden
    return output


def signature(model: nn.Module) -> inspect.Signature:
    """The signature of the model class's own forward, bound to the model (not an installed forward's)."""
    return inspect.signature(type(model).forward.__get__(model))


def accepts(model: nn.Module, name: str) -> bool:
    """Whether the model's forward takes ``name`` (or any keyword)."""
    parameters = signature(model).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def router_arguments(model: nn.Module) -> dict[str, Any]:
    """The probe's request for the auxiliary loss, where the forward takes one."""
    # the probe asks for the auxiliary loss whatever the config says: a step may ask for it at call time
    return {"output_router_logits": True} if "output_router_logits" in signature(model).parameters else {}


def coefficient_paths(model: nn.Module) -> list[str]:
    """Attributes of the model and of its text config named ``*aux_loss_coef`` (every family reads its
    coefficient from one: ``router_aux_loss_coef``, ``aux_loss_coef``, ``text_config.router_aux_loss_coef``)."""
    paths = [name for name, value in vars(model).items() if name.endswith("aux_loss_coef") and _number(value)]
    config = getattr(model, "config", None)
    if config is not None:
        text = text_decoder_config(config)
        named = (f"config.{name}" for name, value in vars(config).items() if value is text)
        prefix = "config" if text is config else next(named, None)
        if prefix is not None:
            paths += [f"{prefix}.{n}" for n, v in vars(text).items() if n.endswith("aux_loss_coef") and _number(v)]
    return paths


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
