"""The serving stage on each real bus backend."""
import uuid

import numpy as np
import pytest

from consumers.serving import REDELIVERY_VERSIONS, ServingStage
from policies.replay import Replay
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.names import TopicNames
from topics.schemas import Sample, TrajectoryGroup


def group(version: int, gid: str | None = None, n: int = 2) -> TrajectoryGroup:
    samples = [Sample(input_ids=np.array([1, 5, 6], np.int32), loss_mask=np.array([0, 1, 1], np.uint8),
                      behavior_logprobs=np.array([0, -1, -1], np.float32),
                      versions=np.array([-1, version, version], np.int32), reward=float(i % 2)) for i in range(n)]
    return TrajectoryGroup.build(samples=samples, prompt_id=f"p{version}", group_id=gid or uuid.uuid4().hex,
                                 policy="pol")


@pytest.fixture
def setup(bus_url):
    bus = connect(bus_url)
    names = TopicNames(f"t{uuid.uuid4().hex[:10]}")
    admin = bus.admin()
    for t in (names.samples("pol"), names.deadletter):
        admin.create_topic(t, partitions=2)
    producer = bus.producer()

    def produce(groups, raw=(), key=None):
        """Send ``groups`` (keyed by prompt id, or all by ``key``: one partition, one fetch) and ``raw`` bytes."""
        for g in groups:
            producer.send(names.samples("pol"), encode(g), key=key or g.prompt_id, headers=headers_for(g))
        for value in raw:
            producer.send(names.samples("pol"), value, key=b"junk")
        producer.flush()

    def stage(**kw):
        # a group of this test's own: on Kafka, members of one group on other topics (a test on another
        # xdist worker) rebalance it, and a partition taken back and given again is read again
        consumer = bus.consumer(f"trainer.pol.{uuid.uuid4().hex[:6]}" if kw.pop("fresh_group", False)
                                else f"{names.run}.trainer.pol", session_timeout_s=6.0)
        return ServingStage(consumer, producer, names.samples("pol"), names.deadletter, **kw)

    return bus, names, produce, stage


def test_stale_dropped_duplicates_dropped_garbage_dead_lettered_earliest_first(setup):
    bus, names, produce, stage = setup
    dup = group(7, gid="dup")
    produce([group(v) for v in (9, 0, 5, 1, 2, 10)] + [dup, dup], raw=[b"not a message"])
    s = stage(batch_groups=20, max_staleness=8)
    batch = s.next_batch(version=10, timeout_s=20)
    versions = [g.min_version for g in batch.groups]
    assert versions == [2, 5, 7, 9, 10]  # 0 and 1 are 10 and 9 versions old: dropped; sorted
    assert s.total_dropped_stale == 2 and s.total_duplicates == 1
    # the garbage record is on the dead-letter topic
    dl = bus.consumer(None)
    dl.assign([(names.deadletter, p) for p in range(2)])
    letters = []
    for _ in range(20):
        letters += dl.poll(timeout_s=0.5)
        if letters:
            break
    assert len(letters) == 1
    s.consumer.close()


def test_staleness_is_checked_when_served_and_offsets_commit_lowest_buffered(setup):
    bus, names, produce, stage = setup
    produce([group(v) for v in (3, 4, 6)], key="one-partition")  # all polled before the first batch
    s = stage(batch_groups=1, max_staleness=2)
    first = s.next_batch(version=5, timeout_s=20)
    assert [g.min_version for g in first.groups] == [3]
    # 4 and 6 are still buffered: the commit point of their partition is the lowest buffered offset
    assert sorted(g.min_version for g in s._buffer) == [4, 6]
    lowest: dict[int, int] = {}
    for g in s._buffer:
        lowest[g.partition] = min(lowest.get(g.partition, g.offset), g.offset)
    commits = {tp.partition: off for tp, off in s.offsets_to_commit().items()}
    assert {p: commits[p] for p in lowest} == lowest
    # the trainer moved on to version 7: 4 is now 3 versions old and must never be served
    second = s.next_batch(version=7, timeout_s=2)
    assert [g.min_version for g in second.groups] == [6]
    assert s.total_dropped_stale == 1
    s.commit()
    s.consumer.close()


def test_restart_from_state_skips_served_groups(setup):
    bus, names, produce, stage = setup
    produce([group(v) for v in (1, 2, 3, 4)])
    s = stage(batch_groups=2)
    got = [g.group_id for g in s.next_batch(version=4, timeout_s=20).groups]
    state, offsets = s.state_dict(), s.offsets_to_commit()
    s.consumer.close()
    s2 = stage(batch_groups=10, fresh_group=True)  # no committed offsets: everything is re-read
    s2.load_state_dict(state, offsets)
    rest = [g.group_id for g in s2.next_batch(version=4, timeout_s=20).groups]
    assert len(rest) == 2 and not set(rest) & set(got)
    s2.consumer.close()


