"""Patching a model that is already built: ``apply(model)`` and ``revert(model)``.

``apply`` gives a model built without hfpatch (loaded earlier, built by hand, trained
for a while) what a load with the packs would have given it.  It plans exactly as that
load would (``Session.plan`` through the loader, with the model's own class and config,
so the same plan and fingerprint), and then gets the weights there the way the load
would: the live weights are written out in checkpoint layout
(``revert_weight_conversion``, what ``save_pretrained`` does) and loaded by
transformers' own loader with the packs enabled (``from_pretrained(None, config=...,
state_dict=...)``), so the packs' converters run in their forward direction.  Only the
submodules a pack replaced are moved from that temporary model into the user's model;
every other module keeps its identity, and the load shares their tensors instead of
copying them.

``revert`` runs the same steps backwards: the patched weights in checkpoint layout
(the packs' conversions reversed, as a save would), loaded by vanilla transformers,
and the original classes moved back in.

A PEFT model is patched in the transformers model inside it, around its adapters
(``adapter_layers``): the weights are written out without them, and a module that holds
adapter layers is not swapped but refused.

Everything that can refuse runs before the model is touched, and the swap itself is
undone if it fails half-way: the model is either patched or as it was.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from .._runtime.frames import blame
from .._runtime.layout import secure
from .._runtime.peft_layers import base_model_of, plain_state, refuse_adapters
from .._runtime.steps import deferred, install_steps, installed_on, uninstall_steps
from .._scope import LOAD_LOCK, vanilla
from ..authoring.randomness import isolated_rng
from ..errors import ApplyError, HfPatchError
from ..plan import PLAN_ATTRIBUTE, Claim, Plan, plan_of
from .announcement import announce
from .loaders import attach, disable, install
from .manual import patched
from .session import Session, activate, active_session, new_session

#: The attribute of a model ``apply`` patched that holds what ``revert`` needs.
APPLIED_ATTRIBUTE = "_hfpatch_applied"

#: Instance attributes ``apply`` sets on the model, put back (or removed) by ``revert``.
_MODEL_ATTRIBUTES = (
    PLAN_ATTRIBUTE,
    "_weight_conversions",
    "save_pretrained",
    "_hfpatch_save_guard",
    "load_state_dict",
    "_hfpatch_load_guard",
)

_MISSING: Any = object()

#: Dtypes a quantizer stores weights in; no converter can carry those over.
_QUANTIZED_DTYPES = frozenset(
    {torch.int8, torch.uint8, *(value for name, value in vars(torch).items() if name.startswith("float8_"))}
)

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """What a parameter was before a swap: restored on the one that takes its place."""

    dtype: torch.dtype
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Swap:
    """One submodule ``apply`` replaced.

    Attributes:
        path: where it sits in the model (``"model.layers.0.self_attn"``).
        original: the class it had.
        replacement: the class it has now.
        pack: the pack whose claim put the replacement there.
        parameters: each original parameter (relative name) with its dtype and ``requires_grad``.
    """

    path: str
    original: type
    replacement: type
    pack: str
    parameters: Mapping[str, _Tensor]


@dataclasses.dataclass(frozen=True)
class Applied:
    """What ``apply`` did to one model, kept on it (``APPLIED_ATTRIBUTE``) for ``revert``."""

    plan: Plan
    swaps: tuple[Swap, ...]
    attributes: Mapping[str, Any]


# --- the public functions ------------------------------------------------------------------


def apply(model: nn.Module, packs: str | Iterable[str] | None = None, strict: bool | None = None) -> Plan:
    """Patch a model that is already built, as loading its checkpoint with the packs would have.

    Called on a model hfpatch did not load (built by hand, loaded before ``enable()``, or
    trained for a while).  The selected packs are gathered and resolved for the model's own
    class and config, exactly as a load would (same plan, same fingerprint); each submodule
    a winning claim replaces is swapped for an instance of its replacement, its weights
    carried over through the pack's converters.  Every other module stays the same object.
    The packs' model steps (``ModelStep``) are installed on the model last, as a load
    installs them.  The swapped modules keep the dtype, device, ``requires_grad`` and training mode of the
    ones they replace, ties between parameters are kept, and the model saves in the
    original layout (the save guard of a patched load).  Build optimizers after ``apply``:
    the swapped modules have new parameters.

    A PEFT model (``PeftModel``, or a model with adapters from ``add_adapter``) is patched
    in its base model: modules that hold no adapter layer are swapped, and the adapters
    stay as they are (weights, ``requires_grad``, what the adapter's ``save_pretrained``
    writes).

    Args:
        model: a ``PreTrainedModel`` on one device, not quantized, not sharded, or a PEFT
            model wrapping one.
        packs: which packs, in ``HF_PATCH_PACKS`` syntax; ``None``: the session
            ``enable()`` started, else ``HF_PATCH_PACKS``.
        strict: make every pack failure an error; ``None``: as the session, else
            ``HF_PATCH_STRICT``.

    Returns:
        The plan (also ``plan_of(model)``).  A plan that replaces no submodule of the
        model leaves it as it was.

    Raises:
        ApplyError: the model cannot be patched in place (already patched, quantized, on
            the meta device, sharded, on several devices), a pack's replacement changes
            parameters without a converter to carry them over, or a module to replace
            holds PEFT adapter layers; the message names the pack and the reason.  The
            model is unchanged.
        SelectionError, PackError, PatchConflictError: as for a load.
    """
    model = base_model_of(model)
    _refuse_model(model)
    _device_of(model)
    session = _session_for(packs, strict)
    # patching in place draws nothing a seeded program sees: what the packs' code draws is undone
    with LOAD_LOCK, _no_autograd(), _in_force(session), isolated_rng(None):
        config = copy.deepcopy(model.config)
        with patched(config, model_class=type(model)) as planned, torch.device("meta"):
            try:
                skeleton = type(model)(config)
            except HfPatchError:
                raise
            except Exception as exc:
                blamed = blame(exc, planned)
                if blamed is None:
                    raise
                raise blamed from exc
        # the block's plan and those of the sub-models built inside it (a composite model's text
        # model is built by a from_config of its own, whose patches only this holds)
        planned = plan_of(skeleton) or planned
        swaps = _swaps(model, skeleton, planned)
        if not swaps:
            if not planned.steps:
                return planned
            attributes = {name: model.__dict__.get(name, _MISSING) for name in _MODEL_ATTRIBUTES}
            plan = install_steps(model, planned, session.report)
            attach(model, plan)
            announce(plan)
            object.__setattr__(model, APPLIED_ATTRIBUTE, Applied(plan=plan, swaps=(), attributes=attributes))
            return plan
        for path, claim, replacement in swaps:
            _refuse_module(model, path, claim, replacement, planned)
        temporary, plan = _load(model, swaps, session)
        replacements = _swaps(model, temporary, plan)
        for path, claim, replacement in replacements:
            _refuse_module(model, path, claim, replacement, plan, converted=True)
        record = Applied(
            plan=plan,
            swaps=tuple(_swap_record(model, path, claim) for path, claim, _ in replacements),
            attributes={name: model.__dict__.get(name, _MISSING) for name in _MODEL_ATTRIBUTES},
        )
        modules = {path: module for path, _, module in replacements}
        undo = _transplant(model, modules, restore=None)
        try:
            object.__setattr__(model, "_weight_conversions", getattr(temporary, "_weight_conversions", None))
            attach(model, plan)
            secure(model, plan, None)  # what a patched load gets: the save and load_state_dict guards
            object.__setattr__(model, APPLIED_ATTRIBUTE, record)
            # the steps run on the user's model, once its modules are the packs'
            plan = install_steps(model, plan, session.report)
            attach(model, plan)
            announce(plan)
        except BaseException:
            _undo_attributes(model, record)
            undo()
            raise
    return plan


def revert(model: nn.Module) -> None:
    """Give a model ``apply`` patched its original classes back, with its current weights.

    The swapped modules' weights (trained since ``apply`` or not) are converted back to
    the original layout through the packs' conversions reversed, as ``save_pretrained``
    does, and loaded into new instances of the original classes by vanilla transformers.
    Where the conversions are exact (``SizedConcatenate``, transformers' expert fusion),
    ``state_dict()`` then has the same keys, shapes, dtypes and values as before ``apply``.
    The packs' model steps (``ModelStep``) are uninstalled first.  On a model a load with
    packs returned, ``revert`` uninstalls its model steps only (its classes stay as loaded).

    Raises:
        ApplyError: ``model`` was not patched by ``apply`` and holds no model step, a swapped module was replaced
            since, or PEFT adapter layers were added into one; the model is unchanged.
    """
    model = base_model_of(model)
    record = getattr(model, APPLIED_ATTRIBUTE, None)
    if not isinstance(record, Applied):
        if installed_on(model):  # a load's model steps: its classes stay as the load built them
            uninstall_steps(model)
            loaded = plan_of(model)
            if loaded is not None:  # the plan of what the model now is: the load's, without its steps
                object.__setattr__(model, PLAN_ATTRIBUTE, dataclasses.replace(loaded, steps=(), lost_steps=()))
            return
        raise ApplyError(f"{type(model).__name__} was not patched by hfpatch_core.apply(): nothing to revert")
    if not record.swaps:  # model steps only: nothing to load back
        uninstall_steps(model)
        _undo_attributes(model, record)
        return
    refuse_adapters(model, [(swap.path, swap.pack) for swap in record.swaps], after=True)
    for swap in record.swaps:
        current = _submodule(model, swap.path)
        if type(current) is not swap.replacement:
            found = type(current).__name__ if current is not None else "nothing"
            raise ApplyError(
                f"cannot revert {type(model).__name__}: {swap.path} holds {found}, not the "
                f"{swap.replacement.__name__} pack {swap.pack!r} put there"
            )
    with LOAD_LOCK, _no_autograd(), isolated_rng(None):
        state = _checkpoint_state(model)
        with vanilla():
            temporary, info = _from_state_dict(model, state)
        _check_loaded(model, info, record.swaps, what="the original classes")
        modules = {}
        for swap in record.swaps:
            module = temporary.get_submodule(swap.path)
            if type(module) is not swap.original:
                raise ApplyError(
                    f"cannot revert {swap.path}: vanilla transformers builds {type(module).__name__} there, "
                    f"not {swap.original.__name__} (is a patch registered with register_patch_mapping?)"
                )
            modules[swap.path] = module
        uninstall_steps(model)
        _transplant(model, modules, restore=record)
        _undo_attributes(model, record)


def applied_to(model: nn.Module) -> Applied | None:
    """What ``apply`` did to ``model`` (the swaps and the plan), or ``None``."""
    record = getattr(model, APPLIED_ATTRIBUTE, None)
    return record if isinstance(record, Applied) else None


# --- planning and loading ------------------------------------------------------------------


def _session_for(packs: str | Iterable[str] | None, strict: bool | None) -> Session:
    active = active_session()
    if packs is None and active is not None and strict in (None, active.strict):
        return active
    session = new_session(packs, strict)
    session.report(session.selection.problems)
    return session


@contextmanager
def _no_autograd() -> Iterator[None]:
    """No graph recorded, and normal tensors even inside ``torch.inference_mode()``: the
    swapped-in parameters are the model's own from then on, and an inference tensor could
    never be trained."""
    with torch.inference_mode(False), torch.no_grad():
        yield


@contextmanager
def _in_force(session: Session) -> Iterator[None]:
    """``session`` the one loads use, for the block (the load lock held by the caller)."""
    previous = active_session()
    if previous is session:
        yield
        return
    if previous is None:
        install(session)
        try:
            yield
        finally:
            disable()
        return
    activate(session)
    try:
        yield
    finally:
        activate(previous)


def _checkpoint_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights in checkpoint layout, as ``save_pretrained`` writes them (its conversions reversed)."""
    from transformers.core_model_loading import revert_weight_conversion

    # without PEFT's adapter layers: the keys the checkpoint has, whatever adapters the model holds
    state: dict[str, torch.Tensor] = revert_weight_conversion(model, plain_state(model))
    return state


def _from_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[nn.Module, Mapping[str, Any]]:
    """``type(model)`` loaded by transformers' loader from ``state`` (on the model's device and dtype)."""
    kwargs: dict[str, Any] = {"dtype": getattr(model, "dtype", None) or torch.get_default_dtype()}
    device = _device_of(model)
    if device is not None and device.type != "cpu":
        kwargs["device_map"] = {"": device}
    loaded: Any = type(model).from_pretrained(  # type: ignore[attr-defined]
        None, config=copy.deepcopy(model.config), state_dict=state, output_loading_info=True, **kwargs
    )
    temporary, info = loaded
    temporary.train(model.training)
    return temporary, info


def _load(model: nn.Module, swaps: list[tuple[str, Claim, nn.Module]], session: Session) -> tuple[nn.Module, Plan]:
    """The model loaded with the packs from its own weights in checkpoint layout, and its plan."""
    state = _checkpoint_state(model)
    packs = sorted({claim.pack for _, claim, _ in swaps})
    try:
        with deferred():  # the steps are installed on the user's model, not on this temporary one
            temporary, _info = _from_state_dict(model, state)
    except HfPatchError as exc:
        raise ApplyError(
            f"cannot apply pack(s) {', '.join(map(repr, packs))} to {type(model).__name__}: {exc}"
        ) from exc
    plan = plan_of(temporary)
    if plan is None:  # pragma: no cover - the loader always enters apply_patches
        raise ApplyError(f"{type(model).__name__}: the packs' load made no plan")
    return temporary, plan


def _check_loaded(model: nn.Module, info: Mapping[str, Any], swaps: Iterable[Swap], *, what: str) -> None:
    paths = [swap.path for swap in swaps]
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        for entry in info.get(kind) or ():
            key = entry[0] if isinstance(entry, tuple) else str(entry)
            if any(key == path or key.startswith(path + ".") for path in paths):
                problems.append(f"{key} ({kind.replace('_', ' ')[:-1]})")
    if problems:
        raise ApplyError(
            f"cannot revert {type(model).__name__}: the weights do not load into {what}: " + ", ".join(problems[:10])
        )


# --- what is swapped, and what refuses -----------------------------------------------------


def _claims_by_class(plan: Plan) -> dict[type, Claim]:
    return {claim.patch.replacement: claim for each in plan.all_plans() for claim in each.entries}


def _swaps(model: nn.Module, built: nn.Module, plan: Plan) -> list[tuple[str, Claim, nn.Module]]:
    """``(path, claim, module of built)`` for each outermost module of ``built`` whose class a claim put there."""
    claims = _claims_by_class(plan)
    live = dict(model.named_modules())
    found: list[tuple[str, Claim, nn.Module]] = []
    for path, module in built.named_modules():
        claim = claims.get(type(module))
        if claim is None or any(path.startswith(done + ".") for done, _, _ in found):
            continue
        found.append((path, claim, module))
    # before "no module there": inside a PEFT wrapper the original sits one level down
    refuse_adapters(model, [(p, c.pack) for p, c, _ in found if p])
    for path, claim, module in found:
        original = live.get(path)
        if original is None or not path:
            raise ApplyError(
                f"cannot apply pack {claim.pack!r} to {type(model).__name__}: it replaces the module at "
                f"{path or 'the root'!r} with {type(module).__name__}, and "
                + ("hfpatch does not replace the model itself" if not path else "the model has no module there")
                + " (was the model changed after it was built?)"
            )
    return found


def _refuse_model(model: nn.Module) -> None:
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise ApplyError(f"hfpatch_core.apply() takes a transformers PreTrainedModel (or a PEFT model), not {name}")
    if isinstance(getattr(model, APPLIED_ATTRIBUTE, None), Applied):
        raise ApplyError(f"{name} is already patched by hfpatch_core.apply(); revert() it first")
    loaded = plan_of(model)
    if installed_on(model):
        steps = ", ".join(f"{claim.target} of pack {claim.pack!r}" for claim in installed_on(model))
        raise ApplyError(f"{name} holds model steps already ({steps}); hfpatch_core.revert() it first")
    if loaded is not None and loaded.entries:
        raise ApplyError(f"{name} was loaded with packs already ({loaded.summary()}); load it without hfpatch")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        size = torch.distributed.get_world_size()
        if size > 1:
            raise ApplyError(
                f"{name}: torch.distributed runs with {size} ranks, and a model sharded across ranks cannot be "
                "converted in place; load the checkpoint with the packs enabled on every rank (hfpatch run)"
            )
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "is_quantized", False):
        raise ApplyError(
            f"{name} is quantized: its weights cannot be converted in place; load the checkpoint with the packs "
            "enabled and the quantization config instead"
        )


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _tensor_problem(tensor: torch.Tensor) -> str | None:
    if tensor.device.type == "meta":
        return "on the meta device (no values to convert)"
    if _is_dtensor(tensor):
        return "a DTensor (sharded across ranks)"
    if tensor.dtype in _QUANTIZED_DTYPES or type(tensor) not in (nn.Parameter, torch.Tensor):
        return f"quantized ({type(tensor).__name__} of {tensor.dtype})"
    return None


