"""Which claims may apply when transformers' own loader shards the model across ranks.

``from_pretrained(..., tp_plan="auto")`` or ``distributed_config=DistributedConfig(...)``
shards each parameter by the model's plans (``base_model_tp_plan``,
``base_model_ep_plan``, FSDP2), which name the *original* modules' parameters.  A
replacement that adds, renames or reshapes parameters (a fused ``qkv_proj``, per-expert
linears) is not in those plans: its parameters would stay whole next to sharded
neighbours (a shape error in forward) or reach its converters as per-rank slices (a
size error, or a silently wrong fused tensor).  So, in a sharded load, such a
replacement must declare how its parameters shard, per parallelism, on its class:

* ``hfpatch_tp_plan``, ``hfpatch_ep_plan``, ``hfpatch_fsdp_plan``: a mapping of
  parameter or sub-module path (relative to the replaced module) to a transformers
  parallel style (``{"qkv_proj": "colwise"}``); an empty mapping declares that the
  module's own parameters shard as the model's plan already says.  ``sharding`` adds
  the declared entries to the model's plans when it is built.  A replacement that
  cannot shard for some parallelism may say why in ``hfpatch_unsharded_reasons``
  (parallelism -> reason), which the refusal quotes.
* besides transformers' styles, hfpatch's own (``HFPATCH_STYLES``), which ``sharding``
  applies itself: ``{"*": "local_experts"}`` keeps, of a module list of experts named by
  expert number, the experts this rank owns under expert parallelism.

A claim that changes a module's parameters and declares no plan for one of the load's
parallelisms is refused before anything is registered (so before any weight is read):
one ``PackError`` per pack, naming the module class and the parallelism, reported as a
``PackWarning`` (the class loads as in transformers) or raised in strict mode.  The
decision reads only the load's arguments and the packs' classes, which every rank
has alike, so every rank refuses the same claims (a refusal on one rank only would
deadlock the others in the first collective).

"Changes a module's parameters" is decided without building anything: the pack has a
converter for the claim (tied to its target by ``patch_targets``, or untied), or the
replacement is not a plain subclass of the transformers class (some class in its MRO
before the first ``transformers`` class defines ``__init__``, or there is none).  A
subclass that only overrides ``forward`` keeps the original's parameters and applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from .. import _compat
from ..context import LoadContext
from ..errors import PackError
from ..plan import Claim
from .gathering import Gathered

#: The class attribute of a replacement declaring its plan, per parallelism.
PLAN_ATTRIBUTES: Mapping[str, str] = {
    "tp": "hfpatch_tp_plan",
    "ep": "hfpatch_ep_plan",
    "fsdp": "hfpatch_fsdp_plan",
}

#: The optional class attribute of a replacement saying, per parallelism it declares no plan for,
#: why it cannot shard (``{"tp": "its biases ..."}``); the refusal quotes it.
REASONS_ATTRIBUTE = "hfpatch_unsharded_reasons"

#: How each parallelism is named in messages, with the argument that turns it on.
_DESCRIBED: Mapping[str, str] = {
    "tp": "tensor parallelism (tp_plan / DistributedConfig(tp_size=...))",
    "ep": "expert parallelism (DistributedConfig(ep_size=...) / enable_expert_parallel)",
    "fsdp": "FSDP2 sharding (DistributedConfig(fsdp_size=...))",
}


#: The style of ``{"*": "local_experts"}`` (see ``sharding.keep_local_experts``).
LOCAL_EXPERTS = "local_experts"

#: Styles hfpatch applies itself, never handed to transformers, each with whether the
#: installed transformers loads in a way they fit.
HFPATCH_STYLES: Mapping[str, Callable[[], bool]] = {LOCAL_EXPERTS: _compat.expert_mesh_of_loader}


def _declared(replacement: type, mode: str) -> Mapping[str, str] | None:
    attribute = PLAN_ATTRIBUTES.get(mode)
    plan = getattr(replacement, attribute, None) if attribute else None
    if isinstance(plan, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        return plan
    return None


def inapplicable_styles(replacement: type, mode: str) -> list[str]:
    """The hfpatch styles of ``replacement``'s plan for ``mode`` the installed transformers cannot take."""
    plan = _declared(replacement, mode) or {}
    return sorted({style for style in plan.values() if style in HFPATCH_STYLES and not HFPATCH_STYLES[style]()})


def declared_plan(replacement: type, mode: str) -> Mapping[str, str] | None:
    """The plan ``replacement`` declares for parallelism ``mode`` (``PLAN_ATTRIBUTES``), or ``None``.

    Raises:
        PackError: never; a malformed declaration counts as none, and so does one using an
            hfpatch style the installed transformers cannot take (see ``refuse_unsharded``).
    """
    plan = _declared(replacement, mode)
    return None if plan is None or inapplicable_styles(replacement, mode) else plan


def keeps_parameters(replacement: type) -> bool:
    """Whether ``replacement`` builds exactly the parameters of the transformers class it derives from:
    no class in its MRO before the first class of a ``transformers`` module defines ``__init__``."""
    for cls in replacement.__mro__:
        if cls.__module__.split(".")[0] == "transformers":
            return True
        if "__init__" in vars(cls):
            return False
    return False


