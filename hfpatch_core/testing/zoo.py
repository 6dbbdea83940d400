"""A pack against every model type of the installed transformers: the measured coverage table.

``zoo(pack)`` builds a tiny checkpoint of each causal-LM and image-text-to-text model type
(``zoo_model_types``, ``tiny_checkpoint``),
plans the pack on it, and verifies it where it replaces something
(``check_pack_equivalence``: weights, fp32 logits, greedy generation, the saved layout).
Each model type gets one verdict:

* ``exact``: the pack replaced classes or installed model steps, and every check passed;
* ``failed``: the pack replaced classes or installed model steps, and a check failed (the first
  failure is the detail);
* ``refused``: the pack found what it patches but refused it, with its reason (``Refusal``);
* ``not applicable``: the pack has nothing for this model type;
* ``no checkpoint``: no tiny checkpoint of this model type could be built, or vanilla transformers
  cannot load it and run a padded batch, or (for a pack of model steps) a training step on it
  (the pack is not to blame).

``hfpatch verify PACK --all-model-types`` prints the table for one pack; ``make zoo``
writes ``docs/zoo.md`` for every first-party pack (``.ci/zoo.py``).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "VERDICTS",
    "ZooRow",
    "causal_lm_model_types",
    "coverage",
    "coverage_sentence",
    "offers_anything",
    "update_zoo_markers",
    "verdict_of",
    "zoo",
    "zoo_model_types",
]

Verdict = Literal["exact", "failed", "refused", "not applicable", "no checkpoint"]

#: Every verdict, in the order a table counts them.
VERDICTS: tuple[Verdict, ...] = ("exact", "failed", "refused", "not applicable", "no checkpoint")


@dataclasses.dataclass(frozen=True)
class ZooRow:
    """One model type's verdict for one pack.

    Attributes:
        pack: the pack verified.
        model_type: the model type.
        verdict: one of ``VERDICTS``.
        detail: the replaced classes and installed model steps (``exact``), the first failure (``failed``), the
            reasons (``refused``), or why no checkpoint (``no checkpoint``); one line.
        seconds: how long the model type took.
        verified: the class and config type the checks loaded (``Qwen3_5ForCausalLM
            (qwen3_5_text)``: a composite model type's tiny checkpoint may be its text
            model's), empty when no checkpoint was built.
        report: the equivalence checks' ``Report`` where they ran (``None`` otherwise).
    """

    pack: str
    model_type: str
    verdict: Verdict
    detail: str = ""
    seconds: float = 0.0
    verified: str = ""
    report: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"ZooRow.verdict must be one of {VERDICTS}, got {self.verdict!r}")

    @property
    def ok(self) -> bool:
        """Whether the row is no failure of the pack (every verdict but ``failed``)."""
        return self.verdict != "failed"

    def to_json(self) -> dict[str, Any]:
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "report"}
        return {**fields, "report": self.report.to_json() if self.report is not None else None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ZooRow:
        """The row ``to_json`` wrote (``hfpatch verify --json``'s ``rows``), without its report (``None``)."""
        names = {field.name for field in dataclasses.fields(cls)} - {"report"}
        return cls(**{name: value for name, value in data.items() if name in names})


def causal_lm_model_types() -> list[str]:
    """Every model type of the installed transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def zoo_model_types() -> list[str]:
    """The model types the zoo verifies: the causal-LM mapping's and the image-text-to-text
    mapping's (composite models: llava, qwen2_5_vl, gemma3, mllama, ...), sorted."""
    from transformers.models.auto import modeling_auto

    composite = getattr(modeling_auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    return sorted({*causal_lm_model_types(), *composite})


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _refusals(plan: Any) -> list[str]:
    """The reasons a plan's packs refused targets, ``target: reason`` each."""
    if plan is None:
        return []
    found = []
    for inner in plan.all_plans():
        found += [f"{refused.target}: {refused.reason}" for refused in inner.refused]
    return list(dict.fromkeys(found))


def offers_anything(pack: str, checkpoint: Path) -> bool:
    """Whether ``pack``'s hooks return anything for the model of ``checkpoint`` or its text model:
    a patch, a converter, a refusal or a hook failure (``verdict_of`` says "not applicable" where not).

    Asked of the installed pack without loading a weight (the checkpoint's config only), so
    that a model type the pack has nothing for costs milliseconds, not two loads and a
    generation; ``hfpatch demo --model`` picks the packs to show with it.
    """
    from transformers import AutoConfig

    from .._pipeline.gathering import PackSet
    from .._pipeline.model_types import model_class_for
    from .._pipeline.selection import current_selection
    from .._runtime.snapshot import HOOK_GUARD
    from ..context import LoadContext

    config = AutoConfig.from_pretrained(checkpoint)
    packs = PackSet(current_selection(pack, origin="the zoo").packs, guard=HOOK_GUARD)
    root = LoadContext.for_model(model_class_for(config), config)
    contexts = [root]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config and getattr(text, "model_type", None):
        contexts.append(LoadContext(text.model_type, root.model_class_name, config=text, parent=root))
    for context in contexts:
        gathered = packs.gather(context)
        if gathered.claims or gathered.converters or gathered.steps or gathered.refused or gathered.failures:
            return True
    return False


def _vanilla_problem(checkpoint: Path, generate_tokens: int = 0) -> str | None:
    """Why vanilla transformers cannot load ``checkpoint`` whole (no key missing or unexpected), run a
    padded batch, save it in its source layout and generate from it as the verdict
    compares (``None``: it can).  Asked only when a check failed."""
    import torch

    from .models import comparison_prompts, load_model, logits_of, safetensors_of, tensor_differences

    try:
        model, info = load_model(checkpoint, output_loading_info=True)
        wrong = sorted(str(key) for kind in ("missing_keys", "unexpected_keys") for key in info.get(kind) or ())
        if wrong:  # the tiny checkpoint's save and load disagree (shieldgemma2): nothing to compare with
            return (
                f"vanilla transformers does not load it whole ({len(wrong)} keys missing or unexpected, {wrong[0]} ...)"
            )
        ids, mask = comparison_prompts(model.config)
        logits_of(model, ids, mask)
        try:
            source = safetensors_of(checkpoint)
        except FileNotFoundError:  # another format: no layout to compare, as the round-trip check says
            source = {}
        layout: list[str] = []
        if source:
            with tempfile.TemporaryDirectory(prefix="hfpatch-zoo-vanilla-") as saved:
                model.save_pretrained(saved)
                layout = tensor_differences(source, safetensors_of(saved))
        if layout:  # bert-generation on 5.3 writes LayerNorm's gamma/beta back as weight/bias
            return f"vanilla transformers does not save it in its source layout ({', '.join(layout[:3])} ...)"
        if generate_tokens:
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=generate_tokens, do_sample=False)
    except Exception as exc:  # the tiny checkpoint of a model type may fail in any way
        return f"vanilla transformers cannot run it: {type(exc).__name__}: {exc}"
    return None


def verified_as(checkpoint: Path) -> str:
    """What the checks load from ``checkpoint``, in words: its class and config type
    (``Qwen3_5ForCausalLM (qwen3_5_text)``), or the config type alone."""
    import json

    try:
        saved = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    names = saved.get("architectures") or []
    model_type = str(saved.get("model_type", ""))
    return f"{names[0]} ({model_type})" if names else model_type


def verdict_of(
    pack: str,
    model_type: str,
    directory: Path,
    *,
    checkpoint: Path | None = None,
    generate_tokens: int = 8,
    dtype: Any = None,
    apply_path: bool = True,
    train_steps: int = 0,
) -> ZooRow:
    """The verdict of ``pack`` on a tiny checkpoint of ``model_type`` built in ``directory``.

    The one verdict ``hfpatch verify`` (with or without ``--all-model-types``) and ``make zoo``
    give a (pack, model type): a failure of the tooling (no tiny checkpoint builds, or vanilla
    transformers cannot load and run it) is ``no checkpoint``, never the pack's ``failed``.

    Args:
        pack: the pack's name, installed in this environment.
        model_type: the model type (a label only when ``checkpoint`` is given).
        directory: where the tiny checkpoint is built (the caller owns it).
        checkpoint: verify on this checkpoint directory instead of a tiny one.
        generate_tokens: greedy tokens compared.
        dtype: the dtype both models load in (default float32; in bfloat16 the logits bound is
            calibrated in the run, ``check_pack_equivalence``).
        apply_path: also apply the pack in place to the vanilla model and compare (``verify`` does).
        train_steps: also train for this many steps and compare (``verify --train``).
    """
    import torch

    from .checkpoints import tiny_checkpoint
    from .equivalence import VANILLA_CANNOT_TRAIN, check_pack_equivalence

    start = time.perf_counter()
    verified = ""

    def row(verdict: Verdict, detail: str = "", report: Any = None) -> ZooRow:
        seconds = round(time.perf_counter() - start, 2)
        return ZooRow(pack, model_type, verdict, _one_line(detail), seconds, verified, report)

    if checkpoint is None:
        try:
            checkpoint = tiny_checkpoint(model_type, directory / model_type)
        except Exception as exc:  # any model type may fail to build in its own way
            return row("no checkpoint", f"{type(exc).__name__}: {exc}")
    verified = verified_as(checkpoint)
    try:
        if not offers_anything(pack, checkpoint):
            return row("not applicable")
        report = check_pack_equivalence(
            pack,
            checkpoint,
            generate_tokens=generate_tokens,
            dtype=dtype if dtype is not None else torch.float32,
            apply_path=apply_path,
            train_steps=train_steps,
        )
    except Exception as exc:
        vanilla = _vanilla_problem(checkpoint, generate_tokens)
        return row("no checkpoint", vanilla) if vanilla else row("failed", f"{type(exc).__name__}: {exc}")
    refusals = _refusals(report.plan)
    if not report.replaced and not report.steps:
        loading = [failure for failure in report.failures if failure.startswith("loading with pack")]
        if loading:
            vanilla = _vanilla_problem(checkpoint, generate_tokens)
            return row("no checkpoint", vanilla, report) if vanilla else row("failed", loading[0], report)
        if refusals:
            return row("refused", "; ".join(refusals), report)
        return row("not applicable", "", report)
    if report.failures:
        untrainable = [failure for failure in report.failures if failure.startswith(VANILLA_CANNOT_TRAIN)]
        if untrainable:
            return row("no checkpoint", untrainable[0], report)
        vanilla = _vanilla_problem(checkpoint, generate_tokens)
        return row("no checkpoint", vanilla, report) if vanilla else row("failed", report.failures[0], report)
    replaced = ", ".join(
        [
            *(f"{original} <- {replacement}" for original, replacement in sorted(report.replaced.items())),
            *(f"model step {step}" for step in report.steps),
        ]
    )
    if refusals:
        replaced += f" (refused: {'; '.join(refusals)})"
    return row("exact", replaced, report)


def zoo(
    pack: str,
    model_types: Iterable[str] | None = None,
    *,
    generate_tokens: int = 8,
    dtype: Any = None,
    progress: Callable[[ZooRow, int, int], None] | None = None,
) -> list[ZooRow]:
    """Verify ``pack`` on every model type of ``zoo_model_types()`` (or ``model_types``), one row each.

    Args:
        pack: the pack's name, installed in this environment.
        model_types: the model types to verify (default: ``zoo_model_types()``).
        generate_tokens: greedy tokens compared per model type.
        dtype: the dtype both models load in (default float32).
        progress: called after each model type with its row, its number and the total.

    Returns:
        One ``ZooRow`` per model type, in the order given.
    """
    types = list(model_types) if model_types is not None else zoo_model_types()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hfpatch-zoo-") as directory:
        for number, model_type in enumerate(types, 1):
            row = verdict_of(pack, model_type, Path(directory), generate_tokens=generate_tokens, dtype=dtype)
            rows.append(row)
            if progress is not None:
                progress(row, number, len(types))
    return rows


def coverage(rows: Sequence[ZooRow]) -> dict[str, int]:
    """How many rows have each verdict (every verdict present, 0 where none)."""
    counts: dict[str, int] = dict.fromkeys(VERDICTS, 0)
    for row in rows:
        counts[row.verdict] += 1
    return counts


def coverage_sentence(counts: dict[str, int], transformers_version: str) -> str:
    """How a pack's coverage is written wherever the docs state it (``exact on 142 of 152 candidate
    model types (93%) of transformers 5.25.0``): one wording, generated from ``coverage`` counts."""
    candidates = counts["exact"] + counts["failed"] + counts["refused"]
    if not candidates:
        return f"no candidate model type in transformers {transformers_version}"
    share = f"{counts['exact'] / candidates:.0%}"
    return (
        f"exact on {counts['exact']} of {candidates} candidate model types ({share}) "
        f"of transformers {transformers_version}"
    )


#: A coverage statement in a README, rewritten by ``make zoo`` from the table: ``<!-- zoo:PACK -->...<!-- /zoo -->``.
ZOO_MARKER = r"<!-- zoo:(?P<pack>[\w.-]+) -->(?P<text>.*?)<!-- /zoo -->"


def update_zoo_markers(text: str, sentences: dict[str, str]) -> str:
    """``text`` with every zoo marker of a pack in ``sentences`` holding that pack's sentence."""
    import re

    def replace(match: re.Match[str]) -> str:
        pack = match.group("pack")
        body = sentences.get(pack, match.group("text"))
        return f"<!-- zoo:{pack} -->{body}<!-- /zoo -->"

    return re.sub(ZOO_MARKER, replace, text, flags=re.DOTALL)
