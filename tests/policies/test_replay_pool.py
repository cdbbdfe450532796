"""Serving policies: replay (fraction r, max_staleness), mix (weights), staleness (drop / IS)."""
from __future__ import annotations

import numpy as np
import pytest

from policies.base import group_staleness
from policies.mix import Mix
from policies.replay import Replay
from policies.staleness import Staleness
from policy_factories import make_group


def test_replay_serves_fraction_r_and_never_stale():
    replay = Replay(capacity=50, ratio=0.25, max_staleness=8, seed=0)
    served_ids: set[str] = set()
    n = 16
    for version in range(30):
        fresh = [make_group([0, 1], version=version) for _ in range(n)]
        n_fresh, n_replay = replay.split(n, version)
        replayed = replay.sample(n_replay, version)
        batch = fresh[:n_fresh] + replayed
        assert len(batch) == n
        if version >= 1:  # the pool holds >= 4 servable groups from version 1 on
            assert n_replay == 4 and len(replayed) == 4
        assert all(g.group_id in served_ids for g in replayed)
        assert all(group_staleness(g, version) <= 8 for g in replayed)
        replay.add(fresh[:n_fresh], version)
        served_ids.update(g.group_id for g in fresh[:n_fresh])
        assert len(replay) <= 50
    assert replay.split(n, 29) == (12, 4)


def test_replay_evicts_past_max_staleness():
    replay = Replay(capacity=100, ratio=0.5, max_staleness=2)
    replay.add([make_group([0, 1], version=0) for _ in range(5)], 0)
    replay.add([make_group([0, 1], version=2) for _ in range(3)], 2)
    assert len(replay.sample(100, 2)) == 8
    got = replay.sample(100, 3)  # version-0 groups are 3 versions old: evicted
    assert len(got) == 3 and {g.min_version for g in got} == {2}
    assert replay.evicted_stale == 5
    assert replay.sample(10, 5) == [] and replay.split(10, 5) == (10, 0)
    replay.add([make_group([0, 1], version=1)], 10)  # already stale: never enters
    assert len(replay) == 0


def test_replay_state_round_trip():
    a = Replay(capacity=10, ratio=0.5, seed=1)
    a.add([make_group([0, 1], version=1) for _ in range(6)], 1)
    b = Replay(capacity=10, ratio=0.5, seed=7)
    b.load_state_dict(a.state_dict())
    assert [g.group_id for g in b.sample(3, 1)] == [g.group_id for g in a.sample(3, 1)]


def test_mix_weighted_sampling_across_sources():
    mix = Mix(weights={"gsm8k": 3.0, "math": 1.0}, seed=0)
    mix.add([make_group([0, 1], source="gsm8k") for _ in range(2000)], 0)
    mix.add([make_group([0, 1], source="math") for _ in range(2000)], 0)
    mix.add([make_group([0, 1], source="other")], 0)
    got = mix.sample(1000, 0)
    share = sum(g.source == "gsm8k" for g in got) / len(got)
    assert share == pytest.approx(0.75, abs=0.05)
    assert mix.unrouted == 1
    # an exhausted source leaves the others to fill the batch
    small = Mix(weights={"a": 1.0, "b": 1.0})
    small.add([make_group([0, 1], source="a")] + [make_group([0, 1], source="b") for _ in range(5)], 0)
    assert len(small.sample(6, 0)) == 6


def test_staleness_drop_and_importance_weight():
    groups = [make_group([0, 1], version=v) for v in (5, 0, 9, 3)]
    drop = Staleness(max_staleness=5, mode="drop")
    drop.add(groups, 9)
    assert [g.min_version for g in drop.sample(10, 10)] == [5, 9]  # 0 and 3 are > 5 stale
    assert drop.dropped == 2
    keep = Staleness(max_staleness=5, mode="importance_weight", is_cap=2.0)
    keep.add(groups, 9)
    assert [g.min_version for g in keep.sample(10, 10)] == [0, 3, 5, 9]
    w = keep.importance_weights(np.array([0, -1.0, -1.0, -2.0], np.float32),
                                np.array([0, -1.0, -3.0, 0.0], np.float32), np.array([0, 1, 1, 1], np.uint8))
    assert w.dtype == np.float32
    np.testing.assert_allclose(w, [0.0, 1.0, np.exp(-2.0), 2.0], rtol=1e-6)
