"""``hfpatch demo``: load a tiny model without and with packs, and show that they agree.

The packs are those ``--packs`` (or, without it, ``HF_PATCH_PACKS``) selects, as for
every other command.  When neither is given: with ``--model``, every installed pack that
offers something for that model; else the ``qwen-moe`` pack when it is installed
(``make demo`` installs it), else the example pack shipped with hfpatch-core.  The
checkpoint is ``--model``, else a tiny random Qwen2-MoE when ``qwen-moe`` is selected,
else a tiny llama.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from ..errors import HfPatchError

EXAMPLE_PACK = "example-counting"
FIRST_PARTY_PACK = "qwen-moe"


def _install_example_pack(site: Path) -> None:
    """Install the built-in example pack as a real distribution on ``site``."""
    from .. import __version__
    from ..testing import install_pack

    install_pack(
        site,
        EXAMPLE_PACK,
        entry_point="hfpatch_core.examples.counting_mlp",
        distribution="hfpatch-example-counting",
        version=__version__,
        summary="Example pack: counting Llama MLPs and norms",
        requires=("transformers>=5.3,<6",),
    )


class DemoError(HfPatchError, ValueError):
    """``hfpatch demo`` was given a checkpoint it cannot read."""


def _default_pack(model_dir: str | None) -> str:
    """The packs a demo without a choice shows: for ``--model``, every installed pack that offers
    something for that model (asked without loading a weight); else qwen-moe on its tiny
    Qwen2-MoE, or the example pack when qwen-moe is not installed."""
    from .._pipeline.selection import current_selection

    installed = current_selection("all").packs
    if model_dir is not None:
        from ..testing.zoo import offers_anything

        applying = [name for name in sorted(installed) if offers_anything(name, Path(model_dir))]
        if applying:
            return ",".join(applying)
        return "none"
    return FIRST_PARTY_PACK if FIRST_PARTY_PACK in installed else EXAMPLE_PACK


def _in_site_packages(info: Any) -> bool:
    """Whether pack ``info`` is installed in this interpreter's site-packages (as ``pip install`` puts it),
    not only on ``PYTHONPATH``: then the next steps work in a new shell as printed."""
    import site

    location = getattr(getattr(info.entry_point, "dist", None), "_path", None)
    if location is None:
        return False
    sites = [*site.getsitepackages(), site.getusersitepackages()]
    return any(os.path.abspath(Path(location).parent) == os.path.abspath(directory) for directory in sites)


def _scripts_prefix(bin_dir: Path, cwd: Path) -> str:
    """How a shell in ``cwd`` names the programs of ``bin_dir``: nothing when ``hfpatch`` and ``python``
    on ``PATH`` are that directory's (an activated environment), else its path, relative when it is
    under ``cwd`` (``.venv-demo/bin/``)."""
    import shutil

    def ours(program: str) -> bool:
        found = shutil.which(program)
        try:
            return found is not None and os.path.samefile(found, bin_dir / program)
        except OSError:
            return False

    if ours("hfpatch") and ours("python"):
        return ""
    directory = Path(os.path.abspath(bin_dir))
    try:
        return f"{directory.relative_to(Path(os.path.abspath(cwd))).as_posix()}/"
    except ValueError:
        return f"{directory.as_posix()}/"


def next_steps(pack: str = FIRST_PARTY_PACK, model_type: str = "qwen2_moe", *, bin_dir: Path | None = None) -> str:
    """What the demo prints last: the commands a newcomer runs next, written as they work here, with
    this environment's ``hfpatch`` and ``python`` (``bin_dir``, default the running interpreter's
    directory, named as ``_scripts_prefix`` says), for ``pack`` and a model type it patches."""
    prefix = _scripts_prefix(bin_dir if bin_dir is not None else Path(sys.executable).parent, Path.cwd())
    commands = [
        (f"{prefix}hfpatch list", "every installed pack, enabled or not, and why"),
        (f"HF_PATCH_PACKS={pack} {prefix}hfpatch explain {model_type}", f"what {pack} replaces, on the meta device"),
        (f"HF_PATCH_PACKS={pack} HF_PATCH_LOG=info {prefix}python train.py", f"your program, unchanged, with {pack}"),
    ]
    width = max(len(command) for command, _ in commands)
    where = f" ({prefix.rstrip('/').removesuffix('/bin') or 'the active environment'})" if prefix else ""
    lines = [f"Next, with the packs installed in this environment{where}:"]
    lines += [f"  {command:<{width}}  # {why}" for command, why in commands]
    return "\n".join(lines)


def checkpoint_problem(model_dir: str) -> str | None:
    """Why ``--model model_dir`` is not a local checkpoint directory (one line, with the fix); ``None`` when it is."""
    path = Path(model_dir)
    if not path.exists():
        return f"--model {model_dir!r}: the path does not exist; give a local checkpoint directory"
    if not path.is_dir():
        return f"--model {model_dir!r}: not a directory; give a local checkpoint directory"
    if not (path / "config.json").is_file():
        return f"--model {model_dir!r}: no config.json in it; give a checkpoint directory saved by save_pretrained"
    return _unreadable_weights(path)


def _unreadable_weights(path: Path) -> str | None:
    """Which of ``path``'s safetensors files cannot be read (a truncated download), by name: transformers'
    own error names no file.  Only the headers are read."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # safetensors' own error types differ between releases
            return (
                f"--model {str(path)!r}: {file.name} is not a readable safetensors file "
                f"({type(exc).__name__}: {exc}); save or download it again"
            )
    return None


