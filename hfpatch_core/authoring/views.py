"""Fused projection views: one matmul for several ``nn.Linear`` that read the same input,
while the original forward still calls each of them by name.

A pack that fuses ``q_proj`` / ``k_proj`` / ``v_proj`` without re-writing the family's
forward subclasses the installed class with ``FusedViewsMixin`` first among the bases
(``fused_views_class`` builds such a class at runtime)::

    Fused = fused_views_class(LlamaAttention, {"qkv_proj": ("q_proj", "k_proj", "v_proj")},
                              module=__name__)

``__init__`` builds the original module, then ``fuse_as_views`` replaces the parts by
one ``SharedProjection`` child ``qkv_proj`` (the only parameters: the checkpoint's
q/k/v tensors concatenated by a ``SizedConcatenate`` converter) and puts a
``ProjectionView`` under each original name.  When the family's own forward calls
``self.q_proj(hidden_states)``, the view asks the shared projection for its rows: the
first view called with an input computes the fused matmul once for that input; the
others called with the same tensor (same object, unchanged since) take their slice of
it, and the result is dropped once every view has taken its slice.  A view called with
another input gets the fused matmul of that input: the output is the original's in any
case, fusion only saves the matmuls where the forward gives every part the same tensor
(``hfpatch_core.authoring.tracing.same_input_calls`` proves that from the source).

Order and names are kept for tools that walk the modules: the shared projection is
registered just before the first part, and the views under the parts' names, so
``named_modules()`` lists ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` in the original
order (PEFT draws LoRA's random initialisation in that order: a seeded adapter is the one
vanilla gets).  The views are ``nn.Linear`` (``hfpatch_core.authoring.packing.PackedPart``),
so PEFT wraps them like the originals; the shared projection is not an ``nn.Linear``, so
``target_modules="all-linear"`` does not find it.  Their ``weight`` / ``bias`` are views of
the fused rows: transformers' initialisation of a model built from a config writes the
same values, in the same order, as into the original projections.

A quantized checkpoint needs the other way round (``fuse_as_views(..., quantizable=True)``,
``fused_views_class(..., quantizable=True)``): compressed-tensors quantizes every module
whose class (or a base) is named ``Linear``, adding its scales to it, so the fused
projection is a ``SharedLinear`` (an ``nn.Linear``: the quantizer takes it, and its tensor
families fuse and split like its weight, ``hfpatch_core.authoring.families``) and each
original name an ``OutputView``, which is no ``nn.Linear`` (the quantizer leaves it alone)
and owns no tensor: it takes its columns of the fused output, computed once per input as
above, through whatever the quantizer made of the fused projection's forward.

Imported by its full name (``hfpatch_core.authoring.views``): it imports torch.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn as nn

from .classes import RuntimeClassMeta, runtime_class
from .packing import PackedLinear, PackedPart, gathered, is_partitioned, local_sizes, mark_exposed, record_sizes
from .peft import watch_peft

__all__ = [
    "FusedClassMeta",
    "FusedViewsMixin",
    "OutputView",
    "ProjectionView",
    "SharedLinear",
    "SharedProjection",
    "fusable_parts",
    "fuse_as_views",
    "fused_views_class",
]

#: transformers' flag on a tensor it loaded or initialised (``transformers.initialization``).
_INITIALIZED = "_is_hf_initialized"


def _version(tensor: torch.Tensor) -> int:
    # inference tensors have no version counter; they cannot be changed in place either
    return -1 if tensor.is_inference() else int(tensor._version)


@dataclasses.dataclass
class _Computed:
    """The fused output for one input, until every view has taken its slice."""

    input: torch.Tensor
    key: tuple[int, int, bool]
    output: torch.Tensor
    pending: set[int]


class _SharedOutput(nn.Module):
    """The fused output computed once per input (a mixin of the fused projection): ``output_for``."""

    sizes: tuple[int, ...]
    _computed: _Computed | None

    def _share(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sizes)
        # no lock: a thread that finds another thread's input here computes its own (exact either way)
        self._computed = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_computed"] = None  # an activation is no part of the module
        return state

    def _key(self, x: torch.Tensor) -> tuple[int, int, bool]:
        # a quantizer may hold the weight as other tensors (weight_packed, ...): the version of each
        tensors = self._parameters.values()
        version = sum(_version(tensor) for tensor in tensors if tensor is not None)
        return (_version(x), version, torch.is_grad_enabled())

    def output_for(self, part: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``part``'s output for input ``x``: its columns of the fused output, computed once per input.

        Args:
            part: the part's index, in row order.
            x: the input.

        Returns:
            The part's output (contiguous, as an ``nn.Linear`` returns it).
        """
        computed = self._computed
        if computed is None or computed.input is not x or computed.key != self._key(x):
            # through __call__: hooks on the fused projection (a profiler, a device hook, a quantizer's
            # forward) see one call
            output = self(x)
            # keyed after the call: a quantizer's first call may decompress the weight into new tensors
            computed = _Computed(x, self._key(x), output, set(range(len(self.sizes))))
        computed.pending.discard(part)
        # kept only until every part has its slice: no activation outlives the forward
        self._computed = computed if computed.pending else None
        output = computed.output
        sizes = local_sizes(self.sizes, output.shape[-1])
        start = sum(sizes[:part])
        return output[..., start : start + sizes[part]].contiguous()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={list(self.sizes)}"


