from __future__ import annotations

import itertools
import random

import pytest
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.monkey_patching import _find_replacement_class

from hfpatch_core import Claim, Patch, PatchConflictError
from hfpatch_core._pipeline.gathering import Gathered
from hfpatch_core._pipeline.resolution import find_replacement, patch_conflicts, resolve, resolve_patches
from hfpatch_core._pipeline.selection import parse_selection
from hfpatch_core._pipeline.settling import Change, Problem, adjusted, selection_text, settle, settled


class A(nn.Module):
    pass


class B(nn.Module):
    pass


class C(nn.Module):
    pass


def claim(pack: str, target: str, cls: type = A, priority: int = 0, overwrite: bool = False, index: int = 0) -> Claim:
    return Claim(pack, "1.0", Patch(target, cls, priority=priority, overwrite=overwrite), priority, index)


def test_higher_priority_wins_and_the_loser_is_reported() -> None:
    low, high = claim("low", "LlamaMLP", A), claim("high", "LlamaMLP", B, priority=5)
    plan = resolve([low, high])
    assert plan.entries == (high,)
    assert [(lost.claim, lost.winner) for lost in plan.lost] == [(low, high)]
    assert "priority 0 < 5" in plan.lost[0].reason


def test_overwrite_breaks_a_priority_tie() -> None:
    plain, forcing = claim("a", "LlamaMLP", A), claim("b", "LlamaMLP", B, overwrite=True)
    plan = resolve([plain, forcing])
    assert plan.entries == (forcing,) and "sets overwrite=True" in plan.lost[0].reason


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_real_tie_is_a_conflict_naming_both_packs_classes_and_remedy(overwrite: bool) -> None:
    with pytest.raises(PatchConflictError) as caught:
        resolve([claim("alpha", "LlamaMLP", A, overwrite=overwrite), claim("beta", "LlamaMLP", B, overwrite=overwrite)])
    message = str(caught.value)
    for expected in (
        "'alpha'",
        "'beta'",
        "test_resolution.A",
        "test_resolution.B",
        "'LlamaMLP'",
        "HF_PATCH_PACKS=all,alpha@+1",
    ):
        assert expected in message


def test_same_class_from_two_packs_is_not_a_conflict() -> None:
    plan = resolve([claim("alpha", "LlamaMLP", A), claim("beta", "LlamaMLP", A)])
    assert [entry.pack for entry in plan.entries] == ["alpha"]


def test_one_pack_claiming_a_target_twice_is_a_conflict() -> None:
    with pytest.raises(PatchConflictError, match="claims 'LlamaMLP' twice"):
        resolve([claim("alpha", "LlamaMLP", A, index=0), claim("alpha", "LlamaMLP", B, index=1)])


def test_winners_are_registered_in_priority_order_so_the_first_regex_match_honours_it() -> None:
    broad, narrow = claim("broad", ".*Norm$", A, priority=1), claim("narrow", "RMSNorm$", B, priority=9)
    plan = resolve([broad, narrow], class_names=["LlamaRMSNorm", "LayerNorm"])
    assert list(plan.mapping) == ["RMSNorm$", ".*Norm$"]
    assert plan.replaced == {"LlamaRMSNorm": narrow, "LayerNorm": broad}
    assert find_replacement("LlamaRMSNorm", plan.mapping) is B
    shadowed = [(lost.claim, lost.class_name) for lost in plan.shadowed]
    assert shadowed == [(broad, "LlamaRMSNorm")]


def test_exact_names_beat_patterns_whatever_the_priority() -> None:
    pattern, exact = claim("p", ".*MLP$", A, priority=100), claim("e", "LlamaMLP", B)
    plan = resolve([pattern, exact], class_names=["LlamaMLP", "MistralMLP"])
    assert plan.replaced == {"LlamaMLP": exact, "MistralMLP": pattern}
    assert [(lost.claim, lost.class_name) for lost in plan.shadowed] == [(pattern, "LlamaMLP")]
    assert "an exact name" in plan.shadowed[0].reason


