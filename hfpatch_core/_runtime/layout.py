"""Making sure a patched model loads every weight and saves the original layout.

After a patched load, a module a pack touched whose checkpoint tensors the pack did not
map (a key missing and a checkpoint key unused in it) is a ``WeightLayoutError``
(transformers would only warn, leaving randomly initialised weights); weights the
checkpoint itself lacks are reported, logged and initialised as transformers does,
an error in strict mode (``check_loading_info``).  Before a patched model is saved, the
reversed conversions are run on meta tensors and the result compared with the layout
vanilla transformers gives the same config: a difference is an error instead of a
checkpoint vanilla transformers cannot read.
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .._scope import vanilla
from ..authoring.peft import concerns_adapters, watch_peft
from ..authoring.sized import PartNotInCheckpoint, parts_not_in_checkpoint
from ..conversion import pattern_regex, source_patterns_of, target_patterns_of
from ..errors import PackWarning, WeightLayoutError
from ..plan import BUILTIN, Plan, plan_of
from ..settings import strict_for
from . import provenance
from .saving import staged_save
from .state_dicts import full_shapes, guard_loading, refuse_partitioned_save, reversible_conversions
from .wrapped_saves import undo_wrapper_conversion

logger = logging.getLogger("hfpatch")

#: The attribute of a patched model saying how its save guard treats a layout it cannot check:
#: ``"strict"`` (an error), else ``True`` (a warning, unless strict mode holds: ``strict_for``).
_SAVE_GUARD = "_hfpatch_save_guard"


def _module_owners(model: nn.Module, plan: Plan) -> dict[str, str]:
    """Module path -> pack, for every module whose class a pack put there."""
    by_class = {claim.patch.replacement: claim.pack for each in plan.all_plans() for claim in each.entries}
    owners = {}
    for name, module in model.named_modules():
        pack = by_class.get(type(module))
        if pack is not None:
            owners[name] = pack
    return owners


def converter_owner(key: str, plan: Plan) -> str | None:
    """The pack whose converter's source or target patterns match ``key`` (``None``: no pack's)."""
    lists = [entries for each in plan.all_plans() for entries in each.conversions.lists.values()]
    for entries in lists:
        for entry in entries:
            if entry.origin == BUILTIN:
                continue
            for pattern in (*source_patterns_of(entry.transform), *target_patterns_of(entry.transform)):
                compiled = pattern_regex(pattern)
                if compiled is not None and compiled.search(key):
                    return str(entry.origin)
    return None


def owner_of(key: str, owners: Mapping[str, str], plan: Plan, prefix: str = "") -> str | None:
    """The pack whose patch (a replaced ancestor module) or converter touches checkpoint key ``key``."""
    candidates = [key, key.removeprefix(prefix + ".")] if prefix else [key]
    for candidate in candidates:
        parts = candidate.split(".")
        for end in range(len(parts) - 1, -1, -1):
            path = ".".join(parts[:end])
            if path in owners:
                return owners[path]
    return converter_owner(key, plan)


def _past_a_container(key: str, modules: Mapping[str, nn.Module], prefix: str) -> bool:
    """Whether ``key`` names a child a ``ModuleList`` / ``ModuleDict`` of the model does not have."""
    for candidate in (key, key.removeprefix(prefix + ".")) if prefix else (key,):
        parts = candidate.split(".")
        for end in range(len(parts) - 1, 0, -1):
            module = modules.get(".".join(parts[:end]))
            if module is not None:
                return end < len(parts) - 1 and isinstance(module, nn.ModuleList | nn.ModuleDict)
    return False


def _replaced_module(key: str, owners: Mapping[str, str], prefix: str) -> str:
    """The module a pack replaced that holds ``key`` (the key's grandparent, ``self_attn`` of
    ``self_attn.q_proj.weight``, where no ancestor was replaced: a converter's tensors)."""
    for candidate in (key, key.removeprefix(prefix + ".")) if prefix else (key,):
        parts = candidate.split(".")
        for end in range(len(parts) - 1, -1, -1):
            if ".".join(parts[:end]) in owners:
                return ".".join(parts[:end])
    return key.rsplit(".", 2)[0]


#: transformers' flag on a tensor it loaded or initialised, which its init functions skip.
_INITIALIZED = "_is_hf_initialized"


def _initialise_parts(model: nn.Module, parts: list[PartNotInCheckpoint]) -> None:
    """Initialise each part of a fused parameter the checkpoint lacked as vanilla transformers
    initialises that weight: the model's ``_init_weights`` on the module the checkpoint key
    names (``self_attn.k_proj``, a view of its rows of the fused ``qkv_proj`` in a fused
    model), else on the fused parameter's module; only the part's rows are kept.  Rows that
    neither rule writes (a module the model's rule does not know) stay zero.
    """
    for part in parts:
        try:
            fused = model.get_parameter(part.target)
        except AttributeError:
            continue
        if fused.is_meta:
            continue  # offloaded (device_map "disk"): nor are transformers' own missing weights there
        before = fused.detach().clone()
        rows = fused.detach().narrow(part.dim, part.start, part.size)
        rows.fill_(float("nan"))
        flagged = getattr(fused, _INITIALIZED, False)
        if flagged:
            delattr(fused, _INITIALIZED)
        try:
            with torch.no_grad():
                for path in (part.key.rpartition(".")[0], part.target.rpartition(".")[0]):
                    try:
                        module = model.get_submodule(path)
                    except AttributeError:
                        continue
                    init_weights: Any = model._init_weights  # PreTrainedModel's (torch types it as a tensor)
                    init_weights(module)
                    if not bool(torch.isnan(rows).any()):
                        break
        finally:
            if flagged:
                setattr(fused, _INITIALIZED, True)
        with torch.no_grad():
            initialised = torch.nan_to_num(rows, nan=0.0)
            fused.copy_(before)
            fused.narrow(part.dim, part.start, part.size).copy_(initialised)


def _add_missing(info: Mapping[str, Any], keys: list[str]) -> None:
    """Add ``keys`` to the ``missing_keys`` of transformers' loading info (a set in 5.25, a list in 5.3)."""
    if not keys:
        return
    missing = info.get("missing_keys")
    if isinstance(missing, set):
        missing.update(keys)
    elif isinstance(missing, list):
        missing.extend(key for key in keys if key not in missing)
    elif isinstance(info, dict):
        info["missing_keys"] = set(keys)


def _spelled(model: nn.Module, key: str) -> str:
    """How the checkpoint spells the model's ``key`` where it spells it otherwise (`` (checkpoint
    keys: ...)``), else ``""``: the model's conversions reversed on one meta tensor, as
    ``save_pretrained`` reverses them (``qkv_proj.weight`` -> ``q_proj`` / ``k_proj`` / ``v_proj``;
    mixtral's ``mlp.experts.0.w1.weight`` -> ``block_sparse_moe.experts.0.w1.weight``)."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        shape = tuple(model.get_parameter(key).shape)
    except AttributeError:
        shape = (0,)  # a part of a fused parameter: no parameter of the model has its name
    try:
        names = list(revert_weight_conversion(model, {key: torch.empty(shape, device="meta")}))  # type: ignore[arg-type]
    except Exception:  # a conversion that cannot run on one meta tensor: the model's name alone
        return ""
    if not names or names == [key]:
        return ""
    return f" (checkpoint key{'s' if len(names) > 1 else ''}: {', '.join(names)})"


def check_loading_info(model: nn.Module, plan: Plan, info: Mapping[str, Any], *, strict: bool = True) -> None:
    """Check every key transformers reports missing, unexpected or mismatched that a pack is responsible for.

    A module with a key missing *and* a key of the checkpoint left unused is the pack's
    failure: the checkpoint holds the module's tensors and the pack did not map them (no
    converter, or patterns that miss): always a ``WeightLayoutError``.  Otherwise the
    checkpoint itself lacks the weights, which vanilla transformers reports in
    ``missing_keys`` (``output_loading_info=True``), logs and initialises: the same here,
    with a warning on the ``hfpatch`` logger naming the pack, unless ``strict``
    (``HF_PATCH_STRICT=1``, ``enable(strict=True)``) makes it an error.  A fused weight
    some of whose parts are not in the checkpoint (``k_proj`` of a ``qkv_proj``) is
    loaded as vanilla loads the unfused ones: the parts it has, the others initialised
    by ``SizedConcatenate``, whose checkpoint keys are added to ``missing_keys`` here
    (``info`` is the loading info the caller gets) and reported as the others are.

    Raises:
        WeightLayoutError: a module the pack did not map, or ``strict`` and any reported key.
    """
    parts = parts_not_in_checkpoint(model)
    _initialise_parts(model, parts)
    _add_missing(info, [part.key for part in parts])
    kinds = ("missing_keys", "unexpected_keys", "mismatched_keys")
    if not any(info.get(kind) for kind in kinds):
        return  # the usual case: nothing to attribute, so no walk over the model
    owners = _module_owners(model, plan)
    prefix = getattr(model, "base_model_prefix", "") or ""
    modules = dict(model.named_modules())
    found: list[tuple[str, str, str, str]] = []  # (kind, key, label, pack)
    for kind, label in (
        ("missing_keys", "missing from the checkpoint (left randomly initialised)"),
        ("unexpected_keys", "in the checkpoint but not used by the model"),
        ("mismatched_keys", "of a different shape in the checkpoint"),
    ):
        for entry in sorted(info.get(kind) or (), key=str):
            key = entry[0] if isinstance(entry, tuple) else str(entry)
            if _past_a_container(key, modules, prefix):
                continue  # e.g. layer 3 of a checkpoint loaded with num_hidden_layers=2: not a pack's doing
            pack = owner_of(key, owners, plan, prefix)
            if pack is not None:
                found.append((kind, key, label, pack))
    if not found:
        return
    missing_in = {_replaced_module(key, owners, prefix) for kind, key, _, _ in found if kind == "missing_keys"}
    unmapped = any(
        kind == "unexpected_keys" and _replaced_module(key, owners, prefix) in missing_in for kind, key, _, _ in found
    )
    problems = [f"{key}: {label}; touched by pack {pack!r}" for _, key, label, pack in found]
    problems[:20] = [
        f"{key}{_spelled(model, key)}: {label}; touched by pack {pack!r}" for _, key, label, pack in found[:20]
    ]
    shown = "\n  ".join(problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    if unmapped:
        raise WeightLayoutError(
            f"{type(model).__name__}: the patched model does not match the checkpoint ({len(problems)} keys):\n"
            f"  {shown}{more}\nThe pack needs a converter (provide_converters) that maps these checkpoint "
            "tensors onto its modules, or a patch that keeps the original parameter names and shapes."
        )
    if strict:
        raise WeightLayoutError(
            f"{type(model).__name__}: the checkpoint lacks weights of modules a pack replaced ({len(problems)} "
            f"keys):\n  {shown}{more}\nVanilla transformers would load it and initialise them; strict mode "
            "(HF_PATCH_STRICT=1) makes it an error."
        )
    logger.warning(
        "hfpatch: %s: the checkpoint lacks weights of modules a pack replaced (%d keys), reported in the loading "
        "info and initialised as transformers does (HF_PATCH_STRICT=1 makes this an error):\n  %s%s",
        type(model).__name__,
        len(problems),
        shown,
        more,
    )


def _meta_state_dict(model: Any) -> dict[str, torch.Tensor]:
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    shapes = full_shapes(model)  # a ZeRO-3 partitioned parameter's whole shape, not its placeholder's
    state = {
        key: torch.empty(shapes[key], dtype=value.dtype, device="meta") for key, value in model.state_dict().items()
    }
    # transformers 5.3 looks every key up as a parameter: pass the parameters only, then
    # add the (persistent) buffers back, which are never tied
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    kept = dict(remove_tied_weights_from_state_dict({k: v for k, v in state.items() if k in parameters}, model))
    return {key: value for key, value in state.items() if key in kept or key not in parameters}


def _original_class(model: nn.Module, plan: Plan) -> type:
    cls = type(model)
    for name, claim in plan.replaced.items():
        if claim.patch.replacement is cls:
            original = getattr(sys.modules.get(cls.__module__), name, None) or getattr(
                sys.modules.get(cls.__mro__[1].__module__), name, None
            )
            if isinstance(original, type):
                return original
    return cls


def vanilla_layout(model: nn.Module, plan: Plan) -> dict[str, tuple[int, ...]]:
    """Names and shapes vanilla transformers saves for a model of this class and config (on meta tensors)."""
    with vanilla(), torch.device("meta"):
        original = _original_class(model, plan)(copy.deepcopy(model.config))
    return planned_save_layout(original)


def planned_save_layout(model: Any) -> dict[str, tuple[int, ...]]:
    """Names and shapes ``save_pretrained`` would write, computed on meta tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(model, _meta_state_dict(model))
    return {key: tuple(value.shape) for key, value in reverted.items()}


