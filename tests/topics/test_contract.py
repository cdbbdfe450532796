"""The bus contract: every backend (``bus_url``: local:// and kafka://) must pass all of it.

Each test uses fresh topic and group names and asserts exact message sets.
Records are identified by their (unique) values.
"""
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from topics.bus import BusError, Record, TopicPartition, connect, offsets_after

HELPER = Path(__file__).with_name("group_member.py")
#: The core cases also run on Kafka's SASL_SSL listener (SCRAM-SHA-512 over TLS; ``bus_url`` in tests/conftest.py).
core = pytest.mark.parametrize("bus_url", ["local", "kafka", "kafka-sasl-ssl"], indirect=True)
REPO = Path(__file__).resolve().parents[2]
SESSION_S = 6.0


def unique(kind: str) -> str:
    return f"contract-{kind}-{uuid.uuid4().hex[:10]}"


def produce(bus, topic: str, n: int, partitions: int, tag: str = "v") -> list[bytes]:
    """Send ``n`` records round the partitions (record i to partition i % partitions); returns their values."""
    producer = bus.producer()
    values = [f"{tag}-{i}".encode() for i in range(n)]
    for i, v in enumerate(values):
        producer.send(topic, v, key=f"k{i}", partition=i % partitions)
    producer.flush()
    producer.close()
    return values


def drain(consumer, want: int, timeout_s: float = 30.0) -> list[Record]:
    """Poll until ``want`` records arrived (or the time is up)."""
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out += consumer.poll(100, 0.2)
    return out


def all_tps(topic: str, n: int) -> set[TopicPartition]:
    return {TopicPartition(topic, p) for p in range(n)}


def stable(assignments: list[set], everything: set) -> bool:
    """Every member owns something, nobody shares, and together they own everything."""
    union = set().union(*assignments)
    return all(assignments) and union == everything and sum(map(len, assignments)) == len(everything)