def _refuse_module(
    model: nn.Module, path: str, claim: Claim, replacement: nn.Module, plan: Plan, *, converted: bool = False
) -> None:
    """Raise ``ApplyError`` if the module at ``path`` cannot be swapped for ``replacement``."""
    original = model.get_submodule(path)
    where = f"pack {claim.pack!r} cannot replace {type(original).__name__} at {path}"
    tensors = [*original.named_parameters(), *original.named_buffers()]
    for name, tensor in tensors:
        problem = _tensor_problem(tensor)
        if problem is not None:
            raise ApplyError(f"{where}: {name} is {problem}")
    if converted:
        return
    before = {name: tuple(p.shape) for name, p in original.named_parameters()}
    after = {name: tuple(p.shape) for name, p in replacement.named_parameters()}
    if before == after:
        return
    converts = any(conversion.pack == claim.pack for each in plan.all_plans() for conversion in each.conversions.claims)
    if not converts:
        changed = sorted(set(before) ^ set(after)) or sorted(k for k in before if before[k] != after.get(k))
        raise ApplyError(
            f"{where}: {type(replacement).__name__} has other parameters ({', '.join(changed[:6])}) and the pack "
            "provides no converter (provide_converters) to carry the weights over"
        )


def _device_of(model: nn.Module) -> torch.device | None:
    devices = {tensor.device for tensor in (*model.parameters(), *model.buffers())}
    if len(devices) > 1:
        shown = ", ".join(sorted(map(str, devices)))
        raise ApplyError(
            f"{type(model).__name__} is spread over several devices ({shown}); hfpatch converts a model on one "
            "device: move it to one, or load the checkpoint with the packs and a device_map"
        )
    return next(iter(devices), None)