def layout_differences(
    written: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], *, quantized: bool = False
) -> list[str]:
    """What differs between the layout a save would write and vanilla's.  For a ``quantized``
    model only vanilla's weights that would be missing count: a quantizer adds tensors
    (scales, zero points) and may pack weights into other shapes."""
    problems = []
    # a quantizer may write a weight under names of its own: compressed-tensors' integer schemes
    # save ``X.weight`` as ``X.weight_packed`` (with ``X.weight_scale``, ``X.weight_shape``)
    stored_as = {key.rsplit("_", 1)[0] for key in written if "." in key and "_" in key.rsplit(".", 1)[1]}
    for key in sorted(set(written) | set(expected)):
        if key not in expected:
            if not quantized:
                problems.append(f"{key}: would be written, vanilla transformers has no such weight")
        elif key not in written:
            if quantized and key in stored_as:
                continue
            problems.append(f"{key}: vanilla transformers expects it, it would not be written")
        elif written[key] != expected[key] and not quantized:
            problems.append(f"{key}: would be written as {written[key]}, the original layout is {expected[key]}")
    return problems


_QUANTIZED_DTYPES = frozenset(
    dtype
    for name in ("int8", "uint8", "int4", "uint4", "float8_e4m3fn", "float8_e5m2")
    if (dtype := getattr(torch, name, None))
)