def test_replay_supplies_its_fraction_of_each_batch(setup):
    bus, names, produce, stage = setup
    produce([group(v) for v in range(6)])
    replay = Replay(ratio=0.5, max_staleness=8)
    s = stage(batch_groups=2, replay=replay)
    b1 = s.next_batch(version=5, timeout_s=20)
    assert b1.replayed == 0 and len(b1.groups) == 1  # the pool was empty; 1 fresh group of the 2
    b2 = s.next_batch(version=5, timeout_s=20)
    assert b2.replayed == 1 and len(b2.groups) == 2 and b2.groups[-1].group_id == b1.groups[0].group_id
    s.consumer.close()


def test_bad_batch_config_is_named(bus_url):
    bus = connect(bus_url)
    with pytest.raises(ValueError, match="batch_groups must be >= 1, got 0"):
        ServingStage(bus.consumer("g"), bus.producer(), "t", "dl", batch_groups=0)


@pytest.mark.parametrize("bus_url", ["local"], indirect=True)
def test_served_ids_are_kept_for_a_window_of_versions(setup):
    """The de-duplication set, saved in every checkpoint, is bounded: an id is kept for
    max(max_staleness, REDELIVERY_VERSIONS) versions after it was served (a copy read again later is too stale to
    train anyway, and a redelivered prompt's copy has come back by then), then forgotten."""
    bus, names, produce, stage = setup
    window = max(2, REDELIVERY_VERSIONS)
    s = stage(batch_groups=1, max_staleness=2)
    last = window + 4
    for version in range(last + 1):  # one group per step, rolled out on the trainer's version
        produce([group(version, gid=f"g{version}")], key="one")
        assert [g.group_id for g in s.next_batch(version=version, timeout_s=10).groups] == [f"g{version}"]
    assert s.state_dict()["served_ids"] == {f"g{v}": v for v in range(last - window, last + 1)}
    # copies read again: g3, past the window, is too stale to train; a redelivered prompt's copy rolled out on
    # the newest weights (g6, served window - 2 versions ago) is recognised; neither is trained
    produce([group(3, gid="g3"), group(last, gid="g6"), group(last, gid="new")], key="one")
    batch = s.next_batch(version=last, timeout_s=10)
    assert [g.group_id for g in batch.groups] == ["new"] and (batch.dropped_stale, batch.duplicates) == (1, 1)
    # a checkpoint written before the bound lists its ids without versions: they are kept (as never stale)
    s.load_state_dict({"served_ids": ["old"]})
    assert s.next_batch(version=1000, timeout_s=0.5) is None and s.served_ids == {"old": -1}
    s.consumer.close()


def test_replayed_groups_obey_the_policys_bound(setup):
    # issue 29: the replay pool had its own bound (8) whatever the policy's; replayed groups trained at staleness 5-8
    bus, names, produce, stage = setup
    replay = Replay(ratio=0.5, seed=0)  # no bound of its own: the policy's
    s = stage(batch_groups=2, max_staleness=2, replay=replay)
    served = []
    for version in range(12):  # one fresh group per step, rolled out on the trainer's version
        produce([group(version)])
        batch = s.next_batch(version=version, timeout_s=10)
        served += [(version, g.min_version, i >= len(batch.groups) - batch.replayed)
                   for i, g in enumerate(batch.groups)]
    s.consumer.close()
    assert sum(replayed for *_, replayed in served) >= 5  # replay served groups ...
    assert max(v - m for v, m, _ in served) == 2, served  # ... never past the policy's bound
    assert replay.max_staleness == 2
    with pytest.raises(ValueError, match="the serving policy's max_staleness 8 is above the policy's 2"):
        stage(batch_groups=2, max_staleness=2, replay=Replay(ratio=0.5, max_staleness=8))


def test_groups_rolled_out_off_the_lineage_are_dropped_as_stale(setup):
    # a trainer resumed at version 4 after versions 5 and 6 were published: they are off its lineage
    bus, names, produce, stage = setup
    produce([group(v, gid=f"g{v}") for v in (3, 4, 5, 6, 7)], key="one")
    s = stage(batch_groups=3, max_staleness=100)
    s.off_lineage = [(5, 6)]
    batch = s.next_batch(version=7, timeout_s=10)
    s.consumer.close()
    assert [g.group_id for g in batch.groups] == ["g3", "g4", "g7"] and batch.dropped_stale == 2