def _changes_parameters(claim: Claim, gathered: Gathered) -> str | None:
    """Why ``claim``'s replacement changes its module's parameters, or ``None`` if it keeps them."""
    for converter in gathered.converters:
        if converter.pack != claim.pack:
            continue
        targets = converter.converter.patch_targets
        if not targets or claim.target in targets:
            return "it has converters"
    if not keeps_parameters(claim.patch.replacement):
        return "its __init__ builds its own parameters"
    return None


def refuse_unsharded(gathered: Gathered, context: LoadContext) -> Gathered:
    """``gathered`` without the claims that cannot apply in this sharded load (see the module docstring).

    A refused claim takes the converters tied to it (``patch_targets``); a pack with an
    untied converter loses all its claims and converters with it, since the converter
    may load any of them.  Nothing changes for a load that is not sharded
    (``context.parallel`` empty, or only pipeline parallelism, which moves whole layers).

    Returns:
        The claims kept, with one ``PackError`` per pack with refused claims added to
        ``failures`` (the caller reports them: a warning, or raised in strict mode).
    """
    modes = [mode for mode in context.parallel if mode in PLAN_ATTRIBUTES]
    if not modes:
        return gathered
    refused: dict[str, list[tuple[Claim, str, list[str]]]] = {}
    for claim in gathered.claims:
        reason = _changes_parameters(claim, gathered)
        if reason is None:
            continue
        missing = [mode for mode in modes if declared_plan(claim.patch.replacement, mode) is None]
        if missing:
            refused.setdefault(claim.pack, []).append((claim, reason, missing))
    if not refused:
        return gathered
    untied = {claim.pack for claim in gathered.converters if not claim.converter.patch_targets}
    whole = {pack for pack in refused if pack in untied}
    targets = {pack: {claim.target for claim, _, _ in items} for pack, items in refused.items()}

    def kept_claim(claim: Claim) -> bool:
        return claim.pack not in whole and claim.target not in targets.get(claim.pack, ())

    claims = tuple(claim for claim in gathered.claims if kept_claim(claim))
    converters = tuple(
        converter
        for converter in gathered.converters
        if converter.pack not in whole
        and not (
            converter.pack in targets
            and converter.converter.patch_targets
            and set(converter.converter.patch_targets) <= targets[converter.pack]
        )
    )
    failures = [_refusal(pack, items, context, pack in whole) for pack, items in refused.items()]
    return dataclasses.replace(gathered, claims=claims, converters=converters, failures=(*gathered.failures, *failures))


def _refusal(pack: str, items: list[tuple[Claim, str, list[str]]], context: LoadContext, whole: bool) -> PackError:
    modes = list(dict.fromkeys(mode for _, _, missing in items for mode in missing))
    described = "; ".join(
        f"{claim.patch.replacement.__name__} (replacing {claim.target!r}) changes the module's parameters "
        f"({reason}) and declares no plan for {', '.join(missing)} "
        f"({', '.join(PLAN_ATTRIBUTES[mode] for mode in missing)}){_inapplicable(claim, missing)}"
        f"{_reasons(claim, missing)}"
        for claim, reason, missing in items
    )
    left = (
        "the whole pack is skipped for this load (its converters are not tied to one patch)"
        if whole
        else f"{', '.join(repr(claim.target) for claim, _, _ in items)} load as in transformers"
    )
    return PackError(
        pack,
        f"pack {pack!r}: {context.model_class_name} is loaded with "
        f"{' and '.join(_DESCRIBED[mode] for mode in modes)}: {described}, so its parameters would not shard "
        f"as the model's plan says (a shape error, or wrong results). Refused before any weight was read: "
        f"{left}. Declare how the replacement's parameters shard (class attributes "
        f"{', '.join(PLAN_ATTRIBUTES[mode] for mode in modes)}; see docs/scale.md), "
        "or load without that parallelism.",
        stage="selection",
    )


def _reasons(claim: Claim, missing: list[str]) -> str:
    """The replacement's own word on why it cannot shard (``REASONS_ATTRIBUTE``), or ``""``."""
    declared = getattr(claim.patch.replacement, REASONS_ATTRIBUTE, None)
    if not isinstance(declared, Mapping):
        return ""
    said = [f"{mode}: {declared[mode]}" for mode in missing if isinstance(declared.get(mode), str)]
    return f" (it says why: {'; '.join(said)})" if said else ""


def _inapplicable(claim: Claim, missing: list[str]) -> str:
    """Why a declared plan counts as none on this transformers release, or ``""``."""
    styles = sorted({style for mode in missing for style in inapplicable_styles(claim.patch.replacement, mode)})
    if not styles:
        return ""
    import transformers

    return (
        f" that transformers {transformers.__version__} can apply: its plan uses hfpatch's "
        f"{', '.join(repr(style) for style in styles)}, which needs transformers' expert mesh and token "
        "dispatch (DistributedConfig(ep_size=...))"
    )
