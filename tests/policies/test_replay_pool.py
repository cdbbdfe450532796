"""The replay serving policy: fraction r of each batch, max_staleness, state round trip."""
from __future__ import annotations

from policies.staleness import staleness
from policies.replay import Replay
from policy_factories import make_group


def test_replay_serves_fraction_r_and_never_stale():
    replay = Replay(capacity=50, ratio=0.25, max_staleness=8, seed=0)
    served_ids: set[str] = set()
    n = 16
    n_replay = round(replay.ratio * n)  # as the serving stage sizes a batch: 4 replayed, 12 fresh
    for version in range(30):
        fresh = [make_group([0, 1], version=version) for _ in range(n - n_replay)]
        replayed = replay.sample(n_replay, version)
        if version == 0:
            assert replayed == []  # nothing served yet
        else:  # the pool holds >= 4 servable groups from version 1 on
            assert len(replayed) == 4 and len(fresh + replayed) == n
        assert len({g.group_id for g in replayed}) == len(replayed)
        assert all(g.group_id in served_ids for g in replayed)
        assert all(staleness(g.min_version, version) <= 8 for g in replayed)
        replay.add(fresh, version)
        served_ids.update(g.group_id for g in fresh)
        assert len(replay) <= 50


def test_replay_evicts_past_max_staleness():
    replay = Replay(capacity=100, ratio=0.5, max_staleness=2)
    replay.add([make_group([0, 1], version=0) for _ in range(5)], 0)
    replay.add([make_group([0, 1], version=2) for _ in range(3)], 2)
    assert len(replay.sample(100, 2)) == 8
    got = replay.sample(100, 3)  # version-0 groups are 3 versions old: evicted
    assert len(got) == 3 and {g.min_version for g in got} == {2}
    assert replay.evicted_stale == 5
    assert replay.sample(10, 5) == [] and len(replay) == 0
    replay.add([make_group([0, 1], version=1)], 10)  # already stale: never enters
    assert len(replay) == 0


def test_replay_state_round_trip():
    a = Replay(capacity=10, ratio=0.5, seed=1)
    a.add([make_group([0, 1], version=1) for _ in range(6)], 1)
    b = Replay(capacity=10, ratio=0.5, seed=7)
    b.load_state_dict(a.state_dict())
    assert [g.group_id for g in b.sample(3, 1)] == [g.group_id for g in a.sample(3, 1)]
