"""Replacement classes built at runtime that pickle: ``runtime_class``.

A pack that builds its replacement inside a hook (a subclass of whatever class the
installed transformers has, found by structure) makes a class no module defines. pickle
names a class by its module and qualified name, so such a class does not pickle at all
unless the module happens to hold it under that name, and does not unpickle in a fresh
process, where no load has built it yet: ``torch.save(model)`` then ``torch.load`` in
another process, a model sent to a ``DataLoader`` worker or another rank, ``copy.deepcopy``
across a spawn.

A class made by ``runtime_class`` pickles as the call that builds it: ``rebuild(*arguments,
**keywords)``, the pack's own (module-level, cached) builder with arguments that pickle by
reference (the original transformers class) or by value.  Unpickling imports the pack,
calls the builder and gets the class again, so instances of it unpickle too.

Imported by its full name (``hfpatch_core.authoring.classes``) or from
``hfpatch_core.authoring``; it imports neither torch nor transformers.
"""

from __future__ import annotations

import copyreg
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["RuntimeClassMeta", "runtime_class"]

#: The attribute holding a runtime class's ``(rebuild, arguments, keywords)``, read from the
#: class's own namespace only: a class defined in source that derives from a runtime class
#: inherits the attribute but pickles by name.
_REBUILD = "__hfpatch_rebuild__"


class RuntimeClassMeta(type):
    """The metaclass of ``runtime_class``'s classes: pickle reduces them to the call that builds them.

    pickle treats any class as a global (module and name) unless the exact type of the
    class, its metaclass, has a reducer in ``copyreg.dispatch_table``; this metaclass has
    one, and so has every metaclass ``runtime_class`` derives from it for an original with
    a metaclass of its own.
    """


def _reduce(cls: type) -> str | tuple[Any, ...]:
    recipe = vars(cls).get(_REBUILD)
    if recipe is None:  # a subclass written in source: found by its module and name
        return cls.__qualname__
    rebuild, arguments, keywords = recipe
    return (_call, (rebuild, arguments, keywords))


def _call(rebuild: Callable[..., type], arguments: tuple[Any, ...], keywords: dict[str, Any]) -> type:
    return rebuild(*arguments, **keywords)


copyreg.pickle(RuntimeClassMeta, _reduce)

_METACLASSES: dict[type, type] = {}
_METACLASSES_LOCK = threading.Lock()


def _metaclass_for(bases: Sequence[type]) -> type:
    """``RuntimeClassMeta``, or one derived from it and from the bases' own metaclass."""
    own = [type(base) for base in bases if not issubclass(RuntimeClassMeta, type(base))]
    if not own:
        return RuntimeClassMeta
    with _METACLASSES_LOCK:
        found = _METACLASSES.get(own[0])
        if found is None:
            found = type(f"Runtime{own[0].__name__}", (RuntimeClassMeta, own[0]), {"__module__": __name__})
            # copyreg looks a reducer up by the exact metaclass, not its bases
            copyreg.pickle(found, _reduce)
            _METACLASSES[own[0]] = found
        return found


def runtime_class(
    name: str,
    bases: Sequence[type],
    namespace: Mapping[str, Any] | None = None,
    *,
    module: str,
    rebuild: Callable[..., type],
    arguments: Sequence[Any] = (),
    keywords: Mapping[str, Any] | None = None,
) -> type[Any]:
    """A class built at runtime that pickles as ``rebuild(*arguments, **keywords)``.

    Use it where a pack would call ``type(name, bases, namespace)``, from the builder that
    caches the class (so the same arguments give the same class, and unpickling in the
    process that built it gives that class back)::

        _classes: dict[type, type] = {}

        def fast_class(original: type[nn.Module]) -> type[nn.Module]:
            if original not in _classes:
                _classes[original] = runtime_class(
                    f"Fast{original.__name__}", (FastMixin, original), module=__name__,
                    rebuild=fast_class, arguments=(original,),
                )
            return _classes[original]

    Args:
        name: the class name (``__name__`` and ``__qualname__``).
        bases: its bases, as for ``type``.
        namespace: further class attributes.
        module: the module the class says it is from (``__module__``): the pack's own, so
            that the plan and ``hfpatch explain`` name it.  The class is not set as an
            attribute of it.
        rebuild: the builder, a function pickle finds by module and name (a module-level
            function of the pack, usually the one calling this).
        arguments: its positional arguments; they must pickle (classes and functions
            by reference, values such as frozen dataclasses and strings by value).
        keywords: its keyword arguments, likewise.

    Returns:
        The class.  Its metaclass is ``RuntimeClassMeta`` (or one derived from it and the
        bases' own metaclass).  A class derived from it in source pickles by its name, as
        any class does.
    """
    attributes = {
        "__module__": module,
        "__qualname__": name,
        **(namespace or {}),
        _REBUILD: (rebuild, tuple(arguments), dict(keywords or {})),
    }
    cls: type[Any] = _metaclass_for(bases)(name, tuple(bases), attributes)
    return cls