def poll_until_stable(consumers, everything: set, step=lambda c: c.poll(100, 0.2), timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in consumers:
            step(c)
        if stable([set(c.assignment()) for c in consumers], everything):
            return
    pytest.fail(f"group did not settle: {[c.assignment() for c in consumers]}")


@core
def test_three_consumers_split_the_partitions(bus_url):
    bus = connect(bus_url)
    topic, group = unique("split"), unique("g")
    bus.admin().create_topic(topic, partitions=6)
    consumers = [bus.consumer(group, session_timeout_s=SESSION_S) for _ in range(3)]
    for c in consumers:
        c.subscribe([topic])
    poll_until_stable(consumers, all_tps(topic, 6), step=lambda c: c.poll(100, 0.2) and pytest.fail("no records yet"))
    owned = [set(c.assignment()) for c in consumers]

    sent = produce(bus, topic, 60, 6)
    got: list[list[Record]] = [[] for _ in consumers]
    deadline = time.monotonic() + 30
    while sum(map(len, got)) < 60 and time.monotonic() < deadline:
        for c, g in zip(consumers, got):
            g += c.poll(100, 0.2)

    for c, g, mine in zip(consumers, got, owned):
        assert g and {r.tp for r in g} <= mine
        assert set(c.assignment()) == mine
    assert sorted(r.value for g in got for r in g) == sorted(sent)   # exactly once each, nothing missing
    members = bus.admin().group_members(group)                        # what `astraflow status` shows
    assert sorted(sorted(m) for m in members.values()) == sorted(sorted(o) for o in owned)
    for c in consumers:
        c.close()


def test_fourth_member_joins_rebalance_loses_nothing(bus_url):
    bus = connect(bus_url)
    admin = bus.admin()
    topic, group = unique("join"), unique("g")
    admin.create_topic(topic, partitions=6)
    processed: dict[int, set[bytes]] = {}

    def step(c):
        records = c.poll(100, 0.2)
        if records:
            try:
                c.commit(records)
            except BusError:          # partition moved in a rebalance: the new owner gets these again
                return
            processed.setdefault(id(c), set()).update(r.value for r in records)

    consumers = [bus.consumer(group, session_timeout_s=SESSION_S) for _ in range(3)]
    for c in consumers:
        c.subscribe([topic])
    poll_until_stable(consumers, all_tps(topic, 6), step)
    sent = produce(bus, topic, 60, 6, tag="a")
    for _ in range(3):
        for c in consumers:
            step(c)

    fourth = bus.consumer(group, session_timeout_s=SESSION_S)
    fourth.subscribe([topic])
    consumers.append(fourth)
    poll_until_stable(consumers, all_tps(topic, 6), step)
    sent += produce(bus, topic, 60, 6, tag="b")
    deadline = time.monotonic() + 60
    while set().union(*processed.values()) != set(sent) and time.monotonic() < deadline:
        for c in consumers:
            step(c)

    assert set().union(*processed.values()) == set(sent)
    assert processed.get(id(fourth), set()) & {v for v in sent if v.startswith(b"b")}
    assert stable([set(c.assignment()) for c in consumers], all_tps(topic, 6))
    assert sum(admin.group_lag(group, topic).values()) == 0
    for c in consumers:
        c.close()


@core
def test_member_killed_before_commit_its_records_go_to_another(bus_url, tmp_path):
    bus = connect(bus_url)
    topic, group = unique("kill"), unique("g")
    bus.admin().create_topic(topic, partitions=4)
    survivor = bus.consumer(group, session_timeout_s=SESSION_S)
    survivor.subscribe([topic])
    out = tmp_path / "member.jsonl"
    out.touch()
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    member = subprocess.Popen([sys.executable, str(HELPER), bus_url, topic, group, str(out), str(SESSION_S)],
                              env=env, cwd=REPO)

    def member_state() -> tuple[set[TopicPartition], set[bytes]]:
        assignment, values = _member_log(out)
        return assignment, set(values)

    got: set[bytes] = set()

    def step():
        records = survivor.poll(100, 0.2)
        if records:
            try:
                survivor.commit(records)
                got.update(r.value for r in records)
            except BusError:
                pass

    try:
        deadline = time.monotonic() + 60
        while not stable([set(survivor.assignment()), member_state()[0]], all_tps(topic, 4)):
            assert time.monotonic() < deadline, f"group did not settle: {survivor.assignment()}, {member_state()}"
            assert member.poll() is None, "group member process exited"
            step()
        member_tps = member_state()[0]
        sent = produce(bus, topic, 40, 4)
        on_member = {v for i, v in enumerate(sent) if TopicPartition(topic, i % 4) in member_tps}
        deadline = time.monotonic() + 30
        while member_state()[1] != on_member:
            assert time.monotonic() < deadline, "the member did not receive its records"
            step()
    finally:
        member.kill()
        member.wait()

    deadline = time.monotonic() + 60
    while got != set(sent) and time.monotonic() < deadline:
        step()
    assert member_state()[1] == on_member and on_member        # received, never committed ...
    assert got == set(sent)                                    # ... and redelivered to the survivor
    assert set(survivor.assignment()) == all_tps(topic, 4)
    survivor.close()


def _member_log(path: Path) -> tuple[set[TopicPartition], list[bytes]]:
    """The last assignment and every record value a :mod:`group_member` process wrote to ``path``."""
    assignment, values = set(), []
    for line in path.read_text().splitlines():
        item = json.loads(line)
        if "assignment" in item:
            assignment = {TopicPartition(*tp) for tp in item["assignment"]}
        else:
            values.append(item["record"][2].encode())
    return assignment, values


def test_restarted_static_member_takes_its_partitions_back_before_its_session_expires(bus_url, tmp_path):
    # A long session: a dynamic member's successor would wait it out (60 s) before getting any partition. The
    # static one gets them back within half of it: its start-up and join take a few seconds, far less on a quiet
    # machine; half the session leaves a busy one ~10 times that.
    bus = connect(bus_url)
    topic, group, session_s = unique("static"), unique("g"), 60.0
    bus.admin().create_topic(topic, partitions=4)
    sent = produce(bus, topic, 20, 4)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    def start(out: Path) -> subprocess.Popen:
        out.touch()
        return subprocess.Popen([sys.executable, str(HELPER), bus_url, topic, group, str(out), str(session_s),
                                 "member-0"], env=env, cwd=REPO)

    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    member = start(first)
    try:
        deadline = time.monotonic() + 60
        while sorted(_member_log(first)[1]) != sorted(sent):
            assert time.monotonic() < deadline, f"first member got {_member_log(first)}"
            assert member.poll() is None, "group member process exited"
            time.sleep(0.1)
        member.kill()
        member.wait()
        member = start(second)
        t0 = time.monotonic()
        while sorted(_member_log(second)[1]) != sorted(sent):   # nothing was committed: all redelivered
            assert time.monotonic() - t0 < session_s / 2, f"restarted member got {_member_log(second)}"
            assert member.poll() is None, "group member process exited"
            time.sleep(0.1)
        assert _member_log(second)[0] == all_tps(topic, 4)
    finally:
        member.kill()
        member.wait()


def test_replay_under_a_new_group_gives_the_identical_sequence(bus_url):
    bus = connect(bus_url)
    topic = unique("replay")
    bus.admin().create_topic(topic, partitions=3)
    producer = bus.producer()
    for i in range(45):
        producer.send(topic, f"r-{i}".encode(), key=f"prompt-{i % 7}", headers={"i": str(i)})
    producer.flush()

    def read_all(group: str) -> dict[int, list[tuple]]:
        c = bus.consumer(group, session_timeout_s=SESSION_S)
        c.subscribe([topic])
        records = drain(c, 45)
        c.commit(records)
        c.close()
        per: dict[int, list[tuple]] = {}
        for r in records:
            per.setdefault(r.partition, []).append((r.offset, r.key, r.value, r.headers, r.timestamp_ms))
        return per

    first, again = read_all(unique("g")), read_all(unique("g"))
    assert sum(map(len, first.values())) == 45
    assert again == first
    for seq in first.values():
        assert [o for o, *_ in seq] == sorted(o for o, *_ in seq)


def test_seek_to_timestamp_gives_exactly_the_later_batch(bus_url):
    bus = connect(bus_url)
    topic = unique("time")
    bus.admin().create_topic(topic, partitions=2)
    produce(bus, topic, 10, 2, tag="a")
    time.sleep(0.3)
    cut_ms = time.time_ns() // 1_000_000
    time.sleep(0.05)
    batch_b = produce(bus, topic, 10, 2, tag="b")

    reader = bus.consumer(None)
    reader.assign(sorted(all_tps(topic, 2)))
    reader.seek_to_timestamp(cut_ms)
    assert sorted(r.value for r in drain(reader, 10)) == sorted(batch_b)
    assert reader.poll(100, 0.5) == []
    reader.close()

    member = bus.consumer(unique("g"), session_timeout_s=SESSION_S)
    member.subscribe([topic])
    member.seek_to_timestamp(cut_ms)          # before the assignment: applies once partitions arrive
    assert sorted(r.value for r in drain(member, 10)) == sorted(batch_b)
    member.close()


@core
def test_lag_is_exact(bus_url):
    bus = connect(bus_url)
    admin = bus.admin()
    topic, group = unique("lag"), unique("g")
    admin.create_topic(topic, partitions=2)
    produce(bus, topic, 20, 2)
    assert admin.group_lag(group, topic) == {0: 10, 1: 10}

    c = bus.consumer(group, session_timeout_s=SESSION_S)
    c.subscribe([topic])
    records = drain(c, 20)
    assert len(records) == 20
    by_part = {p: sorted((r for r in records if r.partition == p), key=lambda r: r.offset) for p in (0, 1)}
    c.commit(by_part[0][:4] + by_part[1][:3])                  # k = 7 processed
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    assert c.committed([tp0, tp1]) == {tp0: 4, tp1: 3}
    assert c.lag() == {tp0: 6, tp1: 7}
    assert admin.group_offsets(group, topic) == {0: 4, 1: 3}
    assert admin.group_lag(group, topic) == {0: 6, 1: 7}
    assert sum(admin.end_offsets(topic).values()) == 20
    c.close()
    admin.close()  # releases the clients of its reads; a later read opens them again
    assert admin.group_lag(group, topic) == {0: 6, 1: 7}
    admin.close()


@core
def test_headers_and_keys_round_trip(bus_url):
    bus = connect(bus_url)
    topic = unique("headers")
    bus.admin().create_topic(topic, partitions=1)
    producer = bus.producer()
    before_ms = time.time_ns() // 1_000_000
    producer.send(topic, b"payload", key="prompt-1", headers={"policy": "actor", "raw": b"\x00\xff\x10bin"})
    producer.send(topic, None, key=b"\x01\x02")                # a tombstone: no value, no headers
    producer.flush()
    reader = bus.consumer(None)
    reader.assign([TopicPartition(topic, 0)])
    first, second = drain(reader, 2)
    assert (first.key, first.value, first.headers) == (b"prompt-1", b"payload", {"policy": b"actor", "raw": b"\x00\xff\x10bin"})
    assert (second.key, second.value, second.headers) == (b"\x01\x02", None, {})
    assert (first.offset, second.offset) == (0, 1)
    assert before_ms - 5000 <= first.timestamp_ms <= time.time_ns() // 1_000_000 + 5000
    reader.close()


@core
def test_compacted_topic_keeps_the_latest_value_per_key(bus_url):
    bus = connect(bus_url)
    admin = bus.admin()
    topic = unique("compact")
    admin.create_topic(topic, partitions=1, compacted=True,
                       config={"segment.ms": "100", "min.cleanable.dirty.ratio": "0.01", "delete.retention.ms": "100"})
    assert admin.describe_topic(topic).compacted
    producer = bus.producer()
    for version in range(4):
        for k in range(5):
            producer.send(topic, f"key{k}-v{version}".encode(), key=f"key{k}")
    producer.flush()
    latest = {(f"key{k}".encode(), f"key{k}-v3".encode(), 15 + k) for k in range(5)}   # offsets kept

    deadline, i = time.monotonic() + 60, 0
    while True:
        producer.send(topic, b"roll", key=f"dummy-{i}")         # rolls the active segment along
        producer.flush()
        i += 1
        reader = bus.consumer(None)
        reader.assign([TopicPartition(topic, 0)])
        end = admin.end_offsets(topic)[0]
        records, until = [], time.monotonic() + 10
        while (not records or records[-1].offset < end - 1) and time.monotonic() < until:
            records += reader.poll(500, 0.2)
        reader.close()
        kept = {(r.key, r.value, r.offset) for r in records if r.key.startswith(b"key")}
        if kept == latest:
            break
        assert kept >= latest, "the latest value of a key was lost"
        assert time.monotonic() < deadline, f"not compacted after 60 s: {sorted(kept)}"
        time.sleep(0.5)


def test_pause_and_resume_per_partition(bus_url):
    bus = connect(bus_url)
    topic = unique("pause")
    bus.admin().create_topic(topic, partitions=2)
    sent = produce(bus, topic, 20, 2)
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    c = bus.consumer(unique("g"), session_timeout_s=SESSION_S)
    c.assign([tp0, tp1])
    c.pause([tp0])
    got = drain(c, 10)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        got += c.poll(100, 0.2)
    assert sorted(r.value for r in got) == sorted(sent[1::2]) and {r.tp for r in got} == {tp1}
    c.resume([tp0])
    rest = drain(c, 10)
    assert sorted(r.value for r in rest) == sorted(sent[0::2])
    c.close()


def test_a_pause_ends_with_the_partition_ownership_so_a_resumed_member_reads_what_returns(bus_url):
    # A pauses its 4 partitions; B joins and takes some; A resumes what it owns; B leaves. A pause
    # belongs to the member's ownership: the partitions coming back from B are not paused.
    bus = connect(bus_url)
    topic, group = unique("pause-rebalance"), unique("g")
    bus.admin().create_topic(topic, partitions=4)
    a = bus.consumer(group, session_timeout_s=SESSION_S)
    a.subscribe([topic])
    poll_until_stable([a], all_tps(topic, 4))
    a.pause(a.assignment())
    b = bus.consumer(group, session_timeout_s=SESSION_S)
    b.subscribe([topic])
    poll_until_stable([a, b], all_tps(topic, 4))
    a.resume(a.assignment())
    b.close()
    poll_until_stable([a], all_tps(topic, 4))
    sent = produce(bus, topic, 40, 4)
    got = drain(a, 40)
    assert sorted(r.value for r in got) == sorted(sent)
    a.close()


def test_oversized_record_surfaces_an_error(bus_url):
    bus = connect(bus_url)
    topic = unique("big")
    bus.admin().create_topic(topic, partitions=1)
    producer = bus.producer()
    with pytest.raises(BusError):
        producer.send(topic, b"x" * (64 * 1024 * 1024 + 1))
        producer.flush()
    producer.send(topic, b"small")                            # the producer remains usable
    producer.flush()
    assert bus.admin().end_offsets(topic) == {0: 1}


@core
def test_transactions_abort_hides_commit_shows_with_offsets(bus_url):
    bus = connect(bus_url)
    source, sink, group = unique("txin"), unique("txout"), unique("g")
    admin = bus.admin()
    admin.create_topic(source, partitions=1)
    admin.create_topic(sink, partitions=1)
    inputs = produce(bus, source, 5, 1)
    consumer = bus.consumer(group, session_timeout_s=SESSION_S)
    consumer.subscribe([source])
    records = drain(consumer, 5)
    assert sorted(r.value for r in records) == sorted(inputs)
    offsets = offsets_after(records)

    producer = bus.producer(transactional_id=unique("tx"))
    producer.begin_transaction()
    for r in records:
        producer.send(sink, b"aborted-" + r.value, key=r.key)
    producer.abort_transaction()
    assert consumer.committed([TopicPartition(source, 0)]) == {TopicPartition(source, 0): None}

    producer.begin_transaction()
    for r in records:
        producer.send(sink, b"committed-" + r.value, key=r.key)
    producer.commit_transaction(consumer, offsets)
    assert consumer.committed([TopicPartition(source, 0)]) == {TopicPartition(source, 0): 5}

    reader = bus.consumer(unique("g"), read_committed=True, session_timeout_s=SESSION_S)
    reader.subscribe([sink])
    seen = drain(reader, 5)
    seen += reader.poll(100, 1.0)
    assert sorted(r.value for r in seen) == sorted(b"committed-" + v for v in inputs)
    reader.close()
    consumer.close()
    producer.close()