def _quantized(model: nn.Module) -> bool:
    """Whether a quantizer has been at the model (transformers' own, or one such as llm-compressor)."""
    if getattr(model, "hf_quantizer", None) is not None:
        return True
    if getattr(getattr(model, "config", None), "quantization_config", None) is not None:
        return True
    # compressed-tensors (llm-compressor) marks the modules it quantizes; the weights stay float
    # until its save compresses them
    if any(getattr(module, "quantization_scheme", None) is not None for module in model.modules()):
        return True
    return any(tensor.dtype in _QUANTIZED_DTYPES for tensor in model.state_dict().values())


def verify_save_layout(model: nn.Module, plan: Plan, *, strict: bool = False) -> None:
    """Raise ``WeightLayoutError`` if saving ``model`` would not write the original layout.

    A conversion that refuses (a ``WeightLayoutError``: a quantized tensor a pack cannot
    split back) is raised as it is; one that cannot run on meta tensors at all is a
    ``PackWarning`` and the save goes on unchecked, unless ``strict``.
    """
    try:
        written = planned_save_layout(model)
        expected = vanilla_layout(model, plan)
    except WeightLayoutError:
        raise
    except Exception as exc:  # an operation that cannot run on meta tensors
        message = (
            f"hfpatch could not check the layout {type(model).__name__} will be saved in ({type(exc).__name__}: {exc})"
        )
        if strict:
            raise WeightLayoutError(f"{message}; strict mode (HF_PATCH_STRICT=1) refuses to save unchecked.") from exc
        warnings.warn(f"{message}; saving without the check.", PackWarning, stacklevel=3)
        return
    problems = layout_differences(written, expected, quantized=_quantized(model))
    if problems:
        owners = _module_owners(model, plan)
        prefix = getattr(model, "base_model_prefix", "") or ""
        described = []
        for problem in problems[:20]:
            pack = owner_of(problem.split(":")[0], owners, plan, prefix)
            described.append(problem + (f" (pack {pack!r})" if pack else ""))
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise WeightLayoutError(
            f"refusing to save {type(model).__name__}: the packs' conversions do not reverse to the original "
            f"layout ({len(problems)} weights):\n  " + "\n  ".join(described) + more + "\nUse an exactly "
            "reversible operation (hfpatch_core.conversion.SizedConcatenate / SizedSplit) in the pack's "
            "converter, or save with save_original_format=False to write the patched layout."
        )


