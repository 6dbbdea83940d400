"""What one load pays to gather and resolve packs, with 100 packs installed.

100 synthetic packs are written as real distributions (a ``*.dist-info`` with an
``hfpatch.packs`` entry point, and a module) on a temporary ``sys.path`` entry.  Each
pack's module returns one patch of a made-up target (``BenchTarget042``) for model type
``"llama"``.

Measured, per load, for a tiny ``LlamaForCausalLM`` config:

(i)   all 100 selected: ``session.plan(LoadContext.for_model(LlamaForCausalLM, config),
      class_names)`` (gather = call every pack's hooks, resolve = pick winners and match
      them against the modeling module's classes), with ``class_names`` the module
      classes of ``modeling_llama`` as a load passes them.  ``new_session()`` and one
      first ``plan()`` (which imports the 100 packs) run before the timing, so the packs'
      own import time is excluded.  Goal <= 10 ms.
(ii)  ``HF_PATCH_PACKS`` naming one pack: the same ``plan()``.  Goal <= 2 ms; and the
      other 99 modules must never be imported (checked in ``sys.modules`` after a real
      ``from_pretrained`` through ``enable()``).
(iii) ``HF_PATCH_PACKS=none``: no session work happens at all; what a load still pays is
      hfpatch's wrappers taking their fast path.  Measured exactly that: the
      ``from_pretrained`` wrapper around a no-op (vs the no-op called directly), plus
      hfpatch's stand-in for ``apply_patches`` with an empty registry (vs transformers'
      own) times the number of ``apply_patches`` calls one load makes.  Goal <= 0.5 ms.
      An end-to-end cross-check (interleaved tiny loads, enabled-with-none vs disabled)
      is printed too, with its noise.

Once-per-process costs (discovery of the 100 entry points, selection) are printed for
information; they are not per load.

Run: ``.venv/bin/python bench/discovery.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    describe_ratio,
    interleaved,
    machine_info,
    median,
    repeat,
    spread,
    table,
    timed,
    use_test_helpers,
    verdict,
)

COUNT = 100
SOURCE = """
import torch.nn as nn
from hfpatch_core import Patch, hookimpl


class Replacement{index:03d}(nn.Module):
    pass


@hookimpl
def provide_patches(context):
    if context.model_type == "llama":
        return [Patch("BenchTarget{index:03d}", Replacement{index:03d})]
    return []
