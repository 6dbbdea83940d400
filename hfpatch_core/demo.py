"""``hfpatch demo``: load a tiny model with and without packs and check they agree."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EXAMPLE_PACK = "example-counting"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _install_example_pack(site: Path) -> None:
    """Install the built-in example pack as a real distribution on ``site``."""
    from . import __version__

    dist = site / f"hfpatch_example_counting-{__version__}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: hfpatch-example-counting\n"
        f"Version: {__version__}\nSummary: Example pack: counting Llama MLPs and norms\n"
        "Requires-Dist: transformers>=5.3,<6\n"
    )
    (dist / "entry_points.txt").write_text(f"[hfpatch.packs]\n{EXAMPLE_PACK} = hfpatch_core.examples.counting_mlp\n")
    (dist / "RECORD").write_text("")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()


def _tiny_llama(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(path)


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


def run_demo(model_dir: str | None = None, packs: str | None = None, *, out: Any = None) -> list[Check]:
    """Load ``model_dir`` (default: a tiny random llama) without and with packs; print and return the checks."""
    import torch
    from transformers import AutoModelForCausalLM, monkey_patching

    from .session import disable, enable, plan_of

    write = (out or sys.stdout).write
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="hfpatch-demo-") as tmp, _quiet_transformers():
        if model_dir is None:
            model_dir = str(Path(tmp) / "tiny-llama")
            _tiny_llama(Path(model_dir))
            write(f"Built a tiny random llama checkpoint in {model_dir}\n")
        if packs is None:
            _install_example_pack(Path(tmp) / "site")
            packs = EXAMPLE_PACK
        registry_before = monkey_patching.get_patch_mapping()

        disable()
        vanilla = AutoModelForCausalLM.from_pretrained(model_dir)
        selection = enable(packs)
        write(f"Enabled packs: {', '.join(selection.packs) or 'none'}\n")
        try:
            patched = AutoModelForCausalLM.from_pretrained(model_dir)
        finally:
            disable()
        plan = plan_of(patched)
        if plan is not None:
            write(f"Plan {plan.fingerprint}:\n")
            for name, claim in sorted(plan.replaced.items()):
                write(f"  {name:<28} -> {claim.patch.replacement_name}  [{claim.pack} {claim.version}]\n")
            for lost in plan.lost:
                write(f"  (not applied) {lost.claim.describe()}: {lost.reason}\n")
        replaced = sorted(
            {type(module).__name__ for module in patched.modules()}
            - {type(module).__name__ for module in vanilla.modules()}
        )
        checks.append(Check("classes replaced", bool(replaced), ", ".join(replaced) or "nothing was replaced"))

        vocab = int(vanilla.config.vocab_size)
        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            difference = (vanilla(ids).logits - patched(ids).logits).abs().max().item()
        checks.append(Check("logits match (fp32, atol 1e-5)", difference <= 1e-5, f"max abs diff {difference:.2e}"))

        prompt = ids[:1, :4]
        settings = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
        with torch.no_grad():
            same = torch.equal(vanilla.generate(prompt, **settings), patched.generate(prompt, **settings))
        checks.append(Check("greedy generation matches", same, "10 new tokens"))

        after = monkey_patching.get_patch_mapping()
        clean = after == registry_before and type(AutoModelForCausalLM.from_pretrained(model_dir)) is type(vanilla)
        checks.append(Check("nothing left behind", clean, "patch registry and module classes restored"))

    for check in checks:
        write(f"{'PASS' if check.ok else 'FAIL'}  {check.name}: {check.detail}\n")
    return checks