def _guarded_save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return _checked_save(self, *args, **kwargs)
    except BaseException as error:
        undo_wrapper_conversion(self, error)
        raise


def _checked_save(self: Any, *args: Any, **kwargs: Any) -> Any:
    plan = plan_of(self)
    parallel = plan.context.parallel if plan is not None and plan.context is not None else ()
    # FSDP2 alone gathers each parameter whole, and a fused one whole is the fused layout (the
    # converter gave each rank its cut of it): the reverse conversion splits it as in one process.
    by_share = [mode for mode in parallel if mode != "fsdp"]
    if plan is not None and by_share and plan.touches_weights:
        # every rank refuses alike (the plan is the same on all), before any collective of the save
        raise WeightLayoutError(
            f"refusing to save {type(self).__name__}: it was loaded sharded ({', '.join(parallel)}) with packs "
            "that convert weights, whose fused tensors hold each rank's share of every part; gathered, they "
            "are not the fused layout the reverse conversion splits. Save from a load on one process (the "
            "same checkpoint, without tp_plan / distributed_config), or from one sharded by FSDP2 alone."
        )
    refuse_partitioned_save(self, kwargs.get("state_dict", args[2] if len(args) > 2 else None))
    # with PEFT adapters loaded (add_adapter), transformers writes the adapter alone, as it is
    peft = getattr(self, "_hf_peft_config_loaded", False)
    strict = getattr(self, _SAVE_GUARD, None) == "strict" or strict_for(self)
    if plan is not None and kwargs.get("save_original_format", True) and not peft:
        verify_save_layout(self, plan, strict=strict)
    directory = args[0] if args else kwargs.get("save_directory")
    if directory is None:
        return type(self).save_pretrained(self, *args, **kwargs)
    result = staged_save(
        self, directory, args[1:] if args else (), {k: v for k, v in kwargs.items() if k != "save_directory"}
    )
    if plan is not None and kwargs.get("is_main_process", True):
        provenance.write(directory, plan)
    return result


