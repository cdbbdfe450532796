"""Garbage on a trajectory topic ends in ``deadletter``; every valid message is still processed."""
import time
import uuid

import numpy as np

from topics.bus import connect
from topics.codec import decode, encode, headers_for
from topics.deadletter import ValidatingConsumer
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import DeadLetter, Sample, TrajectoryGroup


def group(i: int) -> TrajectoryGroup:
    s = Sample(input_ids=np.arange(4), loss_mask=[0, 1, 1, 1], behavior_logprobs=np.zeros(4),
               versions=[-1, 0, 0, 0], reward=float(i % 2))
    return TrajectoryGroup.build(samples=[s, s], prompt_id=f"p{i}", group_id=f"g{i}", policy="actor")


def drain(consumer, want: int, timeout_s: float = 30.0):
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out += consumer.poll(100, 0.5)
    return out


def test_garbage_goes_to_deadletter_and_valid_messages_are_processed(bus_url):
    bus = connect(bus_url)
    names = TopicNames(f"dl{uuid.uuid4().hex[:8]}")
    admin = bus.admin()
    ensure_run_topics(admin, names, ["actor"], partitions=2)
    topic = names.trajectories("actor")
    producer = bus.producer()
    for i in range(10):
        if i in (3, 7):
            producer.send(topic, b"\x28\xb5\x2f\xfd garbage", key=f"p{i}")
        else:
            g = group(i)
            producer.send(topic, encode(g), key=g.prompt_id, headers=headers_for(g))
    producer.flush()

    consumer = bus.consumer(f"filter-{names.run}", session_timeout_s=6)
    consumer.subscribe([topic])
    vc = ValidatingConsumer(consumer, producer, names.deadletter, TrajectoryGroup)
    processed, deadline = [], time.monotonic() + 30
    while len(processed) + vc.rejected < 10 and time.monotonic() < deadline:
        processed += [m.group_id for _, m in vc.poll(100, 0.5)]
        vc.commit(vc.last_offsets)
    assert sorted(processed) == sorted(f"g{i}" for i in range(10) if i not in (3, 7))
    assert vc.rejected == 2
    assert sum(admin.group_lag(consumer.group, topic).values()) == 0  # committed past the rejects
    consumer.close()

    reader = bus.consumer(None)
    reader.assign([(names.deadletter, p) for p in range(2)])
    letters = [decode(r.value, DeadLetter) for r in drain(reader, 2)]
    assert sorted(l.key for l in letters) == [b"p3", b"p7"]
    for l in letters:
        assert l.topic == topic and l.value == b"\x28\xb5\x2f\xfd garbage"
        assert "zstd" in l.error and f"{topic}[{l.partition}]@{l.offset}" in l.error
        assert l.consumer_group == consumer.group
    reader.close()
