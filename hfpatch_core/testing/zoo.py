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
    "load_contexts",
    "offers_anything",
    "sweep",
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
            reasons (``refused``), or why no checkpoint (``no checkpoint``); one line, whole (never shortened).
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


def _one_line(text: str) -> str:
    # whole: a refusal's reason is the pack author's answer to "why not this model?" (issue 46.5)
    return " ".join(str(text).split())


def _refusals(plan: Any) -> list[str]:
    """The reasons a plan's packs refused targets, ``target: reason`` each."""
    if plan is None:
        return []
    found = []
    for inner in plan.all_plans():
        found += [f"{refused.target}: {refused.reason}" for refused in inner.refused]
    return list(dict.fromkeys(found))


def load_contexts(config: Any) -> list[Any]:
    """The ``LoadContext`` of each load a checkpoint of ``config`` makes, as its hooks receive them:
    the root's (its class, ``model_class_for``), then each sub-model's that loads in a load of its own
    (``authoring.nested_loads`` of a meta build: a composite's text and vision models, built with
    ``from_config``), with its own class and config and its parent's context, outermost first.

    A pack that claims a composite's text model in that model's own load (the authors' guide's
    advice) is asked with the very context a real load gives it.  Where the composite cannot be
    built on the meta device, the text model is asked as ``AutoModel.from_config(text_config)``
    would build it.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from .._pipeline.model_types import model_class_for
    from ..authoring import build_on_meta, nested_loads, text_decoder_config
    from ..context import LoadContext

    root = LoadContext.for_model(model_class_for(config), config)
    contexts = [root]

    def walk(model: Any, parent: LoadContext) -> None:
        for sub in nested_loads(model).values():
            context = LoadContext.for_model(type(sub), getattr(sub, "config", None), parent=parent)
            contexts.append(context)
            walk(sub, context)

    try:
        walk(build_on_meta(root), root)
    except Exception:  # some models cannot be built on meta: their text model as the composite would build it
        text = text_decoder_config(config)
        if text is not config and getattr(text, "model_type", None):
            name = MODEL_MAPPING_NAMES.get(text.model_type)
            model_class = getattr(transformers, name, None) if isinstance(name, str) else None
            contexts.append(
                LoadContext.for_model(model_class, text, parent=root)
                if isinstance(model_class, type)
                else LoadContext(text.model_type, root.model_class_name, config=text, parent=root)
            )
    return contexts


def offers_anything(pack: str, checkpoint: Path | None, contexts: Sequence[Any] | None = None) -> bool:
    """Whether ``pack``'s hooks return anything for a load of ``checkpoint`` (its root or a
    sub-model's nested load, ``load_contexts``): a patch, a converter, a model step, a refusal or a
    hook failure (``verdict_of`` says "not applicable" where not).

    Asked of the installed pack without loading a weight (the checkpoint's config only), so
    that a model type the pack has nothing for costs milliseconds, not two loads and a
    generation; ``hfpatch demo --model`` picks the packs to show with it.  ``contexts``: the
    checkpoint's ``load_contexts``, when the caller asks several packs about one checkpoint.
    """
    from transformers import AutoConfig

    from .._pipeline.gathering import PackSet
    from .._pipeline.selection import current_selection
    from .._runtime.snapshot import HOOK_GUARD

    if contexts is None:
        if checkpoint is None:
            raise ValueError("offers_anything: pass a checkpoint or its load contexts")
        contexts = load_contexts(AutoConfig.from_pretrained(checkpoint))
    packs = PackSet(current_selection(pack, origin="the zoo").packs, guard=HOOK_GUARD)
    for context in contexts:
        gathered = packs.gather(context)
        if gathered.claims or gathered.converters or gathered.steps or gathered.refused or gathered.failures:
            return True
    return False


def _not_applicable_unbuilt(pack: str, model_type: str) -> str | None:
    """What ``verified_as`` would say of ``model_type``'s tiny checkpoint, when ``pack`` offers nothing
    for it: asked with the config that checkpoint would be saved with, before any weight is built and
    saved (a "not applicable" verdict in the time of a config).  ``None`` when the pack offers something,
    or when the checkpoint is not simply its model type's own class and config (a composite's text
    model, a config that does not shrink or build on meta): those are built and asked as always."""
    import copy

    from .checkpoints import _MOST_PARAMETERS, _built_from, parameter_count, tiny_config

    try:
        config = tiny_config(model_type)
        model_class, own, composite = _built_from(config)
        if composite or own is not config or parameter_count(config) > _MOST_PARAMETERS:
            return None
        saved = copy.deepcopy(config)
        saved.architectures = [model_class.__name__]  # as save_pretrained writes it into config.json
        if offers_anything(pack, None, load_contexts(saved)):
            return None
    except Exception:  # whatever fails here fails again, and is reported, on the way that builds
        return None
    return f"{model_class.__name__} ({saved.model_type})"


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
    contexts: Sequence[Any] | None = None,
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
        contexts: ``load_contexts`` of ``checkpoint``'s config, when several packs are verified on it.
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
        unneeded = _not_applicable_unbuilt(pack, model_type)
        if unneeded is not None:  # nothing to build: the pack has nothing for the checkpoint it would be
            verified = unneeded
            return row("not applicable")
        try:
            checkpoint = tiny_checkpoint(model_type, directory / model_type)
        except Exception as exc:  # any model type may fail to build in its own way
            return row("no checkpoint", f"{type(exc).__name__}: {exc}")
    verified = verified_as(checkpoint)
    try:
        if not offers_anything(pack, checkpoint, contexts):
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
    """Verify ``pack`` on every model type of ``zoo_model_types()`` (or ``model_types``), one row each,
    in this process (``sweep``: several packs, worker processes and known rows).

    Args:
        pack: the pack's name, installed in this environment.
        model_types: the model types to verify (default: ``zoo_model_types()``).
        generate_tokens: greedy tokens compared per model type.
        dtype: the dtype both models load in (default float32).
        progress: called after each model type with its row, its number and the total.

    Returns:
        One ``ZooRow`` per model type, in the order given.
    """
    import torch

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    name = names[dtype if dtype is not None else torch.float32]

    def each(rows: Sequence[ZooRow], number: int, total: int) -> None:
        for row in rows:
            if progress is not None:
                progress(row, number, total)

    return sweep([pack], model_types, dtype=name, jobs=1, generate_tokens=generate_tokens, progress=each)


def _dtype_of(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _verify_model_type(model_type: str, packs: Sequence[str], dtype: str, generate_tokens: int) -> list[ZooRow]:
    """Every pack of ``packs`` on one tiny checkpoint of ``model_type``, built once: one row each.

    Runs in a worker process of ``sweep`` (or in its own, with one job); what a model prints
    goes to stderr, where the progress is.
    """
    import contextlib
    import sys

    from .checkpoints import tiny_checkpoint

    rows: list[ZooRow] = []
    with tempfile.TemporaryDirectory(prefix="hfpatch-zoo-") as scratch, contextlib.redirect_stdout(sys.stderr):
        start = time.perf_counter()
        try:
            checkpoint = tiny_checkpoint(model_type, Path(scratch) / model_type)
        except Exception as exc:  # any model type may fail to build in its own way
            seconds = round(time.perf_counter() - start, 2)
            detail = _one_line(f"{type(exc).__name__}: {exc}")
            return [ZooRow(pack, model_type, "no checkpoint", detail, seconds) for pack in packs]
        try:
            from transformers import AutoConfig

            contexts: list[Any] | None = load_contexts(AutoConfig.from_pretrained(checkpoint))
        except Exception:  # verdict_of says why, pack by pack
            contexts = None
        for pack in packs:
            rows.append(
                verdict_of(
                    pack,
                    model_type,
                    Path(scratch),
                    checkpoint=checkpoint,
                    generate_tokens=generate_tokens,
                    dtype=_dtype_of(dtype),
                    contexts=contexts,
                )
            )
    return rows


def _worker_start(threads: int) -> None:
    """A sweep worker: ``threads`` intra-op threads (the cores shared between the workers), and
    transformers' warnings and progress bars off, as ``hfpatch verify`` has them."""
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    from .._session.announcement import silence

    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    silence()  # the sweep reports what each pack did
    warnings.simplefilter("ignore")


