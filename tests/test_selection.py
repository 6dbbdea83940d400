from __future__ import annotations

import pytest

from hfpatch_core import PackError, SelectionError
from hfpatch_core._pipeline.discovery import Discovery, PackInfo
from hfpatch_core._pipeline.selection import parse_selection, select


@pytest.mark.parametrize(
    ("text", "mode", "included", "excluded", "offsets"),
    [
        (None, "all", (), (), {}),
        ("", "none", (), (), {}),
        ("none", "none", (), (), {}),
        (" none ", "none", (), (), {}),
        ("a,b", "only", ("a", "b"), (), {}),
        (" a , b ,", "only", ("a", "b"), (), {}),
        ("-a", "all", (), ("a",), {}),
        ("all,-a, -b", "all", (), ("a", "b"), {}),
        ("all", "all", (), (), {}),
        ("a@+10", "only", ("a",), (), {"a": 10}),
        ("all,qwen-moe@-5", "all", ("qwen-moe",), (), {"qwen-moe": -5}),
        ("a@3,b", "only", ("a", "b"), (), {"a": 3}),
    ],
)
def test_parse_selection(text: str | None, mode: str, included: tuple, excluded: tuple, offsets: dict) -> None:
    spec = parse_selection(text)
    assert (spec.mode, spec.included, spec.excluded, dict(spec.priority_offsets)) == (mode, included, excluded, offsets)


def test_parse_selection_takes_a_list_like_enable() -> None:
    assert parse_selection(["all", "-a", "b@+2"]) == parse_selection("all,-a,b@+2")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("none,a", "'none' cannot be combined"),
        ("-a,b", "start with 'all'"),
        ("a,-a", "both enabled and disabled"),
        ("-a@3", "both disables a pack and sets its priority"),
        ("a@x", "'a@x' is not a pack name"),
        ("a@1,a@2", "two priority offsets"),
        ("a b", "'a b' is not a pack name"),
        ("@3", "'@3' is not a pack name"),
    ],
)
def test_malformed_selection_says_what_and_how(text: str, problem: str) -> None:
    with pytest.raises(SelectionError, match=problem) as caught:
        parse_selection(text)
    assert f"HF_PATCH_PACKS={text!r}" in str(caught.value) and "'all,-a'" in str(caught.value)


def _info(name: str, transformers_range: str = "") -> PackInfo:
    return PackInfo(
        name=name, value=name, distribution=f"hfpatch-pack-{name}", version="1.0", transformers_range=transformers_range
    )


DISCOVERY = Discovery(
    packs={name: _info(name) for name in ("alpha", "beta", "qwen-moe")} | {"future": _info("future", ">=6")},
    duplicates={"twin": (_info("twin"), PackInfo("twin", "other", "other-dist", "2.0"))},
)


def test_select_reports_why_each_pack_is_off() -> None:
    selection = select(parse_selection("all,-beta"), DISCOVERY, "5.24.0")
    assert sorted(selection.packs) == ["alpha", "qwen-moe"]
    assert selection.status["beta"] == "disabled: excluded by HF_PATCH_PACKS='all,-beta'"
    assert selection.status["future"] == "skipped: needs transformers>=6, installed 5.24.0"
    assert selection.status["twin"].startswith("error: pack name 'twin' is declared by hfpatch-pack-twin 1.0")
    future, twin = selection.problems
    assert isinstance(future, PackError) and "supports transformers>=6 but 5.24.0 is installed" in str(future)
    assert "other-dist 2.0" in str(twin)


def test_select_only_listed_and_none() -> None:
    only = select(parse_selection("alpha@+4"), DISCOVERY, "5.24.0")
    assert list(only.packs) == ["alpha"] and only.priority_offset("alpha") == 4 and only.priority_offset("beta") == 0
    assert only.status["beta"] == "disabled: not listed in HF_PATCH_PACKS='alpha@+4'"
    assert not only.problems  # the incompatible and duplicate packs are not asked for
    none = select(parse_selection("none"), DISCOVERY, "5.24.0")
    assert not none.packs and set(none.status.values()) == {"disabled: HF_PATCH_PACKS=none"}


@pytest.mark.parametrize("text", ["qwen-mo", "all,-qwen_moe", "all,qwenmoe@+1"])
def test_unknown_pack_lists_installed_and_closest(text: str) -> None:
    with pytest.raises(SelectionError) as caught:
        select(parse_selection(text), DISCOVERY, "5.24.0")
    message = str(caught.value)
    assert "which is not installed (installed packs: alpha, beta, future, qwen-moe, twin)" in message
    assert "did you mean 'qwen-moe'?" in message


def test_unknown_pack_when_nothing_is_installed() -> None:
    with pytest.raises(SelectionError, match=r"no pack is installed"):
        select(parse_selection("a"), Discovery(packs={}), "5.24.0")


@pytest.mark.parametrize("packs", [42, [1], b"a", {"a": 1}, ["a", None]])
def test_a_choice_that_is_not_text_is_a_selection_error(packs: object) -> None:
    import hfpatch_core

    with pytest.raises(SelectionError, match=r"is not a pack choice: pass a string in HF_PATCH_PACKS syntax"):
        hfpatch_core.enable(packs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "keyword"), [("ALL", "all"), ("NONE", "none"), ("None,alpha", "none")])
def test_a_keyword_in_upper_case_gets_a_hint(text: str, keyword: str) -> None:
    with pytest.raises(SelectionError, match=rf"did you mean the keyword '{keyword}'\? \(keywords are lower case\)"):
        select(parse_selection(text), DISCOVERY, "5.24.0")