class SaveGuard:
    """A patched model's ``save_pretrained``: the layout check, then the class's own save.

    It behaves as a bound method (``__self__``, ``__func__``), because tools that wrap
    ``save_pretrained`` rebind it that way (llm-compressor's ``modify_save_pretrained``
    calls ``__func__.__get__(model)``), and it pickles with the model (``torch.save``),
    which a bound method of a function the class does not have would not.
    """

    __slots__ = ("__self__",)
    __func__ = staticmethod(_guarded_save_pretrained)

    def __init__(self, model: nn.Module) -> None:
        self.__self__ = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _guarded_save_pretrained(self.__self__, *args, **kwargs)

    def __reduce__(self) -> tuple[type, tuple[nn.Module]]:
        return (SaveGuard, (self.__self__,))


def guard_saving(model: nn.Module, plan: Plan, *, strict: bool = False) -> None:
    """Make ``model.save_pretrained`` check the layout first (this instance only); ``strict``: a
    layout it cannot check is an error, not a warning."""
    if not plan.touches_weights:
        return
    object.__setattr__(model, "save_pretrained", SaveGuard(model))
    object.__setattr__(model, _SAVE_GUARD, "strict" if strict else True)


def _signature(transform: Any) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    return type(transform).__name__, tuple(source_patterns_of(transform)), tuple(target_patterns_of(transform))


def _save_with_all_conversions(model: nn.Module, recorded: list[Any]) -> None:
    """Make a patched model loaded from a checkpoint save the original layout whatever layout it loaded.

    transformers records the conversions a load *used*, and a save reverses only those: a
    checkpoint already in the model's layout (``save_pretrained(save_original_format=False)``,
    ``from_pretrained(None, state_dict=model.state_dict())``: mixtral's stacked experts) used
    none of its stacking and renamings, or only a pack's split of it, and would be saved in
    neither layout, which the save guard refuses.  Where the recorded conversions are some of
    the model's own (nothing else: no prefix change, no user ``key_mapping``), the model saves
    with all of them reversed, as one built from its config does: the original layout.
    """
    every = reversible_conversions(model)
    known = {_signature(transform) for transform in every}
    subset = len(recorded) < len(every) and all(_signature(transform) in known for transform in recorded)
    if subset and not _quantized(model):  # a quantizer's conversions are not among the model's own
        object.__setattr__(model, "_weight_conversions", every)


def secure(model: nn.Module, plan: Plan, loading_info: Mapping[str, Any] | None, *, strict: bool = True) -> None:
    """What a patched root model gets once built: every weight a pack touches checked
    (``loading_info`` of ``from_pretrained``; ``None`` for a model built from a config,
    which instead keeps the conversions its save must reverse), the save guard, a
    ``load_state_dict`` that takes the original layout (also with no pack applied, where
    the load ran transformers' own conversions), and, where a replacement declares packed
    modules or ``hfpatch_hidden_from_adapters``, PEFT's injection hooked (``adapters``).
    ``strict``: weights the checkpoint lacks are an error, not a warning (``check_loading_info``)."""
    recorded = getattr(model, "_weight_conversions", None)
    if loading_info is None and plan.conversions and recorded is None:
        object.__setattr__(model, "_weight_conversions", reversible_conversions(model))
    elif loading_info is not None and plan.touches_weights and recorded is not None:
        _save_with_all_conversions(model, recorded)
    if loading_info is not None and plan.touches_weights:
        # after the conversions are settled: its messages spell keys as the checkpoint does, through them
        check_loading_info(model, plan, loading_info, strict=strict)
    guard_saving(model, plan, strict=strict)
    # Trainer's resume loads the original layout (hfpatch_core._runtime.state_dicts): a model a pack
    # touched needs it, and so does one whose load ran transformers' own conversions (5.25
    # stacks Qwen2-MoE's experts), which vanilla load_state_dict drops
    if plan.touches_weights or getattr(model, "_weight_conversions", None):
        guard_loading(model)
    if concerns_adapters([claim.patch.replacement for each in plan.all_plans() for claim in each.entries]):
        watch_peft()  # adapters name the original projections and modules (hfpatch_core.authoring.peft)
