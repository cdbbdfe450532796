"""Behaviour of the embedded ``local://`` bus that the shared contract does not reach."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from topics.bus import BusError, DeliveryError, TopicPartition, connect

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bus(tmp_path):
    return connect(f"local://{tmp_path / 'bus'}")


def read_all(bus, topic: str, partition: int = 0):
    reader = bus.consumer(None)
    reader.assign([TopicPartition(topic, partition)])
    out, empty = [], 0
    while empty < 2:
        got = reader.poll(500, 0.05)
        out += got
        empty = 0 if got else empty + 1
    reader.close()
    return out


def test_retention_drops_old_records_and_advances_the_start_offset(bus):
    admin = bus.admin()
    admin.create_topic("ret", partitions=1, retention_ms=200)
    assert admin.describe_topic("ret").config["retention.ms"] == "200"
    producer = bus.producer()
    for i in range(5):
        producer.send("ret", f"old-{i}".encode())
    time.sleep(0.3)
    assert admin.start_offsets("ret") == {0: 5}               # applied lazily when asked
    producer.send("ret", b"new")                               # ... and on append
    producer.flush()
    assert admin.end_offsets("ret") == {0: 6}
    assert [(r.offset, r.value) for r in read_all(bus, "ret")] == [(5, b"new")]
    assert admin.group_lag("nobody", "ret") == {0: 1}


def test_compaction_keeps_offsets_and_drops_expired_tombstones(bus):
    admin = bus.admin()
    admin.create_topic("cmp", partitions=1, compacted=True, config={"delete.retention.ms": "0"})
    producer = bus.producer()
    for key, value in [("a", b"1"), ("b", b"1"), ("a", b"2"), ("b", None), ("c", b"1")]:
        producer.send("cmp", value, key=key)
    producer.send("cmp", b"no key")                            # compacted topics need keys
    with pytest.raises(DeliveryError, match="requires a key"):
        producer.flush()
    time.sleep(0.01)
    admin.compact("cmp")
    assert [(r.offset, r.key, r.value) for r in read_all(bus, "cmp")] == [(2, b"a", b"2"), (4, b"c", b"1")]
    assert admin.start_offsets("cmp") == {0: 0} and admin.end_offsets("cmp") == {0: 5}
    producer.send("cmp", b"3", key="a")
    producer.flush()
    assert [r.offset for r in read_all(bus, "cmp")] == [2, 4, 5]


def test_a_torn_tail_is_ignored_by_readers_and_truncated_by_the_next_writer(bus, tmp_path):
    producer = bus.producer()
    for i in range(3):
        producer.send("torn", f"v{i}".encode())
    producer.flush()
    log = tmp_path / "bus" / "topics" / "torn" / "0.log"
    with open(log, "ab") as f:                                 # a writer killed mid-frame
        f.write(b"\xe8\x03\x00\x00" + b"\x00" * 10)
    assert [r.value for r in read_all(bus, "torn")] == [b"v0", b"v1", b"v2"]
    other = connect(bus.url).producer()
    other.send("torn", b"v3")
    other.flush()
    assert [(r.offset, r.value) for r in read_all(bus, "torn")] == [(i, f"v{i}".encode()) for i in range(4)]


def test_producers_in_several_processes_get_distinct_contiguous_offsets(bus):
    bus.admin().create_topic("multi", partitions=1)
    code = ("import sys; from topics.bus import connect; p = connect(sys.argv[1]).producer()\n"
            "for i in range(200): p.send('multi', f'{sys.argv[2]}-{i}'.encode())\np.flush()")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code, bus.url, name], env=env) for name in ("x", "y")]
    assert [p.wait(60) for p in procs] == [0, 0]
    records = read_all(bus, "multi")
    assert [r.offset for r in records] == list(range(400))
    for name in ("x", "y"):
        assert [r.value for r in records if r.value.startswith(name.encode())] == [f"{name}-{i}".encode() for i in range(200)]


def test_silent_member_expires_and_commit_of_a_lost_partition_is_refused(bus):
    bus.admin().create_topic("grp", partitions=2)
    quiet = bus.consumer("g", session_timeout_s=0.5)
    quiet.subscribe(["grp"])
    busy = bus.consumer("g", session_timeout_s=5)
    busy.subscribe(["grp"])
    quiet.poll(10, 0.05)                                       # releases what the new assignment moves away
    busy.poll(10, 0.05)
    assert len(quiet.assignment()) == len(busy.assignment()) == 1
    time.sleep(0.8)                                            # quiet stops heartbeating
    busy.poll(10, 0.05)
    assert busy.assignment() == [TopicPartition("grp", 0), TopicPartition("grp", 1)]
    with pytest.raises(BusError, match="no longer owns"):
        quiet.commit({TopicPartition("grp", 0): 0})
    quiet.poll(10, 0.05)                                       # rejoins as a new member
    busy.poll(10, 0.05)
    quiet.poll(10, 0.05)
    assert sorted(quiet.assignment() + busy.assignment()) == [TopicPartition("grp", 0), TopicPartition("grp", 1)]


def test_data_and_offsets_survive_a_new_connection(bus):
    producer = bus.producer()
    producer.send("keep", b"x", key="k", headers={"h": "1"})
    producer.flush()
    c = bus.consumer("g")
    c.subscribe(["keep"])
    c.commit(c.poll(10, 1.0))
    again = connect(bus.url)
    assert again.admin().list_topics() == ["keep"]
    assert again.admin().describe_topic("keep").partitions == 1          # auto-created with 1 partition
    assert again.admin().group_offsets("g", "keep") == {0: 1}
    assert [(r.key, r.headers) for r in read_all(again, "keep")] == [(b"k", {"h": b"1"})]
    again.admin().delete_topic("keep")
    assert bus.admin().list_topics() == []
    with pytest.raises(BusError, match="does not exist"):
        bus.admin().describe_topic("keep")


def test_transactions_need_a_transactional_id(bus):
    producer = bus.producer()
    with pytest.raises(BusError, match="transactional_id"):
        producer.begin_transaction()
