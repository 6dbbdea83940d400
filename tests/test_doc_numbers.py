"""The numbers the docs state have one source each (issue 40: READMEs said "126 of 134" and
"tested with 5.24.0" while the zoo table and the pins said otherwise).

* coverage: every ``<!-- zoo:PACK -->...<!-- /zoo -->`` statement holds what docs/zoo.md's
  table measured for that pack (``make zoo`` rewrites both, ``testing.zoo.coverage_sentence``);
* tested releases: every "Tested with transformers A and B" names the two pins of ``make test``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from hfpatch_core.testing.zoo import VERDICTS, ZOO_MARKER, ZooRow, coverage, coverage_sentence, update_zoo_markers

pytestmark = pytest.mark.release_independent

ROOT = Path(__file__).resolve().parent.parent
READMES = [ROOT / "README.md", *sorted(ROOT.glob("plugins/**/README.md"))]


def zoo_table() -> tuple[str, dict[str, dict[str, int]]]:
    text = (ROOT / "docs" / "zoo.md").read_text()
    version = re.search(r"with transformers (\S+):", text)
    assert version, "docs/zoo.md names no transformers version"
    counts = {}
    for pack, *cells in re.findall(r"^\| `([\w.-]+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", text, re.M):
        counts[pack] = dict(zip(VERDICTS, map(int, cells), strict=True))
    return version.group(1), counts


def test_every_coverage_statement_is_the_zoo_tables() -> None:
    version, counts = zoo_table()
    sentences = {pack: coverage_sentence(counted, version) for pack, counted in counts.items()}
    found = 0
    for readme in READMES:
        text = readme.read_text()
        for match in re.finditer(ZOO_MARKER, text, re.DOTALL):
            found += 1
            assert match.group("pack") in sentences, f"{readme}: no zoo row for {match.group('pack')!r}"
        assert update_zoo_markers(text, sentences) == text, f"{readme}: a coverage statement is not docs/zoo.md's"
    assert found >= 6  # the README's pack table and plugins/README.md's, at least


def test_no_readme_states_a_coverage_count_outside_a_marker() -> None:
    for readme in READMES:
        outside = re.sub(ZOO_MARKER, "", readme.read_text(), flags=re.DOTALL)
        stated = re.findall(r"exact on \d+ of \d+", outside)
        assert not stated, f"{readme}: {stated} is not generated from docs/zoo.md; use <!-- zoo:PACK --><!-- /zoo -->"


def test_tested_releases_are_the_pinned_ones() -> None:
    def pin(name: str) -> str:
        found = re.search(r"^transformers==(\S+)", (ROOT / name).read_text(), re.M)
        assert found
        return found.group(1)

    pinned = {pin("constraints.txt"), pin("constraints-oldest.txt")}
    for readme in READMES:
        for newest, oldest in re.findall(r"Tested with\s+transformers (\d[\w.]*) and (\d[\w.]*)", readme.read_text()):
            assert {newest, oldest} == pinned, f"{readme}: tested with {newest} and {oldest}, the pins are {pinned}"


def test_a_marker_is_rewritten_with_the_sentence() -> None:
    text = "before <!-- zoo:a -->old\ntext<!-- /zoo --> after <!-- zoo:b -->kept<!-- /zoo -->"
    assert (
        update_zoo_markers(text, {"a": "new"})
        == "before <!-- zoo:a -->new<!-- /zoo --> after <!-- zoo:b -->kept<!-- /zoo -->"
    )


def _script(relative: str) -> Any:
    """A script of the repository (``bench/chunked_loss.py``, ``.ci/zoo.py``), imported from its path: scripts
    are not a package. Its folder is on ``sys.path`` while it imports, as when it runs (``bench/_common``)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def test_make_zoo_counts_verdicts_with_the_zoos_coverage() -> None:
    rows = [
        ZooRow("p", "llama", "exact", "LlamaMLP", 1.5, "LlamaForCausalLM (llama)"),
        ZooRow("p", "qwen2", "exact"),
        ZooRow("p", "gpt2", "not applicable"),
        ZooRow("p", "mixtral", "refused", "a reason"),
        ZooRow("p", "qwen2_vl", "no checkpoint", "too large"),
    ]
    written = [row.to_json() for row in rows]  # what `hfpatch verify --json` writes and make zoo reads
    assert [ZooRow.from_json(row) for row in written] == rows
    zoo = _script(".ci/zoo.py")
    assert zoo.counts_of(written) == coverage(rows) == {**dict.fromkeys(VERDICTS, 1), "exact": 2, "failed": 0}
    summary = zoo.table({"p": written}, "5.0.0", "2026-01-01").splitlines()
    assert "| `p` | 2 | 0 | 1 | 1 | 1 | 67% (2/3) |" in summary
    with pytest.raises(ValueError, match="verdict must be one of"):
        zoo.counts_of([{**written[0], "verdict": "exactish"}])