class SharedProjection(_SharedOutput, PackedLinear):
    """The fused projection of a ``fuse_as_views`` module: the parameters, computed once per input.

    Holds ``weight`` (and ``bias``): the parts' rows in order.  Calling it is one
    ``F.linear``; ``ProjectionView`` calls it through ``output_for``, which keeps the
    output for the other views of the same input.

    Attributes:
        sizes: the parts' output sizes, in row order.
    """

    def __init__(self, linear: nn.Linear, sizes: Sequence[int]) -> None:
        super().__init__(linear)
        self._share(sizes)

    def view(self, index: int, start: int, stop: int) -> nn.Module:
        """Part ``index``'s ``ProjectionView`` (rows ``[start, stop)``)."""
        return ProjectionView(self, index, start, stop)


class SharedLinear(_SharedOutput, nn.Linear):
    """The fused projection of a quantizable ``fuse_as_views`` module: an ``nn.Linear``, computed once per input.

    A quantizer that takes every ``nn.Linear`` (compressed-tensors, matching ``Linear`` in the
    class's bases) quantizes it as one linear; its ``OutputView`` children call it through
    ``output_for``.

    Attributes:
        sizes: the parts' output sizes, in row order.
    """

    def __init__(self, linear: nn.Linear, sizes: Sequence[int]) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would draw parameters of its own
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._share(sizes)

    def view(self, index: int, start: int, stop: int) -> nn.Module:
        """Part ``index``'s ``OutputView`` (columns ``[start, stop)`` of the output)."""
        return OutputView(self, index, start, stop)


class ProjectionView(PackedPart):
    """One original projection of a ``SharedProjection``: rows ``[start, stop)``, computed with the others.

    An ``nn.Linear`` owning no parameter (``PackedPart``): ``weight`` / ``bias`` are views of
    the fused rows, carrying the fused parameter's "already initialised" mark, so that
    transformers initialises them only where the fused weight was not loaded.  Calling it
    gives what the original ``nn.Linear`` gives, from the shared fused matmul.
    """

    def __init__(self, fused: SharedProjection, index: int, start: int, stop: int) -> None:
        super().__init__(fused, start, stop)
        self.index = index

    @property
    def weight(self) -> torch.Tensor:
        parameter = self._fused.weight
        weight: torch.Tensor = parameter[self.start : self.stop]
        if getattr(parameter, _INITIALIZED, False):
            setattr(weight, _INITIALIZED, True)
        return weight

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        self._assign(self.weight, value, "weight")

    @property  # type: ignore[override]
    def bias(self) -> torch.Tensor | None:
        parameter = self._fused.bias
        if parameter is None:
            return None
        bias: torch.Tensor = parameter[self.start : self.stop]
        if getattr(parameter, _INITIALIZED, False):
            setattr(bias, _INITIALIZED, True)
        return bias

    @bias.setter
    def bias(self, value: torch.Tensor | None) -> None:
        PackedPart.bias.fset(self, value)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._fused
        assert isinstance(fused, SharedProjection)
        return fused.output_for(self.index, x)


