"""What hfpatch adds to a ``from_pretrained``.

Two llama checkpoints are built from configs and saved with ``save_pretrained`` to a
temporary directory: a tiny one (4 layers, hidden 64) and a ~110M-parameter one
(hidden 768, 12 layers, intermediate 2048, vocab 32000, tied embeddings).  Each is
loaded, interleaved round by round,

  (a) vanilla: plain transformers, nothing registered;
  (b) by hand: two structure-preserving patches (a plain subclass of ``LlamaMLP`` under
      ``"LlamaMLP"`` and a plain subclass of ``LlamaRMSNorm`` under ``".*RMSNorm$"``)
      registered with ``transformers.monkey_patching.register_patch_mapping`` before
      the load and unregistered after it (transformers' own ``apply_patches`` runs);
  (b2) the same by hand, with transformers' ``apply_patches`` swapped for hfpatch's
      ``apply_registered_patches`` (same registry, same rule, no upstream rescan of every
      module's ``dir()``, no hfpatch session): separates what patching itself costs from
      what hfpatch's per-load work (config, plan, checks) adds, i.e. (c)/(b2);
  (c) hfpatch: the same two classes returned by a pack installed as a real
      distribution (dist-info + module on a temporary ``sys.path`` entry), selected
      with ``hfpatch_core.enable("bench-load")``;
  (d) hfpatch under a lock: (c) with ``enable("bench-load", lock=...)`` and a lock
      ``hfpatch lock`` wrote: each load checks the pack's files (hashed once per process,
      ``stat`` after) and its plan against the lock.  Goal: (d) - (c) <= 1 ms per load.

``enable()`` / ``disable()`` run outside the timed region of (c): they are once per
process, not per load.  Each round starts a fresh session, so every (c) sample also
pays the session's first-load work (registering the already imported pack with
pluggy).  Goal: (c)/(a) <= 1.02 (the limit is about 1.00: two attribute swaps).

If ``hfpatch-pack-qwen-moe`` is installed, a tiny qwen2_moe checkpoint is loaded the
same ways (vanilla; the pack's patches and composed conversion list registered by
hand, with upstream's and with hfpatch's application; ``enable("qwen-moe")``).  Those
patches change the module structure (fused q/k/v, per-expert ``nn.Linear``), so
(b2)/(a) is the cost of that structure and (c)/(b2) hfpatch's overhead, not (c)/(a).

Run: ``.venv/bin/python bench/load_overhead.py`` (``--help`` for the round counts).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import (
    describe_paired,
    describe_ratio,
    interleaved,
    machine_info,
    median,
    paired_verdict,
    spread,
    table,
    timed,
    use_test_helpers,
)

PACK = "bench-load"
PACK_MODULE = "hfpatch_bench_load_pack"
PACK_SOURCE = """
from hfpatch_core import Patch, hookimpl
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm


class BenchMLP(LlamaMLP):
    '''Structure-preserving: the same parameters and forward as LlamaMLP.'''


class BenchRMSNorm(LlamaRMSNorm):
    '''Structure-preserving: the same parameters and forward as LlamaRMSNorm.'''


#: What (b) registers by hand, and what the pack returns for (c).
MAPPING = {"LlamaMLP": BenchMLP, ".*RMSNorm$": BenchRMSNorm}


@hookimpl
def provide_patches(context):
    if context.model_type != "llama":
        return []
    return [Patch(target, replacement) for target, replacement in MAPPING.items()]
