"""GRESO: submit probability max(p^z, floor) and the adaptation of p toward its targets."""
from __future__ import annotations

import pytest

from policies.curators import FilterSolved, Greso
from policy_factories import make_outcome, make_prompt


def test_submit_probability_is_p_to_the_streak_with_floor():
    g = Greso(p_easy=0.5, p_hard=0.8, floor=0.1, step=0.0)
    assert g.submit_probability("new") == 1.0
    for z in range(1, 6):
        g.update(make_outcome("easy", [1, 1, 1, 1]))
        g.update(make_outcome("hard", [0, 0, 0, 0]))
        assert g.submit_probability("easy") == pytest.approx(max(0.5 ** z, 0.1))
        assert g.submit_probability("hard") == pytest.approx(max(0.8 ** z, 0.1))
    assert g.submit_probability("easy") == 0.1  # 0.5**5 = 0.03 is floored
    g.update(make_outcome("easy", [1, 0, 1, 1]))  # variance resets the streak
    assert g.submit_probability("easy") == 1.0


def test_submit_rate_matches_probability():
    g = Greso(p_easy=0.5, floor=0.05, seed=1)
    g.update(make_outcome("e", [1, 1]))
    g.update(make_outcome("e", [1, 1]))  # z=2 -> 0.25
    prompt = make_prompt("e")
    rate = sum(g.should_submit(prompt) for _ in range(4000)) / 4000
    assert rate == pytest.approx(0.25, abs=0.03)
    assert all(g.should_submit(make_prompt("unseen")) for _ in range(50))


def test_p_adapts_toward_targets_across_versions():
    g = Greso(p_easy=0.5, p_hard=0.5, target_easy=0.1, target_hard=0.2, step=0.05, p_min=0.3)
    # version window with many easy zero-variance outcomes (0.5 > 0.1) and no hard ones (0 < 0.2)
    for v in range(1, 4):
        for i in range(5):
            g.update(make_outcome(f"e{i}", [1, 1, 1]))
            g.update(make_outcome(f"m{i}", [1, 0, 1]))
        g.on_version(v)
    assert g.p_easy == pytest.approx(0.5 - 3 * 0.05)
    assert g.p_hard == pytest.approx(min(1.0, 0.5 + 3 * 0.05))
    for v in range(4, 10):  # keeps moving until clipped at p_min
        for i in range(5):
            g.update(make_outcome(f"e{i}", [1, 1, 1]))
        g.on_version(v)
    assert g.p_easy == pytest.approx(0.3)
    # ratios back under target: p_easy climbs again; an empty window or old version changes nothing
    for i in range(10):
        g.update(make_outcome(f"m{i}", [0, 1]))
    g.on_version(10)
    assert g.p_easy == pytest.approx(0.35)
    g.on_version(11)
    g.on_version(5)
    assert g.p_easy == pytest.approx(0.35)


def test_greso_state_round_trip():
    a = Greso(seed=3)
    for _ in range(3):
        a.update(make_outcome("x", [0, 0]))
    a.on_version(1)
    b = Greso(seed=99)
    b.load_state_dict(a.state_dict())
    assert b.submit_probability("x") == a.submit_probability("x")
    assert [b.should_submit(make_prompt("x")) for _ in range(20)] == \
           [a.should_submit(make_prompt("x")) for _ in range(20)]


def test_filter_solved_ewma():
    c = FilterSolved(alpha=0.5, threshold=0.75)
    p = make_prompt("q")
    assert c.should_submit(p)
    c.update(make_outcome("q", [1, 0]))  # 0.5
    assert c.should_submit(p)
    c.update(make_outcome("q", [1, 1]))  # 0.75
    assert c.ewma["q"] == pytest.approx(0.75) and not c.should_submit(p)
    c.update(make_outcome("q", [0, 0]))  # 0.375
    assert c.should_submit(p)