class OutputView(nn.Module):
    """One original projection of a ``SharedLinear``: columns ``[start, stop)`` of its output.

    No ``nn.Linear`` and no tensor of its own (a quantizer that takes every ``nn.Linear`` leaves
    it alone): calling it gives what the original projection gives, from the shared fused call.
    ``weight`` and ``bias`` are not there to read: the quantized fused projection may hold no
    ``weight`` (``weight_packed`` and its scales).
    """

    def __init__(self, fused: SharedLinear, index: int, start: int, stop: int) -> None:
        super().__init__()
        # not a child: the fused module is its parent's, and its tensors must be listed once
        object.__setattr__(self, "_fused", fused)
        self._fused: SharedLinear
        self.index, self.start, self.stop = index, start, stop
        self.in_features = fused.in_features
        self.out_features = stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused.output_for(self.index, x)

    def extra_repr(self) -> str:
        return f"columns [{self.start}, {self.stop}) of the fused output, in_features={self.in_features}"


def fusable_parts(module: nn.Module, parts: Sequence[str]) -> str | None:
    """Why ``module``'s children ``parts`` cannot be fused into one projection, or ``None`` if they can.

    They can when each is exactly an ``nn.Linear`` (not a subclass: a quantizer's or an
    adapter's wrapper computes something else), and all read the same input size, all or
    none has a bias, and all share a dtype and device.
    """
    linears = []
    for name in parts:
        child = getattr(module, name, None)
        if type(child) is not nn.Linear:
            what = "missing" if child is None else f"a {type(child).__module__}.{type(child).__qualname__}"
            return f"{name} is {what}, not an nn.Linear"
        linears.append(child)
    sizes = [linear.in_features for linear in linears]
    if len(set(sizes)) > 1:
        return f"{'/'.join(parts)} read different input sizes {sizes}: not one projection of one input"
    biases = [name for name, linear in zip(parts, linears, strict=True) if linear.bias is not None]
    if biases and len(biases) != len(parts):
        return f"only {biases} of {list(parts)} have a bias: the fused projection would add one to the others"
    settings = {(linear.weight.dtype, linear.weight.device) for linear in linears}
    if len(settings) > 1:
        return f"{'/'.join(parts)} differ in dtype or device ({sorted(map(str, settings))})"
    return None