"""

GOAL = 1.02


@contextlib.contextmanager
def fast_apply() -> Iterator[None]:
    """For (b2): hfpatch's ``apply_registered_patches`` in place of transformers' ``apply_patches``.

    The same registry, applied by the same rule, without upstream's ``dir()`` rescan of every
    loaded transformers module and without any hfpatch session (no packs, no plan).
    """
    from transformers import modeling_utils

    from hfpatch_core._runtime import application

    upstream = modeling_utils.apply_patches
    modeling_utils.apply_patches = application.apply_registered_patches
    try:
        yield
    finally:
        modeling_utils.apply_patches = upstream


def llama_configs() -> dict[str, Any]:
    from transformers import LlamaConfig

    return {
        "tiny llama (4 layers, hidden 64)": LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=128,
        ),
        "llama ~110M (12 layers, hidden 768)": LlamaConfig(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=12,
            vocab_size=32000,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        ),
    }


def save(model_class: type, config: Any, path: Path) -> int:
    import torch

    torch.manual_seed(0)
    model = model_class(config)
    model.save_pretrained(path)
    return sum(parameter.numel() for parameter in model.parameters())


def logits(model: Any) -> Any:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def report(
    title: str,
    samples: dict[str, list[float]],
    labels: dict[str, str],
    ratios: list[tuple[str, str]],
    goals: dict[tuple[str, str], float] | None = None,
) -> None:
    """Print the table and the ratios; ``goals`` gives the ratios that have a goal (default: (c)/(a) <= GOAL)."""
    goals = {("c", "a"): GOAL} if goals is None else goals
    print(f"\n{title}")
    rows = [
        [labels[name], f"{median(values) * 1e3:.2f}", spread(values), len(values)] for name, values in samples.items()
    ]
    print(table(["variant", "median ms", "IQR ms", "rounds"], rows))
    for top, bottom in ratios:
        goal = ""
        if (top, bottom) in goals:
            limit = goals[(top, bottom)]
            goal = f"  goal <= {limit}: {paired_verdict(samples[top], samples[bottom], limit)}"
        print(f"  ({top})/({bottom}) = {describe_ratio(samples[top], samples[bottom])}")
        print(f"    paired, per round: {describe_paired(samples[top], samples[bottom])}{goal}")


def llama_section(work: Path, rounds: dict[str, int], *, profile: bool) -> None:
    import torch
    from transformers import LlamaForCausalLM, monkey_patching

    import hfpatch_core
    from packs import PackSpec, install_packs

    install_packs(work / "site", [PackSpec(PACK, textwrap.dedent(PACK_SOURCE), module=PACK_MODULE)])
    pack = __import__(PACK_MODULE)
    mapping: dict[str, type] = pack.MAPPING
    lock = write_lock(work / "hfpatch.lock")

    for (title, config), count in zip(llama_configs().items(), rounds.values(), strict=True):
        if count <= 0:
            print(f"\n{title}: skipped (0 rounds)")
            continue
        path = work / title.split(" (")[0].replace(" ", "-").replace("~", "")
        parameters = save(LlamaForCausalLM, config, path)
        print(f"\n{title}: {parameters / 1e6:.1f}M parameters, checkpoint {path}")

        def load(path: Path = path) -> Any:
            return LlamaForCausalLM.from_pretrained(path)

        def check(model: Any, mlp: str, norm: str) -> None:
            found = (type(model.model.layers[0].mlp).__name__, type(model.model.norm).__name__)
            assert found == (mlp, norm), found

        def vanilla(load: Callable[[], Any] = load) -> float:
            box: list[Any] = []
            seconds = timed(lambda: box.append(load()))
            check(box[0], "LlamaMLP", "LlamaRMSNorm")
            return seconds

        def by_hand(load: Callable[[], Any] = load) -> float:
            box: list[Any] = []

            def run() -> None:
                monkey_patching.register_patch_mapping(mapping)
                try:
                    box.append(load())
                finally:
                    monkey_patching.unregister_patch_mapping(list(mapping))

            seconds = timed(run)
            check(box[0], "BenchMLP", "BenchRMSNorm")
            return seconds

        def by_hand_fast(load: Callable[[], Any] = load) -> float:
            box: list[Any] = []

            def run() -> None:
                monkey_patching.register_patch_mapping(mapping)
                try:
                    with fast_apply():
                        box.append(load())
                finally:
                    monkey_patching.unregister_patch_mapping(list(mapping))

            seconds = timed(run)
            check(box[0], "BenchMLP", "BenchRMSNorm")
            return seconds

        def through_hfpatch(load: Callable[[], Any] = load, lock: Path | None = None) -> float:
            box: list[Any] = []
            hfpatch_core.enable(PACK, lock=lock if lock is not None else False)
            try:
                seconds = timed(lambda: box.append(load()))
            finally:
                hfpatch_core.disable()
            check(box[0], "BenchMLP", "BenchRMSNorm")
            assert hfpatch_core.plan_of(box[0]) is not None
            return seconds

        # Warm-up (page cache, lazy imports, hfpatch's match cache), and one equality check:
        # the three loads must give the same logits (the patches preserve the structure).
        outputs = [logits(variant_model) for variant_model in _models(load, mapping)]
        assert all(torch.equal(outputs[0], other) for other in outputs[1:]), "the three loads differ"
        print("  check: (a), (b) and (c) give identical logits; (b) and (c) replace LlamaMLP and every *RMSNorm")
        through_hfpatch(lock=lock)  # the first locked load hashes the pack: once per process
        samples = interleaved(
            {
                "a": vanilla,
                "b": by_hand,
                "b2": by_hand_fast,
                "c": through_hfpatch,
                "d": lambda load=load: through_hfpatch(load, lock),
            },
            count,
        )
        report(
            f"{title}: from_pretrained",
            samples,
            {
                "a": "(a) vanilla",
                "b": "(b) register_patch_mapping by hand",
                "b2": "(b2) by hand, hfpatch's apply_patches stand-in",
                "c": f"(c) hfpatch_core.enable({PACK!r})",
                "d": f"(d) hfpatch_core.enable({PACK!r}, lock=...)",
            },
            [("b", "a"), ("c", "a"), ("c", "b"), ("b2", "a"), ("c", "b2"), ("d", "c")],
        )
        extra = median([locked - unlocked for locked, unlocked in zip(samples["d"], samples["c"], strict=True)])
        verdict = "met" if extra <= 1e-3 else "NOT met"
        print(f"  locked - unlocked, paired per round: median {extra * 1e3:+.3f} ms (goal <= 1 ms: {verdict})")
        print(f"  the lock's own checks per load, timed alone: {lock_check_seconds(lock, load) * 1e6:.1f} us")
        if profile:
            hot_spots(load, count=20)
            profile = False  # the tiny model only: the same code runs for every size


def write_lock(path: Path) -> Path:
    """The lock of the bench pack, as ``HF_PATCH_PACKS=bench-load hfpatch lock -o PATH`` writes it."""
    import os

    from hfpatch_core.cli import main

    os.environ["HF_PATCH_PACKS"] = PACK
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            assert main(["lock", "-o", str(path)]) == 0
    finally:
        del os.environ["HF_PATCH_PACKS"]
    return path


def lock_check_seconds(lock: Path, load: Callable[[], Any], calls: int = 2000) -> float:
    """What a locked load adds, without the load's noise: the packs' and the plan's comparison
    with the lock (``Lock.check_packs`` + ``Lock.check_plan``) on a loaded model's plan."""
    import time

    import hfpatch_core
    from hfpatch_core._session.session import new_session

    session = new_session(PACK, lock=lock)
    hfpatch_core.enable(PACK, lock=lock)
    try:
        plan = hfpatch_core.plan_of(load())
    finally:
        hfpatch_core.disable()
    assert plan is not None and session.lock is not None
    start = time.perf_counter()
    for _ in range(calls):
        session.lock.check_packs(session.selection)
        session.lock.check_plan(plan)
    return (time.perf_counter() - start) / calls