def sweep(
    packs: Sequence[str],
    model_types: Iterable[str] | None = None,
    *,
    dtype: str = "float32",
    jobs: int = 2,
    generate_tokens: int = 8,
    known: Mapping[str, Mapping[str, ZooRow]] | None = None,
    progress: Callable[[Sequence[ZooRow], int, int], None] | None = None,
) -> list[ZooRow]:
    """Verify every pack of ``packs`` on every model type (``zoo_model_types()`` by default): the
    machinery of ``hfpatch verify --all-model-types`` and ``make zoo``.

    One tiny checkpoint is built per model type and every pack is verified on it
    (``verdict_of``); the model types are shared among ``jobs`` worker processes (spawned:
    each imports torch and transformers once). A model type whose worker dies (a crash in
    native code) is verified again alone, and is ``failed`` if it dies again.

    Args:
        packs: the packs' names, installed in this environment (a worker sees the same path).
        model_types: the model types to verify.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: the dtype both models load in.
        jobs: worker processes; 1 verifies in this process.
        generate_tokens: greedy tokens compared per model type.
        known: rows already known (a cache of an earlier run), by pack then model type: those
            are not verified again.
        progress: called in this process as each model type is done, with its rows (the
            known ones included), its number and the total.

    Returns:
        One ``ZooRow`` per pack and model type, packs in the order given, then the model types.
    """
    import concurrent.futures
    import multiprocessing
    import os

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"sweep(dtype=...) takes 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    types = list(dict.fromkeys(model_types if model_types is not None else zoo_model_types()))
    known = known or {}
    found: dict[tuple[str, str], ZooRow] = {}
    work: dict[str, list[str]] = {}
    for model_type in types:
        for pack in packs:
            row = known.get(pack, {}).get(model_type)
            if row is not None:
                found[pack, model_type] = row
            else:
                work.setdefault(model_type, []).append(pack)
    finished: set[str] = set()

    def deliver(model_type: str, rows: Sequence[ZooRow]) -> None:
        finished.add(model_type)
        for row in rows:
            found[row.pack, model_type] = row
        if progress is not None:
            progress([found[pack, model_type] for pack in packs], len(finished), len(types))

    for model_type in types:  # the model types known whole are reported first
        if model_type not in work:
            deliver(model_type, [])
    jobs = max(1, min(jobs, len(work)))
    if jobs == 1:
        for model_type, pending in work.items():
            deliver(model_type, _verify_model_type(model_type, pending, dtype, generate_tokens))
    else:
        import torch

        # the cores this process may use, shared between the workers; never more threads than this
        # process has (OMP_NUM_THREADS=1, as `make` sets it, stays 1)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, min(torch.get_num_threads(), cores // jobs))
        context = multiprocessing.get_context("spawn")  # torch and OpenMP do not survive a fork
        # a round runs every waiting model type; after a round a worker died in, the first of
        # those left runs alone: dying alone, it is the one to blame
        waiting, alone = list(work), False
        while waiting:
            batch = waiting[:1] if alone else waiting
            died = False
            with concurrent.futures.ProcessPoolExecutor(
                len(batch) if alone else jobs, mp_context=context, initializer=_worker_start, initargs=(threads,)
            ) as pool:
                futures = {
                    pool.submit(_verify_model_type, model_type, work[model_type], dtype, generate_tokens): model_type
                    for model_type in batch
                }
                for future in concurrent.futures.as_completed(futures):
                    model_type = futures[future]
                    try:
                        rows = future.result()
                    except concurrent.futures.process.BrokenProcessPool:
                        died = True
                        continue
                    except Exception as exc:  # the rows could not come back (one that does not pickle)
                        detail = _one_line(f"{type(exc).__name__}: {exc}")
                        rows = [ZooRow(pack, model_type, "failed", detail) for pack in work[model_type]]
                    deliver(model_type, rows)
            if alone and died:
                blamed = batch[0]
                detail = "the process verifying it died (a crash in native code?); verify it alone to see why"
                deliver(blamed, [ZooRow(pack, blamed, "failed", detail) for pack in work[blamed]])
            waiting = [model_type for model_type in waiting if model_type not in finished]
            alone = died and not alone
    return [found[pack, model_type] for pack in packs for model_type in types]


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