def fuse_as_views(module: nn.Module, parts: Sequence[str], fused: str, *, quantizable: bool = False) -> tuple[int, ...]:
    """Replace ``module``'s ``nn.Linear`` children ``parts`` by views of one ``SharedProjection`` ``fused``.

    With ``quantizable=True`` the fused child is a ``SharedLinear`` and the views
    ``OutputView``: a quantizer takes the fused projection for one ``nn.Linear`` and leaves
    the views alone (a quantized checkpoint's load); PEFT cannot wrap the views then.

    The fused weight is the parts' weights concatenated in order (their values are kept:
    a module built on a real device computes what it computed before).  ``fused`` is
    registered just before the first part and the views under the parts' names, in their
    places, so the order of ``module.named_modules()`` is the original's with ``fused``
    added.  The class should declare ``hfpatch_packed_modules = {fused: parts}``
    (``fused_views_class`` does), so that PEFT adapters naming ``fused`` are refused.

    Returns:
        The parts' output sizes, in order.

    Raises:
        ValueError: ``parts`` is empty, ``fused`` is taken, or ``fusable_parts`` finds a problem.
    """
    if not parts:
        raise ValueError(f"{type(module).__name__}: no projections to fuse into {fused}")
    if fused in module._modules or fused in module._parameters:
        raise ValueError(f"{type(module).__name__} already has a {fused!r}: cannot fuse {list(parts)} into it")
    problem = fusable_parts(module, parts)
    if problem is not None:
        raise ValueError(f"{type(module).__name__}: cannot fuse into {fused}: {problem}")
    linears: list[nn.Linear] = [getattr(module, name) for name in parts]
    sizes = tuple(linear.out_features for linear in linears)
    first = linears[0]
    sources = [tensor for linear in linears for tensor in (linear.weight, linear.bias)]
    if any(is_partitioned(tensor) for tensor in sources if tensor is not None):
        combined = _partitioned_combination(linears, sizes)
    else:
        # skip_init: no random draw, so that a model built from a config draws what the original draws
        combined = torch.nn.utils.skip_init(
            nn.Linear,
            first.in_features,
            sum(sizes),
            bias=first.bias is not None,
            device=first.weight.device,
            dtype=first.weight.dtype,
        )
        with torch.no_grad():
            if not combined.weight.is_meta:
                torch.cat([linear.weight for linear in linears], out=combined.weight.data)
                if combined.bias is not None:
                    torch.cat([linear.bias for linear in linears], out=combined.bias.data)
    combined.weight.requires_grad_(all(linear.weight.requires_grad for linear in linears))
    shared = (SharedLinear if quantizable else SharedProjection)(combined, sizes)
    views: dict[str, nn.Module] = {}
    start = 0
    for index, (name, size) in enumerate(zip(parts, sizes, strict=True)):
        views[name] = shared.view(index, start, start + size)
        start += size
    order: dict[str, nn.Module | None] = {}
    for name, child in module._modules.items():
        if name == parts[0]:
            order[fused] = shared
        order[name] = views.get(name, child)
    module._modules.clear()
    module._modules.update(order)
    record_sizes(module, fused, sizes)
    # the parts are shown already: the PEFT hook (hfpatch_core.authoring.peft) has nothing to expose
    mark_exposed(module, fused, parts)
    watch_peft()
    return sizes


def _partitioned_combination(linears: Sequence[nn.Linear], sizes: tuple[int, ...]) -> nn.Linear:
    """The fused ``nn.Linear`` of parts that DeepSpeed ZeRO-3 partitioned as they were built.

    Under ``deepspeed.zero.Init`` (``from_pretrained`` with a ZeRO-3 ``HfDeepSpeedConfig``) every
    parameter is partitioned at the end of its module's ``__init__``: each rank holds an empty
    placeholder.  The fused linear is built in the same context, so it is partitioned alike; the
    parts are gathered (a collective every rank runs, building the same modules) and rank 0's
    concatenation is spread over the ranks, so it holds what the parts held.  The random draw of
    its own initialisation is undone (``fork_rng``): a model built from a config draws what the
    original draws.
    """
    first = linears[0]
    with torch.random.fork_rng(devices=[]):
        combined = nn.Linear(
            first.in_features,
            sum(sizes),
            bias=first.bias is not None,
            device=first.weight.device,
            dtype=first.weight.dtype,
        )
    sources = [tensor for linear in linears for tensor in (linear.weight, linear.bias) if tensor is not None]
    with torch.no_grad(), gathered([*sources, combined.weight, combined.bias], modifier_rank=0):
        torch.cat([linear.weight for linear in linears], out=combined.weight.data)
        if combined.bias is not None:
            torch.cat([linear.bias for linear in linears], out=combined.bias.data)
    return combined


