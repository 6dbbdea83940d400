"""The llm-compressor table of docs/quantization.md: scheme x family x (llm-compressor alone / the pack).

Run in ``.venv-interop`` (``make venv-interop``; about 2 minutes)::

    cd interop && PYTHONPATH=../.venv-interop/first-party-packs ../.venv-interop/bin/python quantization_table.py
    cd interop && PYTHONPATH=../.venv-interop/first-party-packs ../.venv-interop/bin/python \
        quantization_table.py --write ../docs/quantization.md

For each family (its pack), scheme and side, on a tiny checkpoint (2 layers, 4 experts): a load
with or without the pack, ``oneshot`` with the scheme, the compressed save, and the reloads.
What each column says:

* experts quantized: expert projections holding a quantization scheme after ``oneshot``, of all
  (``-``: a dense model);
* calibrated: the share of the calibration tokens each expert projection saw (the lowest and
  the highest), for schemes with static activation scales (FP8), under ``oneshot``'s default
  ``moe_calibrate_all_experts=True``: 100% where every expert sees every token;
* saved names: the checkpoint's own (``original``) or other ones;
* reload without / with the pack: ``exact`` (the quantized model's logits), the largest logit
  difference, or why it fails.

vLLM is not in the table: its CPU engine is not installed here yet (the engine issue).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers
from harness import SCHEMES, SIZES, ids, load, logits, quantize
from safetensors.torch import load_file

from hfpatch_core.testing import tiny_checkpoint

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

BEGIN, END = "<!-- table:llmcompressor -->", "<!-- /table:llmcompressor -->"


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


def row(family: Family, checkpoint: Path, scheme: str, pack: str | None, scratch: Path) -> list[str]:
    rows: dict[int, int] = {}

    def count(module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
            rows[id(module)] = rows.get(id(module), 0) + args[0].reshape(-1, args[0].shape[-1]).shape[0]

    cells = []
    try:
        model = load(checkpoint, pack)
    except Exception as exc:
        return [short(exc)] + [""] * 4
    tokens = ids(model)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        quantize(model, scheme)
    except Exception as exc:
        return [short(exc)] + [""] * 4
    finally:
        handle.remove()
    quantized = logits(model, tokens)
    experts = expert_linears(model)
    if experts:
        schemes = sum(getattr(linear, "quantization_scheme", None) is not None for linear in experts)
        cells.append(f"{schemes}/{len(experts)}")
        cells.append(coverage(model, rows) if SCHEMES[scheme][0] else "data-free")
    else:
        cells += ["-", "-"]
    out = scratch / f"{family.model_type}-{scheme}-{pack or 'none'}"
    try:
        model.save_pretrained(out, save_compressed=True)
    except Exception as exc:
        return [*cells, f"save fails: {short(exc)}", "", ""]
    original = {key.rsplit(".", 1)[0] for key in load_file(checkpoint / "model.safetensors")}
    saved = {key.rsplit(".", 1)[0] for key in load_file(out / "model.safetensors")}
    cells.append("original" if saved == original else f"{len(saved - original)} not the checkpoint's")
    for side in (None, family.pack):
        try:
            cells.append(difference(load(out, side), tokens, quantized))
        except Exception as exc:
            cells.append(short(exc))
    return cells


def table() -> str:
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
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    with tempfile.TemporaryDirectory() as scratch:
        for family in FAMILIES:
            checkpoint = tiny_checkpoint(family.model_type, Path(scratch) / family.model_type, **family.overrides)
            for scheme in SCHEMES:
                for pack in (None, family.pack):
                    print(f"{family.model_type} {scheme} {pack or 'llm-compressor alone'}", file=sys.stderr)
                    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                        warnings.simplefilter("ignore")
                        cells = row(family, checkpoint, scheme, pack, Path(scratch))
                    side = f"`{pack}`" if pack else "llm-compressor alone"
                    label = f"{family.model_type} (`{family.pack}`)"
                    cells = [cell.replace("|", "/") for cell in cells]
                    lines.append("| " + " | ".join([label, scheme, side, *cells]) + " |")
                shutil.rmtree(Path(scratch) / "out", ignore_errors=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="replace the table between the markers in this file")
    args = parser.parse_args()
    from llmcompressor import __version__ as llmcompressor_version
    from loguru import logger

    logger.remove()  # llm-compressor logs every step to stdout, where the table goes

    text = (
        f"llmcompressor {llmcompressor_version}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}; `interop/quantization_table.py`\n\n{table()}"
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
