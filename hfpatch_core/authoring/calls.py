"""Proving from a class's source that its forward gives several children the same input.

A pack that fuses projections without re-writing the forward
(``hfpatch_core.authoring.views``) saves matmuls only where the forward hands every part
the same tensor, as llama's attention does::

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

``same_input(cls, parts)`` reads the source of ``cls.forward`` (the first definition in
its method resolution order) and answers ``None`` when, in it, each part is called
exactly once, with one positional argument, the same variable for all, not inside a
loop, a comprehension or a nested function, and that variable is not assigned between
the first and the last of these calls.  Otherwise it answers why not, in one line: a
cross-attention (``self.k_proj(key_value_states)``), a part called twice or through a
helper, a part passed around as an object.  The answer is conservative: a forward whose
source cannot be read, or that reaches a part only through another method, is refused.

``builds_by_name(cls, name)`` answers whether an ``__init__`` of ``cls`` (or of a base
class) refers to ``name``: transformers' patch registry replaces a class by rebinding its
name in the modeling modules, so a child built from a table (``MIXER_TYPES[kind](...)``)
or a factory keeps the original class whatever the registry says.

Reading the source needs no weights and no device, and is cached per class.

Imported by its full name (``hfpatch_core.authoring.calls``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["builds_by_name", "forward_owner", "same_input"]

_SCOPES = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def forward_owner(cls: type) -> type | None:
    """The class in ``cls``'s method resolution order that defines the ``forward`` it runs."""
    return next((base for base in cls.__mro__ if "forward" in vars(base)), None)


def same_input(cls: type, parts: Sequence[str]) -> str | None:
    """Why ``cls.forward`` cannot be proven to call ``self.<part>`` once each on one input, or ``None``.

    Args:
        cls: the module class.
        parts: the child names, e.g. ``("q_proj", "k_proj", "v_proj")``.

    Returns:
        ``None`` when the source proves it; otherwise the reason, one line.
    """
    return _same_input(cls, tuple(parts))


@functools.lru_cache(maxsize=1024)
def _same_input(cls: type, parts: tuple[str, ...]) -> str | None:
    owner = forward_owner(cls)
    if owner is None:
        return f"{cls.__name__} has no forward"
    where = f"{owner.__module__}.{owner.__qualname__}.forward"
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(vars(owner)["forward"])))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as exc:
        return f"the source of {where} cannot be read ({type(exc).__name__}), so its inputs cannot be proven"
    function = next((node for node in tree.body if isinstance(node, _FUNCTIONS)), None)
    if function is None or not function.args.args:
        return f"{where} is not a method whose source can be read"
    this = function.args.args[0].arg
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(function):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    calls: dict[str, list[ast.Call]] = {part: [] for part in parts}
    for node in ast.walk(function):
        if not (
            isinstance(node, ast.Attribute)
            and node.attr in calls
            and isinstance(node.value, ast.Name)
            and node.value.id == this
        ):
            continue
        parent = parents.get(node)
        if not (isinstance(parent, ast.Call) and parent.func is node):
            return f"{where} uses {this}.{node.attr} other than by calling it"
        calls[node.attr].append(parent)
    for part, found in calls.items():
        if len(found) != 1:
            how = "never calls it itself" if not found else f"calls it {len(found)} times"
            return f"{where} {how} ({this}.{part}): the parts' inputs cannot be proven the same"
    names = set()
    for part, (call,) in calls.items():
        if call.keywords or len(call.args) != 1 or not isinstance(call.args[0], ast.Name):
            return (
                f"{where} calls {this}.{part} with {ast.unparse(call)[len(this) + len(part) + 1 :]}, not one variable"
            )
        scope = parents.get(call)
        while scope is not None and scope is not function:
            if isinstance(scope, (*_SCOPES, *_FUNCTIONS)):
                return f"{where} calls {this}.{part} inside a loop or a nested scope"
            scope = parents.get(scope)
        names.add(call.args[0].id)
    if len(names) != 1:
        inputs = ", ".join(f"{part}({call.args[0].id})" for part, (call,) in calls.items())  # type: ignore[attr-defined]
        return f"{where} gives the parts different inputs: {inputs}"
    (name,) = names
    positions = [(call.lineno, call.col_offset) for (call,) in calls.values()]
    first, last = min(positions), max(positions)
    for node in ast.walk(function):
        stored = isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, (ast.Store, ast.Del))
        if stored and first <= (node.lineno, node.col_offset) <= last:  # type: ignore[attr-defined]
            return f"{where} assigns {name} between the calls of {', '.join(parts)}"
    return None


@functools.lru_cache(maxsize=1024)
def builds_by_name(cls: type, name: str) -> bool:
    """Whether some ``__init__`` in ``cls``'s method resolution order refers to ``name``.

    As a global name (``LlamaAttention(config, layer_idx)``) or an attribute
    (``modeling.LlamaAttention``).  ``False`` where no source can be read.
    """
    for base in cls.__mro__:
        init = vars(base).get("__init__")
        if init is None or base.__module__.startswith(("torch.", "builtins")):
            continue
        for function in _wrapped_inits(init):
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
            except (OSError, TypeError, SyntaxError):
                continue
            for node in ast.walk(tree):
                if (isinstance(node, ast.Name) and node.id == name) or (
                    isinstance(node, ast.Attribute) and node.attr == name
                ):
                    return True
    return False


def _wrapped_inits(init: Any) -> list[Any]:
    """``init`` and the ``__init__`` functions it wraps: through ``__wrapped__`` (``functools.wraps``)
    and through its closure, where a decorator that keeps no ``__wrapped__`` holds the original
    (transformers' ``@use_kernelized_func`` on Qwen3Attention, Gemma3Attention, OlmoeAttention)."""
    found: list[Any] = []
    pending = [init]
    while pending:
        function = inspect.unwrap(pending.pop())
        if function in found:
            continue
        found.append(function)
        for cell in getattr(function, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if inspect.isfunction(value) and value.__name__ == "__init__":
                pending.append(value)
    return found