def test_direct_registration_stays_unless_the_claim_overwrites() -> None:
    kept = resolve([claim("p", "LlamaMLP", A)], registered={"LlamaMLP": C})
    assert kept.entries == () and "overwrite=True" in kept.lost[0].reason
    replaced = resolve([claim("p", "LlamaMLP", A, overwrite=True)], registered={"LlamaMLP": C})
    assert [entry.patch.replacement for entry in replaced.entries] == [A]
    # hfpatch's own entries for an enclosing load may be replaced without overwrite
    nested = resolve([claim("p", "LlamaMLP", A)], registered={"LlamaMLP": C}, overridable={"LlamaMLP"})
    assert len(nested.entries) == 1


def test_a_direct_pattern_registered_first_shadows_a_later_claim() -> None:
    plan = resolve([claim("p", "Norm$", A)], registered={".*RMSNorm": C}, class_names=["LlamaRMSNorm", "LayerNorm"])
    assert set(plan.replaced) == {"LayerNorm"}
    assert plan.shadowed[0].class_name == "LlamaRMSNorm" and "registered directly" in plan.shadowed[0].reason


def test_fingerprint_depends_on_packs_and_winners_only() -> None:
    claims = [claim("a", "LlamaMLP", A), claim("b", ".*Norm", B)]
    first = resolve(claims, packs=[("a", "1.0"), ("b", "1.0")])
    again = resolve(list(reversed(claims)), packs=[("b", "1.0"), ("a", "1.0")])
    assert first.fingerprint == again.fingerprint and len(first.fingerprint) == 12
    assert resolve(claims, packs=[("a", "1.1"), ("b", "1.0")]).fingerprint != first.fingerprint
    assert resolve(claims[:1], packs=[("a", "1.0"), ("b", "1.0")]).fingerprint != first.fingerprint


NAMES = ["LlamaMLP", "LlamaAttention", "LlamaRMSNorm", "MistralMLP", "BertSelfAttention", "BertAttention", "XLlamaMLPY"]
KEYS = ["LlamaMLP", ".*Attention", "Attention$", "^Bert", "RMSNorm", "MLP", "(", "Llama.*Y$", "BertAttention"]


@given(st.lists(st.sampled_from(KEYS), unique=True, max_size=6), st.sampled_from(NAMES))
def test_lookup_rule_is_transformers_own(keys: list[str], name: str) -> None:
    mapping = {key: type(f"R{i}", (nn.Module,), {}) for i, key in enumerate(keys)}
    assert find_replacement(name, mapping) is _find_replacement_class(name, mapping)


claims_strategy = st.lists(
    st.builds(
        lambda pack, target, priority, overwrite, cls: claim(pack, target, cls, priority, overwrite),
        st.sampled_from(["p1", "p2", "p3", "p4"]),
        st.sampled_from(["LlamaMLP", ".*MLP$", "RMSNorm", "LlamaAttention"]),
        st.integers(-3, 3),
        st.booleans(),
        st.sampled_from([A, B, C]),
    ),
    max_size=8,
)


def _outcome(claims: list[Claim]) -> object:
    try:
        plan = resolve(claims, class_names=NAMES)
    except PatchConflictError:
        return "conflict"
    return [(c.pack, c.target, c.patch.replacement) for c in plan.entries], {
        name: (c.pack, c.target) for name, c in plan.replaced.items()
    }


@settings(max_examples=150, deadline=None)
@given(claims_strategy, st.randoms())
def test_winner_never_depends_on_discovery_order(claims: list[Claim], rnd: random.Random) -> None:
    unique = list({(c.pack, c.target): c for c in claims}.values())
    shuffled = list(unique)
    rnd.shuffle(shuffled)
    assert _outcome(unique) == _outcome(shuffled)


@settings(max_examples=150, deadline=None)
@given(claims_strategy, st.integers(1, 20))
def test_raising_a_claims_priority_never_makes_it_lose(claims: list[Claim], boost: int) -> None:
    unique = list({(c.pack, c.target): c for c in claims}.values())
    for chosen in unique:
        try:
            before = resolve(unique)
        except PatchConflictError:
            continue
        if chosen not in before.entries:
            continue
        raised = [Claim(c.pack, c.version, c.patch, c.priority + boost, c.index) if c is chosen else c for c in unique]
        after = resolve(raised)
        assert any(entry.pack == chosen.pack and entry.target == chosen.target for entry in after.entries)


def test_all_orders_of_a_small_set_agree() -> None:
    claims = [claim("a", "LlamaMLP", A, 1), claim("b", "LlamaMLP", B, 2), claim("c", ".*MLP$", C, 2)]
    outcomes = {repr(_outcome(list(order))) for order in itertools.permutations(claims)}
    assert len(outcomes) == 1