def _rounded_ratio_holds(value: float, reference: float, ratio: float, digits: int) -> bool:
    """``ratio`` (printed to 2 decimals) is value / reference for some values that print as these."""
    half = 0.5 * 10.0**-digits
    low = max(value - half, 0.0) / (reference + half)
    high = (value + half) / max(reference - half, 1e-12)
    return low - 0.005 <= ratio <= high + 0.005


def test_the_chunked_loss_pages_show_one_run_of_the_bench() -> None:
    """Issue 44.7: docs/chunked-loss.md said 2.34x and docs/benchmarks.md 0.97x for the same row."""
    bench = _script("bench/chunked_loss.py")
    regions = {}
    for page in bench.DOCS:
        text = page.read_text()
        found = bench.MARKER.findall(text)
        assert len(found) == 1, f"{page.name}: {len(found)} <!-- bench:chunked-loss --> regions, not one"
        regions[page.name] = found[0][1]
        # the summary row (docs/benchmarks.md) is the one its tables give; `--write` rewrites both
        assert bench.update_markers(text, found[0][1]) == text, f"{page.name}: a summary is not its tables'"
    assert len(set(regions.values())) == 1, "the pages show different runs: rerun bench/chunked_loss.py --write"
    assert bench.SUMMARY_MARKER.search((ROOT / "docs" / "benchmarks.md").read_text())
    parsed = bench.parse(next(iter(regions.values())))
    assert parsed["sides"][:2] == ["vanilla", "chunked-loss"] and len(parsed["peak"]) >= 1
    assert parsed["peak"].keys() == parsed["seconds"].keys() == parsed["once"].keys()
    for name, digits in (("peak", 0), ("seconds", 2)):
        for row, cells in parsed[name].items():
            reference, _ = cells[0]
            for value, ratio in cells[1:]:
                assert ratio is not None and _rounded_ratio_holds(value, reference, ratio, digits), (name, row)


def test_no_chunked_loss_row_is_stated_outside_the_bench_region() -> None:
    bench = _script("bench/chunked_loss.py")
    row = re.compile(r"(32,?000|128,?256|151,?936)\s*\|?\s+(2,?048|4,?096)\s*\|")
    for page in bench.DOCS:
        outside = bench.MARKER.sub("", page.read_text())
        assert not row.findall(outside), f"{page.name} states chunked-loss bench rows outside the generated region"


def test_the_chunked_loss_tables_round_trip() -> None:
    """What the bench renders is what the checks above parse, and a wrong ratio fails them."""
    bench = _script("bench/chunked_loss.py")
    side = {"peak": 2**30, "cpu": 2.0, "wall": 3.0, "first": 4.0, "install": 0.5, "loss": 10.0, "device": "cpu"}
    measured = {
        "vanilla": side,
        "chunked-loss": {**side, "peak": 2**28, "cpu": 1.5},
        "trl": {**side, "peak": 2**31, "cpu": 4.0},
        "cce": {**side, "peak": 2**29, "cpu": 1.0, "first": 60.0},
    }
    context = dict.fromkeys(("command", "when", "commit", "transformers", "torch", "machine"), "x")
    context.update(load_start="1.0", load_end="2.0")
    block = bench.render([(32000, 2048, measured)], list(bench.SIDES), context)
    parsed = bench.parse(block)
    assert parsed["peak"][(32000, 2048)] == [(1024.0, None), (256.0, 0.25), (2048.0, 2.0), (512.0, 0.5)]
    assert parsed["seconds"][(32000, 2048)][1:] == [(1.5, 0.75), (4.0, 2.0), (1.0, 0.5)]
    assert parsed["once"][(32000, 2048)] == [(4.0, None), (0.5, None), (0.5, None), (60.0, None)]
    # the pack's peak is the smallest, its time not (CCE's is smaller): the summary says so
    assert bench.summary(parsed).endswith("| **missed**: seconds at 32,000 x 2,048")
    fastest = {**measured, "chunked-loss": {**side, "peak": 2**28, "cpu": 0.5}}
    assert bench.summary(bench.parse(bench.render([(32000, 2048, fastest)], list(bench.SIDES), context))).endswith(
        "| **met** on every row"
    )
    assert not _rounded_ratio_holds(256.0, 1024.0, 0.26, 0)
    text = "a\n<!-- bench:chunked-loss -->\nold\n<!-- /bench -->\nb <!-- bench:chunked-loss-summary -->s<!-- /bench -->"
    written = bench.update_markers(text, block)
    assert bench.MARKER.findall(written)[0][1] == block
    assert bench.SUMMARY_MARKER.findall(written)[0][1] == bench.summary(parsed)


