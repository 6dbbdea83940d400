"""Properties of the ``HF_PATCH_PACKS`` parser (:func:`hfpatch_core._pipeline.selection.parse_selection`)."""

from __future__ import annotations

import re
import string

from hypothesis import example, given, settings
from hypothesis import strategies as st

from hfpatch_core import SelectionError
from hfpatch_core._pipeline.selection import SelectionSpec, parse_selection

RESERVED = ("all", "none")
_FIRST = string.ascii_letters + string.digits
names = st.builds(str.__add__, st.sampled_from(_FIRST), st.text(alphabet=_FIRST + "._-", max_size=12)).filter(
    lambda name: name not in RESERVED
)
offsets = st.integers(min_value=-(10**6), max_value=10**6)
blank = st.text(alphabet=string.whitespace, max_size=3)


def signed(offset: int) -> str:
    return f"{offset:+d}"


@st.composite
def valid_items(draw: st.DrawFn) -> list[str]:
    """The items of a well-formed choice (never raising), in any order."""
    kind = draw(st.sampled_from(["none", "only", "all"]))
    if kind == "none":
        return draw(st.sampled_from([[], ["none"]]))
    chosen = draw(st.lists(names, min_size=1 if kind == "only" else 0, max_size=5, unique=True))
    with_offset = {name: draw(offsets) for name in chosen if draw(st.booleans())}
    items = [f"{name}@{signed(with_offset[name])}" if name in with_offset else name for name in chosen]
    if kind == "all":
        excluded = draw(st.lists(names.filter(lambda name: name not in chosen), max_size=4, unique=True))
        items += [f"-{name}" for name in excluded]
        if chosen or not excluded or draw(st.booleans()):
            items.append("all")
    return draw(st.permutations(items))


def meaning(spec: SelectionSpec) -> tuple[object, ...]:
    """A spec without the text it was parsed from."""
    return spec.mode, spec.included, spec.excluded, dict(spec.priority_offsets)


def parse(text: str) -> tuple[object, ...] | type[SelectionError]:
    try:
        return meaning(parse_selection(text))
    except SelectionError:
        return SelectionError


def render(spec: SelectionSpec) -> str:
    """The canonical text of a parsed choice."""
    if spec.mode == "none":
        return "none"
    items = [
        f"{name}@{signed(spec.priority_offsets[name])}" if name in spec.priority_offsets else name
        for name in spec.included
    ]
    if spec.mode == "all":
        items = ["all", *items, *(f"-{name}" for name in spec.excluded)]
    return ",".join(items)


@st.composite
def padded(draw: st.DrawFn, items: list[str]) -> str:
    """``items`` joined by commas, with whitespace around each and empty items anywhere."""
    pieces: list[str] = []
    for item in items:
        pieces += [draw(blank) for _ in range(draw(st.integers(0, 2)))]  # empty items
        pieces.append(draw(blank) + item + draw(blank))
    pieces += [draw(blank) for _ in range(draw(st.integers(0, 2)))]
    return ",".join(pieces)


@settings(max_examples=60)
@given(st.data())
def test_whitespace_and_empty_items_never_change_the_result(data: st.DataObject) -> None:
    items = data.draw(st.one_of(valid_items(), st.lists(st.text(max_size=8), max_size=5)))
    text = ",".join(items)
    assert parse(data.draw(padded(items))) == parse(text)


@given(valid_items())
def test_well_formed_choices_parse_and_round_trip(items: list[str]) -> None:
    spec = parse_selection(",".join(items))
    assert meaning(parse_selection(render(spec))) == meaning(spec)
    assert meaning(parse_selection(items)) == meaning(spec)  # enable(packs=[...]) takes the same items
    assert parse_selection(items).source == ",".join(items)


@given(st.lists(names, min_size=1, max_size=8))
def test_a_list_of_names_enables_exactly_those(chosen: list[str]) -> None:
    spec = parse_selection(",".join(chosen))
    assert meaning(spec) == ("only", tuple(dict.fromkeys(chosen)), (), {})


@given(st.lists(names, max_size=6), st.integers(0, 6), st.booleans())
def test_all_with_exclusions_excludes_exactly_those(excluded: list[str], where: int, with_all: bool) -> None:
    items = [f"-{name}" for name in excluded]
    if with_all or not excluded:
        items.insert(min(where, len(items)), "all")
    spec = parse_selection(",".join(items))
    assert meaning(spec) == ("all", (), tuple(dict.fromkeys(excluded)), {})


@given(st.dictionaries(names, offsets, min_size=1, max_size=5), st.booleans(), st.booleans())
def test_offsets_are_the_numbers_written(chosen: dict[str, int], with_all: bool, plus: bool) -> None:
    written = [f"{name}@{signed(offset) if plus else offset}" for name, offset in chosen.items()]
    spec = parse_selection(",".join(["all", *written] if with_all else written))
    assert dict(spec.priority_offsets) == chosen
    assert spec.included == tuple(chosen) and spec.mode == ("all" if with_all else "only")


@settings(max_examples=300)
@given(st.one_of(st.text(), st.text(alphabet="ab-@+,0 9allnone", max_size=20), st.lists(st.text(max_size=10))))
@example("a@" + "1" * 5000)
@example(",".join(["a"] * 1000))
@example("\x00")
@example(["a,b", " -c"])
def test_garbage_only_ever_raises_selection_error(text: str | list[str]) -> None:
    try:
        spec = parse_selection(text)
    except SelectionError as exc:
        source = text if isinstance(text, str) else ",".join(text)
        assert f"HF_PATCH_PACKS={source!r}" in str(exc)
        return
    # Whatever parses is consistent.
    assert spec.mode in ("all", "none", "only")
    assert not set(spec.included) & set(spec.excluded)
    assert set(spec.priority_offsets) <= set(spec.included)
    assert all(isinstance(offset, int) for offset in spec.priority_offsets.values())
    if spec.mode == "none":
        assert not spec.named
    if spec.mode == "only":
        assert spec.included and not spec.excluded
    for name in spec.named:
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name), name


@given(st.sampled_from(RESERVED), st.sampled_from(["-{}", "{}@+1", "{}@-3", "{}@0"]), st.lists(names, max_size=2))
def test_the_reserved_words_are_never_pack_names(word: str, form: str, others: list[str]) -> None:
    text = ",".join([*others, form.format(word)])
    try:
        spec = parse_selection(text)
    except SelectionError:
        return
    raise AssertionError(f"{text!r} parsed, naming {word!r} as a pack: {spec}")


@given(names, st.text(alphabet="٠١٢٣٤٥٦٧٨٩０１２３４５６７８９", min_size=1, max_size=3))
def test_offsets_are_written_in_ascii_digits(name: str, digits: str) -> None:
    try:
        spec = parse_selection(f"{name}@+{digits}")
    except SelectionError:
        return
    raise AssertionError(f"{name}@+{digits} parsed as offset {dict(spec.priority_offsets)}")


@given(st.lists(names, min_size=1, max_size=3))
def test_none_combined_with_anything_is_an_error(chosen: list[str]) -> None:
    for items in (["none", *chosen], [*chosen, "none"], ["all", "none"]):
        text = ",".join(items)
        assert parse(text) is SelectionError, text