# --- conflicts: every claimant, and a selection the resolver checked (issue 27 item 3) -----


def test_a_three_way_tie_names_every_claimant_of_the_target() -> None:
    claims = [claim("a", "LlamaMLP", A), claim("b", "LlamaMLP", B), claim("c", "LlamaMLP", C), claim("d", "LlamaMLP")]
    claims[3] = Claim("d", "1.0", Patch("LlamaMLP", C, priority=-1), -1)
    with pytest.raises(PatchConflictError) as caught:
        resolve(claims)
    assert caught.value.packs == ("a", "b", "c") and caught.value.target == "LlamaMLP"
    assert str(caught.value).startswith(
        "packs 'a', 'b' and 'c' all replace 'LlamaMLP' with priority 0 and none sets overwrite=True "
        "(every claimant of 'LlamaMLP': a: test_resolution.A, priority 0; b: test_resolution.B, priority 0; "
        "c: test_resolution.C, priority 0; d: test_resolution.C, priority -1)."
    )


def _problem(name: str, claims: list[Claim]) -> Problem:
    return Problem(name, Gathered(claims=tuple(claims)), lambda gathered: resolve_patches(gathered.claims))


def test_settling_checks_every_problem_so_a_raise_that_ties_elsewhere_is_passed_over() -> None:
    # raising 'a' (fewer claims than 'b') settles the first model type but ties the second
    first = _problem("one", [claim("a", "X", A), claim("b", "X", B), claim("b", "Y", B), claim("b", "Z", B)])
    second = _problem("two", [claim("a", "W", A, priority=-1), claim("c", "W", C)])
    assert settle([first]) == (Change(raised=(("a", 1),)), 2)
    change, checked = settle([first, second])
    assert change == Change(raised=(("b", 1),)) and checked == 3


def test_no_selection_found_is_said_with_how_many_were_checked() -> None:
    problem = _problem("llama", [claim("a", "X", A), claim("b", "X", B)])
    with pytest.raises(PatchConflictError) as caught:
        resolve(problem.gathered.claims)
    assert settle([problem], limit=1) == (None, 1)
    error = settled(caught.value, [problem], spec=None, enabled=["a", "b"], limit=1)
    assert error.selection is None and "No selection settles every conflict of llama: the resolver checked 1" in str(
        error
    )
    error = settled(caught.value, [problem], spec=parse_selection(None), enabled=["a", "b"])
    assert error.selection == "all,a@+1" and str(error).startswith(caught.value.problem)


@pytest.mark.parametrize(
    ("spec", "change", "expected"),
    [
        (None, Change(raised=(("b", 1),)), "all,b@+1"),
        ("all,b@+1,-z", Change(raised=(("b", 1), ("a", 1))), "all,b@+2,a@+1,-z"),
        ("all,a@-1,-z", Change(raised=(("a", 1),)), "all,-z"),
        ("b,a@+2", Change(raised=(("b", 1),)), "b@+1,a@+2"),
        ("a,b", Change(excluded=("b",)), "a"),
        ("a,b", Change(excluded=("a", "b")), "none"),
    ],
)
def test_a_change_is_written_as_an_hf_patch_packs_value(spec: str | None, change: Change, expected: str) -> None:
    written = selection_text(change, spec=parse_selection(spec), enabled=["a", "b"])
    assert written == expected
    assert parse_selection(written).mode == ("none" if expected == "none" else parse_selection(spec).mode)


@settings(max_examples=150, deadline=None)
@given(claims_strategy)
def test_the_selection_settling_finds_resolves_and_conflicts_are_what_resolution_raises(claims: list[Claim]) -> None:
    unique = list({(c.pack, c.target): c for c in claims}.values())
    conflicts = patch_conflicts(unique)
    try:
        resolve(unique)
    except PatchConflictError as exc:
        assert conflicts and str(conflicts[0]) == str(exc)
    else:
        assert conflicts == []
    problem = Problem("t", Gathered(claims=tuple(unique)), lambda gathered: resolve_patches(gathered.claims))
    change, _ = settle([problem])
    assert change is not None  # disabling packs always settles, within the limit for a few packs
    resolve(adjusted(problem.gathered, change).claims)