class FusedViewsMixin(nn.Module):
    """Mixin for any module class: fuses each group of ``nn.Linear`` children into one ``SharedProjection``.

    First among the bases, before the installed class.  ``__init__`` runs the original
    constructor, then ``fuse_as_views`` for each entry of ``hfpatch_packed_modules``
    (fused name -> part names, in row order).  ``forward`` is the original's.

    Attributes:
        hfpatch_packed_modules: fused name -> the parts (class attribute).
        hfpatch_quantizable_views: whether the fused projections are ``SharedLinear`` and
            the views ``OutputView`` (class attribute; ``fuse_as_views``'s ``quantizable``).
    """

    hfpatch_packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {}
    hfpatch_quantizable_views: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for fused, parts in type(self).hfpatch_packed_modules.items():
            fuse_as_views(self, parts, fused, quantizable=type(self).hfpatch_quantizable_views)


#: The metaclass of ``fused_views_class``'s classes (its name before it served every runtime
#: class): they pickle as the call that builds them (``hfpatch_core.authoring.classes``).
FusedClassMeta = RuntimeClassMeta


def _rebuild(
    original: type[nn.Module],
    frozen: tuple[tuple[str, tuple[str, ...]], ...],
    module: str,
    name: str,
    mixins: tuple[type, ...],
    namespace: tuple[tuple[str, Any], ...],
    quantizable: bool = False,
) -> type[nn.Module]:
    return fused_views_class(
        original,
        dict(frozen),
        module=module,
        name=name,
        mixins=mixins,
        namespace=dict(namespace),
        quantizable=quantizable,
    )


_CLASSES: dict[tuple[Any, ...], type[nn.Module]] = {}
_CLASSES_LOCK = threading.Lock()


def fused_views_class(
    original: type[nn.Module],
    groups: Mapping[str, Sequence[str]],
    *,
    module: str,
    name: str | None = None,
    mixins: Sequence[type] = (),
    namespace: Mapping[str, Any] | None = None,
    quantizable: bool = False,
) -> type[nn.Module]:
    """The subclass of ``original`` that fuses ``groups`` into shared projections, built once.

    Args:
        original: the installed class to subclass.
        groups: fused name -> the part names, in row order
            (``{"qkv_proj": ("q_proj", "k_proj", "v_proj")}``).
        module: the module the class is published in (``__module__``, and set as an
            attribute there): the pack's own module.
        name: the class name (default ``Fused<Original>``).
        mixins: further bases, after ``FusedViewsMixin`` and before ``original`` (a pack's
            class declaring ``hfpatch_fsdp_plan`` and the like).
        namespace: further class attributes (picklable values: the class pickles as
            this call).
        quantizable: build the fused projections as ``SharedLinear`` and the views as
            ``OutputView``, for a quantizer that takes every ``nn.Linear`` (a quantized
            checkpoint's load), instead of views PEFT wraps.

    Returns:
        The class; the same object for the same arguments.  Its metaclass is
        ``RuntimeClassMeta`` (``hfpatch_core.authoring.classes``; combined with ``original``'s own, if any):
        it pickles as this call.
    """
    frozen = tuple((fused, tuple(parts)) for fused, parts in groups.items())
    name = name or f"Fused{original.__name__}"
    extra = tuple(sorted((namespace or {}).items()))
    key = (original, frozen, module, name, tuple(mixins), repr(extra), quantizable)
    with _CLASSES_LOCK:
        found = _CLASSES.get(key)
        if found is None:
            attributes = {
                "__doc__": f"``{original.__name__}`` with {', '.join(f'{f} from {list(p)}' for f, p in frozen)}.",
                "hfpatch_packed_modules": dict(frozen),
                "hfpatch_quantizable_views": quantizable,
                **dict(extra),
            }
            found = runtime_class(
                name,
                (FusedViewsMixin, *mixins, original),
                attributes,
                module=module,
                rebuild=_rebuild,
                arguments=(original, frozen, module, name, tuple(mixins), extra, quantizable),
            )
            _CLASSES[key] = found
            target = sys.modules.get(module)
            if target is not None:
                setattr(target, name, found)
        return found
