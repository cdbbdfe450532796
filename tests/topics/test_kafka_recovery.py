"""Recovery of Kafka group members on a real broker, by the liveness rule: a member that librdkafka makes unusable
(a static member fenced: another consumer joined with its ``group.instance.id``, as librdkafka's own rejoin does
after a broker restart) raises :class:`topics.bus.FatalBusError`, and its restart (a new member with the same
``group.instance.id``) reads on from the group's committed offsets, losing nothing; a member that reads nothing
while records wait for it and the cluster answers (left out of its group, or its own client cut off) is
:class:`topics.liveness.Stalled`; a member idle because another owns the partitions is not."""
import logging
import time
import uuid

import pytest

from topics.bus import FatalBusError, TopicPartition, connect, offsets_after
from topics.liveness import ProgressWatch, Stalled

SESSION_S = 6.0


def drain(consumer, want: int, timeout_s: float = 30.0) -> list:
    """Poll until ``want`` records arrived (or the time is up)."""
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out += consumer.poll(100, 0.2)
    return out


def fence(bus, group: str, topic: str, instance: str) -> None:
    """Join ``group`` as ``instance`` (the coordinator hands it the old member's place), then close."""
    usurper = bus.consumer(group, instance_id=instance, session_timeout_s=SESSION_S)
    usurper.subscribe([topic])
    deadline = time.monotonic() + 30
    while not usurper.assignment():
        assert time.monotonic() < deadline, "the second member was not assigned"
        usurper.poll(100, 0.2)
    usurper.close()


def send(bus, topic: str, tag: str, n: int = 10, partitions: int = 2) -> list[bytes]:
    producer = bus.producer()
    values = [f"{tag}-{i}".encode() for i in range(n)]
    for i, v in enumerate(values):
        producer.send(topic, v, partition=i % partitions)
    producer.flush()
    return values


def member_that_read(bus, kind: str):
    """A new 1-partition topic holding 4 records, and a static member of a new group that subscribed to it and
    read them. Returns (topic, group, member, the records read)."""
    topic, group = f"{kind}-{uuid.uuid4().hex[:10]}", f"g-{uuid.uuid4().hex[:10]}"
    bus.admin().create_topic(topic, partitions=1)
    first = send(bus, topic, "a", n=4, partitions=1)
    member = bus.consumer(group, instance_id="member-0", session_timeout_s=SESSION_S)
    member.subscribe([topic])
    read = drain(member, 4)
    assert sorted(r.value for r in read) == sorted(first)
    return topic, group, member, read


def test_a_fenced_static_member_raises_and_its_restart_reads_on_from_the_commits(kafka_url):
    bus = connect(kafka_url)
    topic, group = f"fence-{uuid.uuid4().hex[:10]}", f"g-{uuid.uuid4().hex[:10]}"
    bus.admin().create_topic(topic, partitions=2)
    first = send(bus, topic, "a")
    member = bus.consumer(group, instance_id="member-0", session_timeout_s=SESSION_S)
    member.subscribe([topic])
    read = drain(member, 10)
    assert sorted(r.value for r in read) == sorted(first)
    member.commit(read[:6])

    # fenced, it raises at its next commit or read: nothing of what it read after its commit is committed
    fence(bus, group, topic, "member-0")
    second = send(bus, topic, "b")
    with pytest.raises(FatalBusError, match="(?i)fenced|unusable"):
        member.commit(read)
        drain(member, 100, timeout_s=20)
    member.close()

    # its restart takes its place and reads what was not committed, and nothing else
    restarted = bus.consumer(group, instance_id="member-0", session_timeout_s=SESSION_S)
    restarted.subscribe([topic])
    committed = offsets_after(read[:6])
    expected = {r.value for r in read if r.offset >= committed.get(TopicPartition(r.topic, r.partition), 0)}
    again = drain(restarted, len(expected) + 10)
    assert {r.value for r in again} == expected | set(second), sorted(r.value for r in again)
    restarted.close()


def watch(bus, member, topic: str, group: str) -> ProgressWatch:
    """The liveness rule on ``member``, looking at every call, stalled after 4 s."""
    return ProgressWatch(member, bus.admin(), topic, group, "member", logging.getLogger("test"), every_s=0.0,
                         stall_s=4.0)


def test_a_member_the_group_left_out_is_stalled_and_an_idle_member_is_not(kafka_url):
    """A subscribed member whose librdkafka client is out of the group (unsubscribed under it, as a member that
    never rejoined after a broker restart) holds no partition while the group's records wait at unmoved committed
    offsets: stalled. Of two members of a group with one partition, caught up, neither is: the one that holds no
    partition is idle, not left out."""
    bus = connect(kafka_url)
    topic, group, member, _ = member_that_read(bus, "left")
    member._c.unsubscribe()  # the fault: the client leaves the group; the member still believes it subscribed
    member._assigned.clear()  # what librdkafka's revoke tells it
    rule, since = watch(bus, member, topic, group), time.monotonic()
    with pytest.raises(Stalled, match=r"member stalled: holds no partition of .*p0 at None \(4 behind\)"):
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            member.poll(100, 0.2)
            rule.check(since)
    member.close()

    owner = bus.consumer(group, instance_id="owner", session_timeout_s=SESSION_S)
    owner.subscribe([topic])
    owner.commit(drain(owner, 4))  # caught up
    idle = bus.consumer(group, instance_id="idle", session_timeout_s=SESSION_S)
    idle.subscribe([topic])
    rules, since = [watch(bus, c, topic, group) for c in (owner, idle)], time.monotonic()
    end = time.monotonic() + 12  # three times the bound
    while time.monotonic() < end:
        for c, rule in zip((owner, idle), rules):
            c.poll(100, 0.2)
            rule.check(since)  # raises if either were stalled
    assert sorted(owner.assignment() + idle.assignment()) == [TopicPartition(topic, 0)]  # one of them holds it
    idle.close()
    owner.close()


def cut_off(member) -> None:
    """The fault: the member's librdkafka client loses the cluster (its connections go to a port nothing listens
    on), as a client that came out of a broker restart stuck, while every other client reaches the broker."""
    import socket

    from confluent_kafka import Consumer as RawConsumer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound and closed: connections to it are refused
    member._c.close()
    member._c = RawConsumer({**member._conf, "bootstrap.servers": dead, "log_level": 0})
    member._c.subscribe(member._subscribed)
    member._assigned.clear()


def test_a_member_whose_own_client_is_cut_off_while_the_cluster_answers_is_stalled(kafka_url):
    """A member whose own client gets no answer while the cluster answers another client (the rule's admin) is
    stuck, not waiting out an outage: its records wait at the group's unmoved committed offsets, so it is stalled
    and exits; its restart reads the records it did not commit."""
    bus = connect(kafka_url)
    topic, group, member, read = member_that_read(bus, "cut")
    member.commit(read[:2])  # the group's commits: 2 of the 4
    cut_off(member)
    rule, since = watch(bus, member, topic, group), time.monotonic()
    with pytest.raises(Stalled, match=r"p0 at 2 \(2 behind\)"):
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            assert member.poll(100, 0.2) == []
            rule.check(since)
    member.close()
    restarted = bus.consumer(group, instance_id="member-0", session_timeout_s=SESSION_S)
    restarted.subscribe([topic])
    assert sorted(r.value for r in drain(restarted, 2)) == sorted(r.value for r in read[2:])
    restarted.close()