def _printed_bounds(cell: str) -> tuple[float, float]:
    """The values that print as ``cell`` (``1.70e-02``, ``11.33%``, ``0.41x``): half its last digit either side."""
    text = cell.replace(",", "")
    scale = 0.01 if text.endswith("%") else 1.0
    mantissa, _, exponent = text.rstrip("%x").partition("e")
    decimals = len(mantissa.partition(".")[2])
    value = float(mantissa) * 10.0 ** int(exponent or 0)
    half = 0.5 * 10.0 ** (int(exponent or 0) - decimals)
    return (value - half) * scale, (value + half) * scale


def _check_vllm_routing_block(bench: Any, block: str) -> None:
    """A region of section 10 is one run of the bench: its command, no expert set differing under the replay,
    each share the count's, each ratio the values' (to the printed digits)."""
    parsed = bench.parse(block)
    assert parsed["command"].startswith("bench/vllm_routing_mismatch.py"), parsed["command"]
    for dtype, rows in ((key, value) for key, value in parsed.items() if key != "command"):
        live, replayed, ratio = rows["without replay"], rows["with replay"], rows["with / without"]
        assert replayed["differing"].startswith("0 of "), f"{dtype}: experts differ under the replay"
        for side in (live, replayed):
            differing, total = (int(number.replace(",", "")) for number in side["differing"].split(" of "))
            low, high = _printed_bounds(side["share"])
            assert low <= differing / total <= high, (dtype, side)
        assert live["differing"].split(" of ")[1] == replayed["differing"].split(" of ")[1]
        for column in ("share", "mean", "max", "over"):
            reference_low, reference_high = _printed_bounds(live[column])
            value_low, value_high = _printed_bounds(replayed[column])
            if ratio[column] == "-":
                assert reference_low <= 0.0, (dtype, column, "a ratio is left out only over a zero")
                continue
            low, high = _printed_bounds(ratio[column])
            assert max(value_low, 0.0) / reference_high <= high and value_high / max(reference_low, 1e-300) >= low, (
                dtype,
                column,
            )


def test_the_vllm_routing_section_shows_one_run_of_the_bench() -> None:
    """Issue 53.5: the mismatch vLLM's bf16 rollouts and the transformers bf16 forward have, without and with
    routing replay (``bench/vllm_routing_mismatch.py --write``); the summary row is the table's."""
    bench = _script("bench/vllm_routing_mismatch.py")
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    found = bench.MARKER.findall(text)
    assert len(found) == 1, f"{len(found)} <!-- bench:vllm-routing --> regions, not one"
    assert bench.SUMMARY_MARKER.search(text)
    assert bench.update_markers(text, found[0][1]) == text, "the summary row is not the table's: rerun with --write"
    _check_vllm_routing_block(bench, found[0][1])
    assert "bfloat16" in bench.parse(found[0][1])


def test_the_vllm_routing_table_round_trips() -> None:
    """What the bench renders is what the checks above read, and a wrong ratio or a differing replay fails them."""
    bench = _script("bench/vllm_routing_mismatch.py")
    results = {
        "bfloat16": {
            "without replay": {"differing": 1146, "decisions": 10112, "mean": 0.0415, "max": 0.934, "over": 0.0903},
            "with replay": {"differing": 0, "decisions": 10112, "mean": 0.017, "max": 0.122, "over": 0.0005},
        },
        "float32": {
            "without replay": {"differing": 0, "decisions": 10112, "mean": 1.37e-6, "max": 8.1e-6, "over": 0.0},
            "with replay": {"differing": 0, "decisions": 10112, "mean": 1.36e-6, "max": 6.2e-6, "over": 0.0},
        },
    }
    context = dict.fromkeys(("when", "commit", "vllm", "transformers", "torch", "machine", "policy", "rollouts"), "x")
    block = bench.render(results, {**context, "command": "bench/vllm_routing_mismatch.py --prompts 4"})
    _check_vllm_routing_block(bench, block)
    parsed = bench.parse(block)
    assert parsed["bfloat16"]["without replay"] == {
        "differing": "1,146 of 10,112",
        "share": "11.33%",
        "mean": "4.15e-02",
        "max": "9.34e-01",
        "over": "9.03%",
    }
    assert (
        parsed["bfloat16"]["with / without"]["mean"] == "0.41x" and parsed["float32"]["with / without"]["share"] == "-"
    )
    assert bench.summary(parsed).endswith("| **met**")
    with pytest.raises(AssertionError):
        _check_vllm_routing_block(bench, block.replace("| 0.41x |", "| 0.45x |"))
    differing = {**results, "bfloat16": {**results["bfloat16"], "with replay": {**results["bfloat16"]["with replay"]}}}
    differing["bfloat16"]["with replay"]["differing"] = 3
    assert bench.summary(bench.parse(bench.render(differing, {**context, "command": "x"}))).endswith(
        "**missed**: experts differ under the replay"
    )
    with pytest.raises(AssertionError, match="experts differ under the replay"):
        _check_vllm_routing_block(
            bench, bench.render(differing, {**context, "command": "bench/vllm_routing_mismatch.py"})
        )
