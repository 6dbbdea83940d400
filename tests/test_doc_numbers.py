"""The numbers the docs state have one source each (issue 40: READMEs said "126 of 134" and
"tested with 5.24.0" while the zoo table and the pins said otherwise).

* coverage: every ``<!-- zoo:PACK -->...<!-- /zoo -->`` statement holds what docs/zoo.md's
  table measured for that pack (``make zoo`` rewrites both, ``testing.zoo.coverage_sentence``);
* tested releases: every "Tested with transformers A and B" names the two pins of ``make test``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from hfpatch_core.testing.zoo import VERDICTS, ZOO_MARKER, ZooRow, coverage, coverage_sentence, update_zoo_markers

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


def _ci_zoo() -> Any:
    """``.ci/zoo.py`` (``make zoo``), imported from its path: it is a script, not a package."""
    spec = importlib.util.spec_from_file_location("ci_zoo", ROOT / ".ci" / "zoo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
    zoo = _ci_zoo()
    assert zoo.counts_of(written) == coverage(rows) == {**dict.fromkeys(VERDICTS, 1), "exact": 2, "failed": 0}
    summary = zoo.table({"p": written}, "5.0.0", "2026-01-01").splitlines()
    assert "| `p` | 2 | 0 | 1 | 1 | 1 | 67% (2/3) |" in summary
    with pytest.raises(ValueError, match="verdict must be one of"):
        zoo.counts_of([{**written[0], "verdict": "exactish"}])
