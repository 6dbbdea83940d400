"""Probing without moving anyone's random stream: ``isolated_rng``.

A seeded program (``torch.manual_seed(0)``, a load, then LoRA's initialisation, dropout, data
shuffling) must draw the same numbers with packs as without them.  A probe draws from
generators it does not own as soon as it builds a module on the CPU (``nn.Linear`` draws its
initial weights), runs one in training mode (dropout, jitter), seeds torch
(``torch.manual_seed``) or shuffles with ``random``: torch's global CPU generator, an
accelerator's, Python's ``random`` and NumPy's global state.  ``isolated_rng`` runs a block on
those generators, seeded for the block, and puts every one back as it found it.

hfpatch runs every hook call, every model step's install, ``apply()`` / ``revert()`` and the
conversion of a ``from_config`` model through it, so a pack cannot move the caller's
stream; a probe a pack runs elsewhere (at its first forward, from a helper a user calls)
runs under it itself.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["isolated_rng"]

#: What CUDA's default generators start from when nothing seeded them (``default_rng_seed_val``).
_DEFAULT_SEED = 67280421310721


def _accelerator() -> Any:
    """The device module of the accelerator torch was built for (``torch.cuda``, ``torch.xpu``), or ``None``.

    Read from the build, not the hardware: nothing is initialised to answer."""
    device = torch.accelerator.current_accelerator()
    if device is None:
        return None
    module = torch.get_device_module(device.type)
    if not all(hasattr(module, name) for name in ("get_rng_state_all", "set_rng_state_all", "is_initialized")):
        return None  # an accelerator without per-device generator states: nothing of it is forked
    return module


class RandomState:
    """Every global generator ``isolated_rng`` puts back, as it was when this was made; ``restore()``
    puts them back (core's loaders use it where a block's draws are kept unless it fails)."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")  # only where the program imported it: a probe that imports it starts it
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.accelerator = _accelerator()
        self.initialized = bool(self.accelerator is not None and self.accelerator.is_initialized())
        self.devices = self.accelerator.get_rng_state_all() if self.initialized else None
        tracker = getattr(self.accelerator, "_lazy_seed_tracker", None)
        # the seeds torch.manual_seed queued for an accelerator not started yet: applied when it starts
        self.queued = dict(vars(tracker)) if tracker is not None else None
        if self.queued is not None:
            self.queued["call_order"] = list(self.queued.get("call_order", ()))

    def seed(self, seed: int) -> None:
        """Seed every generator captured, for the block (an accelerator not started stays as it is)."""
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed % 2**32)
        if self.initialized:
            self.accelerator.manual_seed_all(seed)  # started: seeds now, queues nothing

    def restore(self) -> None:
        """Put every generator back as captured."""
        torch.set_rng_state(self.cpu)
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)
        if self.accelerator is None:
            return
        tracker = getattr(self.accelerator, "_lazy_seed_tracker", None)
        if tracker is not None and self.queued is not None:
            vars(tracker).update(self.queued)
        if self.initialized:
            self.accelerator.set_rng_state_all(self.devices)
        elif self.accelerator.is_initialized():
            # started inside the block: seeded there by whatever the block queued; give it the seeds the
            # caller had queued instead (or the default), as if it started after the block
            self.accelerator.manual_seed_all(_DEFAULT_SEED)
            for call in tracker.get_calls() if tracker is not None else ():
                if call:
                    call[0]()


@contextlib.contextmanager
def isolated_rng(seed: int | None = 0) -> Iterator[torch.Generator]:
    """Run the block on the global random generators seeded with ``seed``, and put them back after.

    Every generator a probe may draw from without owning it is captured on entry and restored
    on exit, however the block ends: torch's global CPU generator, the default generators of an
    accelerator already started (CUDA, XPU) and the seeds ``torch.manual_seed`` queued for one
    not started yet, Python's ``random`` and, where NumPy is imported, its global state.  Inside,
    they start from ``seed``, so what the block builds and draws is the same whatever the
    caller's seed (a probe's verdict does not depend on it).  A block may nest in another.

    Called by a pack around anything that builds a module on the CPU, runs one in training mode
    or draws random numbers outside a hook (hooks and model steps' installs already run under
    it).  Draw from the generator it yields, or from the global ones inside the block: both are
    the block's own.

    Args:
        seed: what the generators start from inside the block; ``None`` leaves them as they
            are (the block's draws continue the caller's stream, and are undone after it).

    Yields:
        A CPU ``torch.Generator`` of the block's own, seeded with ``seed`` (``None``: torch's
        default seed).
    """
    state = RandomState()
    try:
        if seed is not None:
            state.seed(seed)
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(seed)
        yield generator
    finally:
        state.restore()
