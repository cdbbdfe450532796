"""One path for reading a whole topic (topics.follow): Follower, LatestByKey and read_topic, on both backends."""
import logging
import time
import uuid

import pytest

from topics.bus import BusError, connect, read_topic
from topics.codec import encode, headers_for
from topics.follow import Follower, LatestByKey
from topics.schemas import Control, WeightAnnouncement


def unique(kind: str) -> str:
    return f"follow-{kind}-{uuid.uuid4().hex[:10]}"


def announcement(policy: str, version: int) -> WeightAnnouncement:
    return WeightAnnouncement(policy=policy, version=version, kind="full", uri=f"file:///w/{version}", bytes=1,
                              sha256="0" * 64, sparsity=0.0)


def send(producer, topic: str, msg, key: str, partition: int | None = None) -> None:
    producer.send(topic, encode(msg), key=key, headers=headers_for(msg), partition=partition)


def test_follower_reads_every_partition_from_the_beginning_and_skips_the_rest(bus_url, caplog):
    bus = connect(bus_url)
    topic = unique("weights")
    bus.admin().create_topic(topic, partitions=2)
    producer = bus.producer()
    send(producer, topic, announcement("a", 1), "a", partition=0)
    send(producer, topic, Control(component="raas-0", action="stop"), "c", partition=0)  # another schema: skipped, not logged
    producer.send(topic, b"garbage", key="a", headers={"schema": WeightAnnouncement.SCHEMA}, partition=1)
    send(producer, topic, announcement("b", 2), "b", partition=1)
    producer.flush()
    follower = Follower(bus, topic, WeightAnnouncement, client_id="test-follower")  # made after the writes
    try:
        with caplog.at_level(logging.WARNING, logger="topics.follow"):
            got = follower.read_to_end(timeout_s=30)
        assert sorted((m.policy, m.version) for _, m in got) == [("a", 1), ("b", 2)]
        assert [r.msg for r in caplog.records if "bad record" in r.msg] and len(caplog.records) == 1
        assert follower.positions == {0: 2, 1: 2}
        assert follower.poll() == []  # only new records
        send(producer, topic, announcement("a", 3), "a", partition=0)
        producer.flush()
        got, deadline = [], time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = follower.poll(timeout_s=0.5)
        assert [(m.policy, m.version) for _, m in got] == [("a", 3)]
    finally:
        follower.close()
        producer.close()


def test_latest_by_key_keeps_the_newest_message_per_key(bus_url):
    bus = connect(bus_url)
    topic = unique("control")
    bus.admin().create_topic(topic, partitions=1, compacted=True)
    producer = bus.producer()
    for policy, version in (("a", 1), ("b", 1), ("a", 2)):
        send(producer, topic, announcement(policy, version), policy)
    producer.flush()
    producer.close()
    latest = LatestByKey(bus, topic, WeightAnnouncement, client_id="test-latest")
    try:
        assert {k: m.version for k, m in latest.read_to_end(timeout_s=30).items()} == {"a": 2, "b": 1}
    finally:
        latest.close()


def test_a_missing_topic_is_an_error(bus_url):
    with pytest.raises(BusError):
        Follower(connect(bus_url), unique("missing"), WeightAnnouncement)


def test_read_topic_of_an_empty_topic_returns_at_once(bus_url):
    bus = connect(bus_url)
    topic = unique("empty")
    bus.admin().create_topic(topic, partitions=3)
    start = time.monotonic()
    assert read_topic(bus, topic, timeout_s=120) == []
    # at once (the end offsets are 0: nothing to wait for), not after waiting out the timeout as for a slow first
    # fetch (which would raise): 60 s is far above a reader's set-up on a busy machine, half the 120 s timeout
    assert time.monotonic() - start < 60


def test_read_topic_ends_at_transaction_markers(bus_url, caplog):
    # On Kafka a committed transaction leaves a commit marker after its records: the end offset counts it,
    # but a read_committed reader never receives it. An aborted transaction's records never arrive either.
    # The read ends at the markers (its position reaches the end offsets), not by the idle fallback for a
    # position that does not move (IDLE_S, with a warning) nor at its timeout (an error).
    bus = connect(bus_url)
    topic = unique("txn")
    bus.admin().create_topic(topic, partitions=2)
    producer = bus.producer(transactional_id=unique("txn-producer"))
    try:
        producer.begin_transaction()
        producer.send(topic, b"kept-0", partition=0)
        producer.send(topic, b"kept-1", partition=1)
        producer.commit_transaction()
        producer.begin_transaction()
        producer.send(topic, b"aborted", partition=1)
        producer.flush()
        producer.abort_transaction()
        producer.begin_transaction()
        producer.send(topic, b"kept-2", partition=0)
        producer.commit_transaction()
    finally:
        producer.close()
    with caplog.at_level(logging.WARNING, logger="topics.follow"):
        records = read_topic(bus, topic, timeout_s=30)
    assert not [r.getMessage() for r in caplog.records if "no moving position" in r.getMessage()]
    assert [(r.partition, r.value) for r in records] == [(0, b"kept-0"), (0, b"kept-2"), (1, b"kept-1")]
