"""A static group member that the coordinator fences (another consumer joined with its ``group.instance.id``, as
librdkafka's own rejoin does after a broker restart) is re-created in place, on a real broker: at a commit and at
a read. It takes its place back, commits, and reads on from the group's committed offsets; nothing is lost."""
import time
import uuid

from topics.bus import TopicPartition, connect, offsets_after

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


def test_a_fenced_static_member_is_re_created_in_place_and_reads_on_from_its_commits(kafka_url):
    bus = connect(kafka_url)
    topic, group = f"fence-{uuid.uuid4().hex[:10]}", f"g-{uuid.uuid4().hex[:10]}"
    bus.admin().create_topic(topic, partitions=2)
    first = send(bus, topic, "a")
    member = bus.consumer(group, instance_id="member-0", session_timeout_s=SESSION_S)
    member.subscribe([topic])
    read = drain(member, 10)
    assert sorted(r.value for r in read) == sorted(first)

    # fenced at a commit: re-created, it commits as the new member and reads on from there
    fence(bus, group, topic, "member-0")
    member.commit(read)
    assert member.renewals == 1
    assert member.committed(sorted(offsets_after(read))) == offsets_after(read)
    second = send(bus, topic, "b")
    assert sorted(r.value for r in drain(member, 10)) == sorted(second)

    # fenced between reads (its heartbeat is refused): re-created, it reads again from the committed offsets what
    # it read and did not commit (some of the newest may come before it notices, and again after), and nothing else
    fence(bus, group, topic, "member-0")
    third = send(bus, topic, "c")
    again, deadline = [], time.monotonic() + 30
    while not {r.value for r in again} >= set(second + third) and time.monotonic() < deadline:
        again += member.poll(100, 0.2)
    assert member.renewals == 2
    assert {r.value for r in again} == set(second + third), sorted(r.value for r in again)
    assert set(member.assignment()) == {TopicPartition(topic, 0), TopicPartition(topic, 1)}
    member.close()


def test_a_member_the_group_left_out_is_re_created_and_an_idle_member_is_not(kafka_url, monkeypatch):
    """A subscribed member whose librdkafka client is out of the group (unsubscribed under it, as a member that
    never rejoined after a broker restart) is re-created once it has read nothing for ``QUIET_RENEW_S`` and the
    group has no such member, and reads again from the committed offsets. A member idle because the group's only
    partition is owned by another member, and that owner once caught up, are left alone."""
    from topics import kafka
    monkeypatch.setattr(kafka, "QUIET_RENEW_S", 4.0)
    bus = connect(kafka_url)
    topic, group, member, first = member_that_read(bus, "left")
    member._c.unsubscribe()  # the fault: the client leaves the group; the member still believes it subscribed
    again, deadline = [], time.monotonic() + 40
    while len(again) < 4 and time.monotonic() < deadline:
        again += member.poll(100, 0.2)
    assert member.renewals == 1
    assert sorted(r.value for r in again) == sorted(r.value for r in first)  # nothing was committed: all again

    idle = bus.consumer(group, instance_id="member-1", session_timeout_s=SESSION_S)
    idle.subscribe([topic])
    end = time.monotonic() + 12  # three times the bound: it would have been re-created twice
    while time.monotonic() < end:
        member.poll(100, 0.2)
        idle.poll(100, 0.2)
    assert (idle.renewals, member.renewals) == (0, 1)
    assert member.assignment() == [TopicPartition(topic, 0)] and idle.assignment() == []
    idle.close()
    member.close()


def test_a_member_whose_committed_offsets_do_not_come_is_re_created_once(kafka_url, monkeypatch):
    """A transaction that holds offsets of the group and is not ended keeps the group's committed offsets from
    coming (Kafka answers only stable offsets): the member's asks time out while the broker answers, as those of a
    member that lost its coordinator do. Past ``NO_COORDINATOR_RENEW_S`` of that it is re-created once and asks
    again; once the transaction commits, the offsets come."""
    from confluent_kafka import Consumer as RawConsumer, Producer as RawProducer, TopicPartition as RawTP

    from topics import kafka
    monkeypatch.setattr(kafka, "NO_COORDINATOR_RENEW_S", 5.0)
    bus = connect(kafka_url)
    topic, group, member, _ = member_that_read(bus, "unstable")
    bootstrap = kafka_url.removeprefix("kafka://")
    holder = RawProducer({"bootstrap.servers": bootstrap, "transactional.id": f"holder-{uuid.uuid4().hex[:8]}"})
    holder.init_transactions(30)
    holder.begin_transaction()
    metadata = RawConsumer({"bootstrap.servers": bootstrap, "group.id": group}).consumer_group_metadata()
    holder.send_offsets_to_transaction([RawTP(topic, 0, 4)], metadata, 30)  # the fault: offsets held, not ended
    tp = TopicPartition(topic, 0)
    errors = []
    while member.renewals == 0 and len(errors) < 4:
        try:
            member.committed([tp])
        except Exception as e:  # noqa: BLE001 (the BusError is what is asserted on)
            errors.append(str(e))
    # the first ask timed out (10 s); the second, 10 s later, re-created the member, which timed out too
    assert member.renewals == 1 and len(errors) == 2, errors
    assert "Timed out" in errors[0] and "re-created" in errors[1], errors
    holder.commit_transaction(30)
    assert member.committed([tp]) == {tp: 4}
    deadline = time.monotonic() + 30
    while not member.assignment():  # the re-created member joins as it polls, and reads on from the commit
        assert time.monotonic() < deadline, "the re-created member was given no partition"
        assert member.poll(100, 0.2) == []
    assert member.renewals == 1
    member.close()


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


def test_a_member_whose_own_client_is_cut_off_while_the_cluster_answers_is_re_created(kafka_url, monkeypatch):
    """A member whose own client gets no answer, not even to a metadata request, while the cluster answers
    another client (the group's description) is stuck, not waiting out an outage: re-created once it has read
    nothing for ``QUIET_RENEW_S``, and once its commits have found no coordinator for ``NO_COORDINATOR_RENEW_S``,
    it reads on from the group's committed offsets. Before, its own metadata request was the only test of whether
    the broker answered: seen in CI after a broker restart, a trainer and a filter processor stuck for minutes."""
    from topics import kafka
    monkeypatch.setattr(kafka, "QUIET_RENEW_S", 4.0)
    monkeypatch.setattr(kafka, "NO_COORDINATOR_RENEW_S", 4.0)
    bus = connect(kafka_url)
    topic, group, member, read = member_that_read(bus, "cut")
    member.commit(read[:2])  # the group's commits: 2 of the 4

    # reading: nothing comes for QUIET_RENEW_S; re-created, it reads the 2 uncommitted records again
    cut_off(member)
    again = drain(member, 2, timeout_s=40)
    assert member.renewals == 1
    assert sorted(r.value for r in again) == sorted(r.value for r in read[2:])

    # committing: no coordinator for NO_COORDINATOR_RENEW_S; re-created, the new member commits
    cut_off(member)
    errors, deadline = [], time.monotonic() + 40
    while member.renewals == 1 and time.monotonic() < deadline:
        try:
            member.commit(again, timeout_s=10)
        except kafka.BusError as e:
            errors.append(str(e))
            time.sleep(1)
    assert member.renewals == 2, errors
    tp = TopicPartition(topic, 0)
    assert member.committed([tp]) == {tp: 4}
    member.close()