"""


def pack_name(index: int) -> str:
    return f"bench-disc-{index:03d}"


def module_name(index: int) -> str:
    return f"hfpatch_bench_disc_{index:03d}"


def install(site: Path) -> None:
    from packs import PackSpec, install_packs

    install_packs(
        site,
        [
            PackSpec(pack_name(i), textwrap.dedent(SOURCE.format(index=i)), module=module_name(i), summary="bench")
            for i in range(COUNT)
        ],
    )


def ms(samples: list[float]) -> str:
    return f"{median(samples) * 1e3:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300, help="timings per micro-benchmark (default 300)")
    parser.add_argument("--rounds", type=int, default=100, help="rounds of the end-to-end load check (default 100)")
    args = parser.parse_args(argv)

    use_test_helpers()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    for line in machine_info():
        print(line)

    work = Path(tempfile.mkdtemp(prefix="hfpatch-bench-discovery-"))
    try:
        return measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args: argparse.Namespace, work: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hfpatch_core
    from hfpatch_core._pipeline.discovery import discover
    from hfpatch_core._pipeline.planning import class_names_for
    from hfpatch_core._pipeline.selection import current_selection
    from hfpatch_core._session import session as session_module
    from hfpatch_core.context import LoadContext

    install(work / "site")
    ours = {pack_name(i) for i in range(COUNT)}
    others = sorted(set(discover().names) - ours)
    print(f"{COUNT} synthetic packs installed in {work / 'site'}; other installed packs: {others or 'none'}")
    assert ours <= set(discover().names)

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    checkpoint = work / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(checkpoint)
    context = LoadContext.for_model(LlamaForCausalLM, config)
    class_names = class_names_for(LlamaForCausalLM)  # what a load passes

    results: list[list[str]] = []

    def set_selection(value: str | None) -> None:
        if value is None:
            os.environ.pop("HF_PATCH_PACKS", None)
        else:
            os.environ["HF_PATCH_PACKS"] = value

    # --- (iii) nothing selected ------------------------------------------------------
    set_selection("none")
    hfpatch_core.enable()
    assert session_module.live_session() is None
    fast_rows, fast_path = fast_path_cost(lambda: LlamaForCausalLM.from_pretrained(checkpoint), args.repeat)
    hfpatch_core.disable()
    fast_path_ms = fast_path * 1e3

    samples = end_to_end(checkpoint, args.rounds)

    # --- (ii) one pack named --------------------------------------------------------
    chosen = pack_name(42)
    set_selection(chosen)
    preloaded = {module_name(i) for i in range(COUNT)} & set(sys.modules)
    assert not preloaded, preloaded
    one = session_module.new_session()
    assert set(one.selection.packs) == {chosen}
    one.plan(context, class_names)  # imports the one pack
    one_plan = repeat(lambda: one.plan(context, class_names), args.repeat)
    assert one.plan(context, class_names).mapping.keys() == {"BenchTarget042"}
    hfpatch_core.enable()
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    assert hfpatch_core.plan_of(model) is not None and set(dict(hfpatch_core.plan_of(model).packs)) == {chosen}
    hfpatch_core.disable()
    imported = sorted(name for name in (module_name(i) for i in range(COUNT)) if name in sys.modules)
    assert imported == [module_name(42)], imported

    # --- (i) all 100 selected -------------------------------------------------------
    set_selection(",".join(sorted(ours)))
    selection_time = repeat(current_selection, 20)
    discovery_time = repeat(discover, 20)
    every = session_module.new_session()
    assert set(every.selection.packs) == ours
    first_plan = timed(lambda: every.plan(context, class_names))  # imports the other 99
    all_plan = repeat(lambda: every.plan(context, class_names), args.repeat)
    plan = every.plan(context, class_names)
    assert len(plan.entries) == COUNT and not plan.replaced
    assert all(module_name(i) in sys.modules for i in range(COUNT))
    set_selection(None)

    all_ms, one_ms = median(all_plan) * 1e3, median(one_plan) * 1e3
    results.append(["(i) all 100 selected: plan()", ms(all_plan), spread(all_plan), "10", verdict(all_ms, 10)])
    results.append([f"(ii) HF_PATCH_PACKS={chosen}: plan()", ms(one_plan), spread(one_plan), "2", verdict(one_ms, 2)])
    results.append(
        [
            "(iii) HF_PATCH_PACKS=none: per-load fast path",
            f"{fast_path_ms:.4f}",
            "-",
            "0.5",
            verdict(fast_path_ms, 0.5),
        ]
    )
    print("\nper-load gather+resolve (median of", args.repeat, "timings)")
    print(table(["case", "median ms", "IQR ms", "goal ms", "goal"], results))
    print(
        f"  (ii): of the {COUNT} pack modules only {imported} was imported "
        "(sys.modules after new_session + plan + a from_pretrained through enable())"
    )
    print("\n(iii) in detail: what a load pays with HF_PATCH_PACKS=none, per hook enable() installs")
    print(table(["hook", "calls per load", "hooked us", "original us", "added us per load"], fast_rows))
    off, none = median(samples["off"]), median(samples["none"])
    print(
        f"  end-to-end cross-check, {args.rounds} interleaved tiny loads: disabled {off * 1e3:.2f} ms "
        f"(IQR {spread(samples['off'])}), enabled with none {none * 1e3:.2f} ms (IQR {spread(samples['none'])}); "
        f"ratio {describe_ratio(samples['none'], samples['off'])}: the load's own noise is far larger than "
        "the goal, hence the direct measurement above"
    )
    print("\nonce per process (not per load), for information")
    print(
        table(
            ["step", "median ms"],
            [
                [f"discover() ({COUNT + len(others)} packs' entry points)", ms(discovery_time)],
                ["current_selection() (discover + parse + select)", ms(selection_time)],
                [f"first plan() with {COUNT} selected (imports 99 more packs)", f"{first_plan * 1e3:.3f}"],
            ],
        )
    )
    return 0


def fast_path_cost(load: Callable[[], Any], count: int) -> tuple[list[list[str]], float]:
    """Per hook that ``enable()`` installed: calls per ``load``, and its fast-path cost.

    A hook that wraps the original (the ``from_pretrained`` wrapper) is measured around a
    no-op, against the no-op called directly: that is exactly the wrapper's own work.  A
    hook that replaces the original outright (hfpatch's ``apply_patches``) is measured
    against the original, both called with the arguments recorded during ``load``.
    """
    from hfpatch_core._session import loaders as hooks

    rows: list[list[str]] = []
    total = 0.0
    for owner, name, wrap in hooks._hooked():
        installed = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        original = hooks._originals[name][1]
        is_method = isinstance(installed, (classmethod, staticmethod))
        recorded: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def spy(*args: Any, _installed: Any = installed, _recorded: list[Any] = recorded, **kwargs: Any) -> Any:
            _recorded.append((args, kwargs))
            function = _installed.__func__ if isinstance(_installed, classmethod) else _installed
            return function(*args, **kwargs)

        setattr(owner, name, classmethod(lambda cls, *a, **k: spy(cls, *a, **k)) if is_method else spy)
        try:
            load()
        finally:
            setattr(owner, name, installed)
        calls = len(recorded)
        if not calls:
            rows.append([name, "0", "-", "-", "0"])
            continue
        args, kwargs = recorded[0]

        def noop(*args: Any, **kwargs: Any) -> Any:
            return contextlib.nullcontext()

        def other(*args: Any, **kwargs: Any) -> Any:
            return contextlib.nullcontext()

        wrap_noop = wrap(classmethod(noop) if is_method else noop)
        if wrap_noop is wrap(classmethod(other) if is_method else other):
            hooked, plain = installed, original  # a replacement: compare with the original
        else:
            hooked, plain = wrap_noop, (classmethod(noop) if is_method else noop)
        hooked_fn = hooked.__func__ if isinstance(hooked, classmethod) else hooked
        plain_fn = plain.__func__ if isinstance(plain, classmethod) else plain
        hooked_s = median(repeat(functools.partial(_call, hooked_fn, args, kwargs), count))
        plain_s = median(repeat(functools.partial(_call, plain_fn, args, kwargs), count))
        added = calls * (hooked_s - plain_s)
        total += added
        rows.append([name, str(calls), f"{hooked_s * 1e6:.2f}", f"{plain_s * 1e6:.2f}", f"{added * 1e6:.2f}"])
    rows.append(["total", "", "", "", f"{total * 1e6:.2f}"])
    return rows, total


def _call(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    result = function(*args, **kwargs)
    if hasattr(result, "__enter__"):
        with result:
            pass


def end_to_end(checkpoint: Path, rounds: int) -> dict[str, list[float]]:
    from transformers import LlamaForCausalLM

    import hfpatch_core

    def disabled() -> float:
        return timed(lambda: LlamaForCausalLM.from_pretrained(checkpoint))

    def enabled_none() -> float:
        hfpatch_core.enable("none")
        try:
            return timed(lambda: LlamaForCausalLM.from_pretrained(checkpoint))
        finally:
            hfpatch_core.disable()

    disabled()
    enabled_none()
    return interleaved({"off": disabled, "none": enabled_none}, rounds)


if __name__ == "__main__":
    sys.exit(main())
