"""``hfpatch demo``: load a tiny model without and with a pack, and show that they agree.

By default: a tiny random Qwen2-MoE checkpoint and the ``qwen-moe`` pack when it is
installed (``make demo`` installs it), else a tiny llama and the example pack shipped
with hfpatch-core.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

EXAMPLE_PACK = "example-counting"
FIRST_PARTY_PACK = "qwen-moe"


def _install_example_pack(site: Path) -> None:
    """Install the built-in example pack as a real distribution on ``site``."""
    from . import __version__
    from .testing import install_pack

    install_pack(
        site,
        EXAMPLE_PACK,
        entry_point="hfpatch_core.examples.counting_mlp",
        distribution="hfpatch-example-counting",
        version=__version__,
        summary="Example pack: counting Llama MLPs and norms",
        requires=("transformers>=5.3,<6",),
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _default_pack() -> str | None:
    from .selection import current_selection

    return FIRST_PARTY_PACK if FIRST_PARTY_PACK in current_selection("all").packs else None


def run_demo(model_dir: str | None = None, packs: str | None = None, *, out: TextIO | None = None) -> Any:
    """Run the demo and print it; returns the ``Report``."""
    from transformers import monkey_patching

    from .conversion import describe_transform
    from .testing import check_pack_equivalence, tiny_checkpoint

    stream = out or sys.stdout

    def write(line: str = "") -> None:
        stream.write(line + "\n")

    with tempfile.TemporaryDirectory(prefix="hfpatch-demo-") as tmp, _quiet_transformers():
        pack = packs or _default_pack() or EXAMPLE_PACK
        if pack == EXAMPLE_PACK:
            _install_example_pack(Path(tmp) / "site")
        if model_dir is None:
            model_type = "qwen2_moe" if pack == FIRST_PARTY_PACK else "llama"
            model_dir = str(tiny_checkpoint(model_type, Path(tmp) / f"tiny-{model_type}"))
            write(f"Built a tiny random {model_type} checkpoint in {model_dir}")
        registry_before = monkey_patching.get_patch_mapping()
        write(f"Loading it without packs, then with HF_PATCH_PACKS={pack} ...")
        report = check_pack_equivalence(pack, model_dir)
        plan = report.plan
        write("")
        if plan is not None:
            write(f"Plan {plan.fingerprint} (packs: {', '.join(f'{n} {v}' for n, v in plan.packs)})")
            write("Classes replaced:")
            for name, claim in sorted(plan.replaced.items()):
                if name in report.replaced:
                    write(f"  {name:<26} -> {claim.patch.replacement_name}  [{claim.pack} {claim.version}]")
            if plan.conversions:
                write("Converters applied:")
                for key, entries in plan.conversions.lists.items():
                    for entry in entries:
                        write(f"  {key}: {describe_transform(entry.transform)}  [{entry.origin}]")
                for removal in plan.conversions.removed:
                    write(f"  {removal.key}: removed {describe_transform(removal.transform)}  [by {removal.pack}]")
        write("")
        checks = [
            ("classes replaced", bool(report.replaced), ", ".join(sorted(report.replaced)) or "none"),
            (
                "logits match (fp32, atol 1e-5)",
                report.max_abs_diff is not None and report.max_abs_diff <= 1e-5,
                f"max abs diff {report.max_abs_diff:.2e}" if report.max_abs_diff is not None else "not measured",
            ),
            ("greedy generation matches", bool(report.generation_match), "20 new tokens"),
            ("save round trip", bool(report.round_trip), "original layout written, vanilla reload matches"),
            ("nothing left behind", monkey_patching.get_patch_mapping() == registry_before, "registries restored"),
        ]
        for name, ok, detail in checks:
            write(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
        for failure in report.failures:
            write(f"  - {failure}")
        if not all(ok for _, ok, _ in checks):
            report.failures.append("demo check failed")
    return report
