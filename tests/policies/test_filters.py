"""Filters: dynamic sampling (filter_zero_adv), length and format filters."""
from __future__ import annotations

from policies.filters import AcceptAll, FilterFormat, FilterLength, FilterZeroAdv
from policy_factories import make_group, make_prompt


def test_filter_zero_adv_drops_all_equal_and_counts():
    f = FilterZeroAdv()
    groups = [make_group([1, 1, 1, 1]), make_group([0, 1, 0, 0]), make_group([0, 0, 0, 0]),
              make_group([0.5, 0.5]), make_group([0.2, 0.3])]
    decisions = [f.keep(g) for g in groups]
    assert [d.keep for d in decisions] == [False, True, False, False, True]
    assert {d.reason for d in decisions if not d.keep} == {"zero_adv"}
    assert f.dropped == 3
    assert f.state_dict() == {"dropped": 3}


def test_filter_length():
    f = FilterLength(max_tokens=4, max_truncated_fraction=0.5)
    assert f.keep(make_group([0, 1], gen_tokens=4)).keep
    assert f.keep(make_group([0, 1], gen_tokens=5)).reason == "too_long"
    assert f.keep(make_group([0, 1, 1], finish_reasons=["length", "stop", "stop"])).keep
    assert f.keep(make_group([0, 1, 1], finish_reasons=["length", "length", "stop"])).reason == "truncated"


def test_filter_format():
    f = FilterFormat(max_bad_fraction=0.25)
    assert f.keep(make_group([0, 1, 1, 1], finish_reasons=["format_error", "stop", "stop", "stop"])).keep
    d = f.keep(make_group([0, 1, 1, 1], finish_reasons=["format_error", "abort", "stop", "stop"]))
    assert (d.keep, d.reason) == (False, "bad_format")


def test_accept_all_is_filter_and_curator():
    a = AcceptAll()
    assert a.keep(make_group([1, 1])).keep and a.should_submit(make_prompt("x"))