def _check_model_dir(model_dir: str) -> None:
    problem = checkpoint_problem(model_dir)
    if problem is not None:
        raise DemoError(problem)


def run_demo(model_dir: str | None = None, packs: str | None = None, *, out: TextIO | None = None) -> Any:
    """Run the demo and print it.

    Args:
        model_dir: a local checkpoint directory; ``None`` for a tiny random one.
        packs: the packs, in ``HF_PATCH_PACKS`` syntax; ``None`` to read the variable
            (and, when it is unset, the default pack of this module's docstring).

    Returns:
        The ``Report`` of the comparison, or ``None`` when the choice selects no pack.

    Raises:
        SelectionError: the choice is malformed or names a pack that is not installed.
        DemoError: ``model_dir`` is not a checkpoint directory.
        (Both before anything is built or loaded.)
    """
    from transformers import monkey_patching

    from .._pipeline.model_types import transformers_notices_off
    from .._pipeline.selection import current_selection, parse_selection
    from ..conversion import describe_transform
    from ..settings import PACKS_ENV, packs_from_env
    from ..testing import check_pack_equivalence, check_training_equivalence, tiny_checkpoint

    stream = out or sys.stdout

    def write(line: str = "") -> None:
        stream.write(line + "\n")

    choice = packs if packs is not None else packs_from_env()
    if model_dir is not None:
        _check_model_dir(model_dir)
    with tempfile.TemporaryDirectory(prefix="hfpatch-demo-") as tmp, transformers_notices_off():
        if choice is None:
            choice = _default_pack(model_dir)
            if model_dir is not None and choice == "none":
                write(f"No installed pack offers anything for {model_dir}: nothing to demonstrate.")
                return None
        if EXAMPLE_PACK in parse_selection(choice).named:
            _install_example_pack(Path(tmp) / "site")
        selection = current_selection(choice, origin=PACKS_ENV if packs is None else "hfpatch demo --packs")
        if not selection.packs and not selection.problems:
            write(f"No pack to demonstrate: {PACKS_ENV}={choice!r} selects none.")
            return None
        shown_pack = None
        if model_dir is None:
            model_type = "qwen2_moe" if FIRST_PARTY_PACK in selection.packs else "llama"
            if list(selection.packs) == [FIRST_PARTY_PACK] and _in_site_packages(selection.packs[FIRST_PARTY_PACK]):
                shown_pack = FIRST_PARTY_PACK
            model_dir = str(tiny_checkpoint(model_type, Path(tmp) / f"tiny-{model_type}"))
            write(f"Built a tiny random {model_type} checkpoint in {model_dir}")
        registry_before = monkey_patching.get_patch_mapping()
        write(f"Loading it without packs, then with {PACKS_ENV}={choice} ...")
        report = check_pack_equivalence(choice, model_dir)
        plan = report.plan
        write("")
        if plan is not None:
            write(f"Plan {plan.fingerprint} (packs: {', '.join(f'{n} {v}' for n, v in plan.packs)})")
            write("Classes replaced:")
            for name, claim in sorted(plan.replaced.items()):
                if name in report.replaced:
                    write(f"  {name:<26} -> {claim.patch.replacement_name}  [{claim.pack} {claim.version}]")
            if plan.steps:
                write("Model steps:")
                refusals = {(refusal.pack, refusal.target): refusal.reason for refusal in plan.refused}
                for step in plan.steps:
                    refused = refusals.get((step.pack, step.target))
                    verdict = f"refused: {refused}" if refused else f"installed: {step.step.install_name}"
                    write(f"  {step.target:<26} {verdict}  [{step.pack} {step.version}]")
            if plan.conversions:
                write("Converters applied:")
                for key, entries in plan.conversions.lists.items():
                    for entry in entries:
                        write(f"  {key}: {describe_transform(entry.transform)}  [{entry.origin}]")
                for removal in plan.conversions.removed:
                    write(f"  {removal.key}: removed {describe_transform(removal.transform)}  [by {removal.pack}]")
        write("")
        installed = [step.target for step in plan.installed_steps] if plan is not None else []
        applied = [*sorted(report.replaced), *(f"step {target}" for target in installed)]
        checks = [
            ("classes replaced or steps installed", bool(applied), ", ".join(applied) or "none"),
            (
                "logits match (fp32, atol 1e-5)",
                report.max_abs_diff is not None and report.max_abs_diff <= 1e-5,
                f"max abs diff {report.max_abs_diff:.2e}" if report.max_abs_diff is not None else "not measured",
            ),
            ("greedy generation matches", bool(report.generation_match), "20 new tokens"),
            ("save round trip", bool(report.round_trip), "original layout written, vanilla reload matches"),
            ("nothing left behind", monkey_patching.get_patch_mapping() == registry_before, "registries restored"),
        ]
        if installed:  # a step changes training (the logits above are eval's): one AdamW step against vanilla's
            training = check_training_equivalence(choice, model_dir, steps=1)
            checks.insert(
                3,
                (
                    "training step matches",
                    training.ok,
                    f"loss diff {training.max_loss_diff:.1e}, gradient diff {training.max_gradient_diff:.1e}"
                    if training.ok
                    else "; ".join(training.failures),
                ),
            )
        for name, ok, detail in checks:
            write(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
        for failure in report.failures:
            write(f"  - {failure}")
        if not all(ok for _, ok, _ in checks):
            report.failures.append("demo check failed")
        elif shown_pack is not None:  # what to do next, where the pack is installed (not the example pack's site)
            write("")
            write(next_steps(shown_pack, model_type))
    return report