def _swap_record(model: nn.Module, path: str, claim: Claim) -> Swap:
    original = model.get_submodule(path)
    return Swap(
        path=path,
        original=type(original),
        replacement=claim.patch.replacement,
        pack=claim.pack,
        parameters={
            name: _Tensor(p.dtype, p.requires_grad) for name, p in original.named_parameters(remove_duplicate=False)
        },
    )


# --- the swap itself -----------------------------------------------------------------------


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


def _ties(model: nn.Module) -> list[list[str]]:
    """The names of each group of parameters that are one tensor (tied weights)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _inside(name: str, paths: Iterable[str]) -> bool:
    return any(name.startswith(path + ".") for path in paths)


def _prepare(
    model: nn.Module, path: str, original: nn.Module, module: nn.Module, restore: Swap | None, keep: set[int]
) -> None:
    """Make ``module`` take ``original``'s place: tensors of its own, dtypes, ``requires_grad``,
    training mode, hooks and non-persistent buffers as the module it replaces had."""
    before = dict(original.named_parameters(remove_duplicate=False))
    trainable = any(p.requires_grad for p in before.values()) if before else True
    wanted: Mapping[str, _Tensor] = (
        restore.parameters
        if restore is not None
        else {name: _Tensor(p.dtype, p.requires_grad) for name, p in before.items()}
    )
    for name, parameter in list(module.named_parameters(remove_duplicate=False)):
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        spec = wanted.get(name)
        data = parameter.detach()
        if spec is not None and data.dtype != spec.dtype:
            data = data.to(spec.dtype)
        if data.untyped_storage().data_ptr() in keep:
            data = data.clone()  # the load shares the live tensors: this one must be the module's own
        requires_grad = spec.requires_grad if spec is not None else trainable
        setattr(owner, leaf, nn.Parameter(data, requires_grad=requires_grad))
    persistent = {name for name, _ in module.state_dict(keep_vars=True).items()}
    live_buffers = dict(original.named_buffers())
    for name, buffer in list(module.named_buffers()):
        previous = live_buffers.get(name)
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        if name in persistent:
            if buffer.untyped_storage().data_ptr() in keep:
                owner.register_buffer(leaf, buffer.clone())
        elif previous is not None and previous.shape == buffer.shape:
            owner.register_buffer(leaf, previous, persistent=False)
    module.train(original.training)
    for attribute in _HOOK_DICTS:
        hooks = getattr(original, attribute, None)
        if hooks:
            getattr(module, attribute).update(hooks)


def _transplant(model: nn.Module, modules: Mapping[str, nn.Module], restore: Applied | None) -> Callable[[], None]:
    """Put each ``modules[path]`` at ``path`` in ``model``, keeping ties; all or nothing.

    Returns what puts the modules that were there back."""
    ties = _ties(model)
    swaps = {swap.path: swap for swap in restore.swaps} if restore is not None else {}
    originals = {path: model.get_submodule(path) for path in modules}
    keep = {tensor.untyped_storage().data_ptr() for tensor in model.state_dict().values()}
    for path, module in modules.items():
        _prepare(model, path, originals[path], module, swaps.get(path), keep)
    done: list[str] = []

    def undo() -> None:
        for path in reversed(done):
            _set_submodule(model, path, originals[path])  # the originals were not touched: their ties hold

    try:
        for path, module in modules.items():
            _set_submodule(model, path, module)
            done.append(path)
        _retie(model, ties, modules)
    except BaseException:
        undo()
        raise
    return undo


def _retie(model: nn.Module, ties: list[list[str]], modules: Mapping[str, nn.Module]) -> None:
    """Tie again what was tied before the swap, where the swapped-in parameters keep the name and shape."""
    paths = list(modules)
    for names in ties:
        if not any(_inside(name, paths) for name in names):
            continue
        present = [name for name in names if _has_parameter(model, name)]
        if not present:
            continue
        outside = [name for name in present if not _inside(name, paths)]
        shared = model.get_parameter((outside or present)[0])
        for name in present:
            owner_path, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_path)
            if getattr(owner, leaf) is not shared and tuple(getattr(owner, leaf).shape) == tuple(shared.shape):
                setattr(owner, leaf, shared)


def _has_parameter(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def _undo_attributes(model: nn.Module, record: Applied) -> None:
    for name, value in record.attributes.items():
        if value is _MISSING:
            model.__dict__.pop(name, None)
        else:
            object.__setattr__(model, name, value)
    model.__dict__.pop(APPLIED_ATTRIBUTE, None)
