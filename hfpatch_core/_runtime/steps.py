"""Installing a plan's model steps on the model a load returned, and uninstalling them.

A step runs on the model itself once it is built and its weights are loaded (``ModelStep``):
after a root ``from_pretrained`` / ``from_config`` load (``loaders``) and at the end of
``hfpatch_core.apply`` (``inplace``).  What the model holds is recorded on it
(``STEPS_ATTRIBUTE``) for ``uninstall_steps``; what a step refused at install is added to
the plan the model carries, under the step's target, so that ``plan_of``, the load's log
line and ``hfpatch verify`` show why the model was left as it was.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..authoring.randomness import isolated_rng
from ..errors import HfPatchError, PackError
from ..patches import Refusal
from ..plan import Plan, Refused, StepClaim

#: The attribute of a model that holds the step claims installed on it, in installation order.
STEPS_ATTRIBUTE = "_hfpatch_steps"

_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("hfpatch_steps_deferred", default=False)


@contextmanager
def deferred() -> Iterator[None]:
    """Loads in the block install no step: ``apply`` loads a temporary model whose modules it
    moves into the user's model, and installs the steps on that model itself."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def is_deferred() -> bool:
    """Whether a load here installs no step (inside ``deferred``)."""
    return _deferred.get()


def installed_on(model: object) -> tuple[StepClaim, ...]:
    """The step claims installed on ``model``, in installation order (empty when none)."""
    found = getattr(model, STEPS_ATTRIBUTE, ())
    return found if isinstance(found, tuple) else ()


def install_steps(model: nn.Module, plan: Plan, report: Callable[[Iterable[HfPatchError]], None]) -> Plan:
    """Install ``plan.steps`` on ``model``; the plan with the steps' install-time refusals added.

    A step whose ``install`` raises or returns something other than ``None`` or a
    ``Refusal`` is a pack failure (``report``: a warning, or raised in strict mode after the
    steps installed so far are uninstalled) and is recorded as refused with what happened.
    """
    if not plan.steps:
        return plan
    installed: list[StepClaim] = []
    refused: list[Refused] = []
    failures: list[HfPatchError] = []
    for claim in plan.steps:
        where = f"pack {claim.pack!r}: model step {claim.target!r} ({claim.step.install_name})"
        try:
            # apply() works under no_grad, a user may load under inference_mode: a step probing its
            # model's gradients (a loss) gets autograd whatever the caller's mode; a probe's draws
            # (a forward in training mode) are its own, not the seeded stream of the caller
            with torch.inference_mode(False), torch.enable_grad(), isolated_rng():
                result = claim.step.install(model)
        except Exception as exc:  # a pack's step may raise anything: the model stays loaded
            failures.append(PackError(claim.pack, f"{where} raised {type(exc).__name__}: {exc}", stage="load"))
            refused.append(Refused(claim.pack, claim.version, claim.target, f"install raised {type(exc).__name__}"))
            continue
        if result is None:
            installed.append(claim)
        elif isinstance(result, Refusal):
            refused.append(Refused(claim.pack, claim.version, claim.target, result.reason))
        else:
            with isolated_rng(None):
                claim.step.uninstall(model)  # it may have changed the model before returning the wrong thing
            failures.append(
                PackError(
                    claim.pack,
                    f"{where} returned {type(result).__name__}; return None once installed, or a Refusal",
                    stage="load",
                )
            )
            refused.append(Refused(claim.pack, claim.version, claim.target, "install returned no valid result"))
    object.__setattr__(model, STEPS_ATTRIBUTE, (*installed_on(model), *installed))
    try:
        report(failures)
    except BaseException:
        uninstall_steps(model)
        raise
    return dataclasses.replace(plan, refused=(*plan.refused, *refused)) if refused else plan


def uninstall_steps(model: nn.Module) -> tuple[StepClaim, ...]:
    """Uninstall every step installed on ``model``, the last installed first; the claims uninstalled."""
    claims = installed_on(model)
    with isolated_rng(None):
        for claim in reversed(claims):
            claim.step.uninstall(model)
    model.__dict__.pop(STEPS_ATTRIBUTE, None)
    return claims