def hot_spots(load: Callable[[], Any], count: int, pack: str = PACK) -> None:
    """cProfile ``count`` loads through hfpatch; print hfpatch's own functions by cumulative time.

    Functions whose cumulative time holds the wrapped transformers load itself (the
    ``from_pretrained`` wrapper and the like) are left out: what remains is what hfpatch
    adds.  cProfile inflates short calls, so read the ranking, not the absolute numbers.
    """
    import cProfile
    import pstats

    import hfpatch_core

    hfpatch_core.enable(pack)
    try:
        load()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(count):
            load()
        profiler.disable()
    finally:
        hfpatch_core.disable()
    stats = pstats.Stats(profiler)
    total = max(entry[3] for entry in stats.stats.values())  # type: ignore[attr-defined]
    rows = []
    for (filename, line, function), (_, calls, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "hfpatch_core" not in filename or cumulative > 0.5 * total:
            continue
        rows.append((cumulative, f"{Path(filename).name}:{line} {function}", calls / count))
    rows.sort(reverse=True)
    print(f"  hot spots: hfpatch's own functions in {count} profiled (c) loads (cProfile, inflated; per load):")
    print(
        textwrap.indent(
            table(
                ["function", "calls", "cumulative ms"],
                [[name, f"{calls:g}", f"{cumulative / count * 1e3:.3f}"] for cumulative, name, calls in rows[:12]],
            ),
            "    ",
        )
    )


def _models(load: Callable[[], Any], mapping: dict[str, type]) -> list[Any]:
    from transformers import monkey_patching

    import hfpatch_core

    vanilla = load()
    monkey_patching.register_patch_mapping(mapping)
    try:
        by_hand = load()
    finally:
        monkey_patching.unregister_patch_mapping(list(mapping))
    hfpatch_core.enable(PACK)
    try:
        through = load()
    finally:
        hfpatch_core.disable()
    return [vanilla, by_hand, through]


def qwen_section(work: Path, rounds: int, *, profile: bool) -> None:
    if importlib.util.find_spec("hfpatch_pack_qwen_moe") is None:
        print("\nqwen-moe: skipped, hfpatch-pack-qwen-moe is not installed (pip install plugins/hfpatch-pack-qwen-moe)")
        return
    import hfpatch_pack_qwen_moe as qwen_moe
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, conversion_mapping, monkey_patching

    import hfpatch_core
    from hfpatch_core import LoadContext

    if "qwen-moe" not in hfpatch_core.discover().packs:
        print("\nqwen-moe: skipped, hfpatch_pack_qwen_moe is importable but no 'qwen-moe' pack is discovered")
        return
    config = Qwen2MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    path = work / "tiny-qwen2-moe"
    parameters = save(Qwen2MoeForCausalLM, config, path)
    print(f"\ntiny qwen2_moe (4 layers, hidden 64, 4 experts): {parameters / 1e6:.2f}M parameters, checkpoint {path}")

    # "By hand": what a user without hfpatch writes, from the pack's own hooks: the patch
    # mapping, and the conversion list composed as the pack's converters ask (their
    # transforms first, then transformers' built-in list minus what they replace).
    context = LoadContext.for_model(Qwen2MoeForCausalLM, config)
    mapping = {patch.target: patch.replacement for patch in qwen_moe.provide_patches(context)}
    converters = qwen_moe.provide_converters(context)
    keys = {converter.key for converter in converters}
    assert keys == {"qwen2_moe"}, keys
    replaced = {pattern for converter in converters for pattern in converter.replaces}

    def sources(transform: Any) -> set[str]:
        patterns = getattr(transform, "_original_source_patterns", None) or transform.source_patterns
        return {patterns} if isinstance(patterns, str) else set(patterns)

    builtin = conversion_mapping.get_checkpoint_conversion_mapping("qwen2_moe") or []
    transforms = [t for converter in converters for t in converter.transforms]
    transforms += [t for t in builtin if not sources(t) & replaced]
    missing = object()

    def load() -> Any:
        return Qwen2MoeForCausalLM.from_pretrained(path)

    def register() -> Callable[[], None]:
        cache = conversion_mapping._checkpoint_conversion_mapping_cache
        before = cache.get("qwen2_moe", missing) if cache is not None else missing
        user_keys = getattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", None)
        was_user = user_keys is not None and "qwen2_moe" in user_keys
        monkey_patching.register_patch_mapping(mapping)
        conversion_mapping.register_checkpoint_conversion_mapping("qwen2_moe", list(transforms), overwrite=True)

        def unregister() -> None:
            monkey_patching.unregister_patch_mapping(list(mapping))
            cache = conversion_mapping._checkpoint_conversion_mapping_cache
            assert cache is not None
            if before is missing:
                del cache["qwen2_moe"]
            else:
                cache["qwen2_moe"] = before
            if user_keys is not None and not was_user:
                user_keys.discard("qwen2_moe")

        return unregister

    def classes(model: Any) -> tuple[str, str]:
        layer = model.model.layers[0]
        return type(layer.mlp.experts).__name__, type(layer.self_attn).__name__

    patched = tuple(cls.__name__ for cls in mapping.values())

    def vanilla() -> float:
        box: list[Any] = []
        seconds = timed(lambda: box.append(load()))
        assert classes(box[0]) == ("Qwen2MoeExperts", "Qwen2MoeAttention"), classes(box[0])
        return seconds

    def by_hand() -> float:
        box: list[Any] = []

        def run() -> None:
            unregister = register()
            try:
                box.append(load())
            finally:
                unregister()

        seconds = timed(run)
        assert set(classes(box[0])) == set(patched), classes(box[0])
        return seconds

    def by_hand_fast() -> float:
        box: list[Any] = []

        def run() -> None:
            unregister = register()
            try:
                with fast_apply():
                    box.append(load())
            finally:
                unregister()

        seconds = timed(run)
        assert set(classes(box[0])) == set(patched), classes(box[0])
        return seconds

    def through_hfpatch() -> float:
        box: list[Any] = []
        hfpatch_core.enable("qwen-moe")
        try:
            seconds = timed(lambda: box.append(load()))
        finally:
            hfpatch_core.disable()
        assert set(classes(box[0])) == set(patched), classes(box[0])
        return seconds

    reference = logits(load())
    unregister = register()
    try:
        hand = logits(load())
    finally:
        unregister()
    hfpatch_core.enable("qwen-moe")
    try:
        through = logits(load())
    finally:
        hfpatch_core.disable()
    torch.testing.assert_close(hand, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(through, hand, rtol=0, atol=0)
    print(f"  check: (b) and (c) replace {sorted(mapping)}; logits match (a) within 1e-5 and each other exactly")
    samples = interleaved({"a": vanilla, "b": by_hand, "b2": by_hand_fast, "c": through_hfpatch}, rounds)
    report(
        "tiny qwen2_moe: from_pretrained",
        samples,
        {
            "a": "(a) vanilla",
            "b": "(b) qwen-moe patches + conversion list by hand",
            "b2": "(b2) by hand, hfpatch's apply_patches stand-in",
            "c": "(c) hfpatch_core.enable('qwen-moe')",
        },
        [("b", "a"), ("c", "a"), ("c", "b"), ("b2", "a"), ("c", "b2")],
        goals={("c", "b"): 1.0},  # the goal for a structure-changing pack: through hfpatch <= by hand
    )
    print("  (the pack changes the module structure: (b2)/(a) is that change, (c)/(b2) hfpatch's session on top)")
    if profile:
        hot_spots(load, count=20, pack="qwen-moe")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--rounds-tiny", type=int, default=40, help="rounds for the tiny llama (default 40)")
    add("--rounds-large", type=int, default=15, help="rounds for the ~110M llama (default 15; 0 skips)")
    add("--rounds-qwen", type=int, default=25, help="rounds for the tiny qwen2_moe (default 25; 0 skips)")
    add("--no-profile", action="store_true", help="skip the cProfile hot spots of (c)")
    args = parser.parse_args(argv)

    use_test_helpers()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    for line in machine_info():
        print(line)
    print(
        f"rounds: tiny {args.rounds_tiny}, ~110M {args.rounds_large}, qwen2_moe {args.rounds_qwen}; "
        "one sample of each variant per round, order rotated"
    )
    with tempfile.TemporaryDirectory(prefix="hfpatch-bench-") as directory:
        work = Path(directory)
        llama_section(work, {"tiny": args.rounds_tiny, "large": args.rounds_large}, profile=not args.no_profile)
        if args.rounds_qwen > 0:
            qwen_section(work, args.rounds_qwen, profile=not args.no_profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
