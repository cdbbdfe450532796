"""A plain producer replaced in place keeps every record: records sent while the broker is stopped are sent again
through the new producer and all arrive once the broker is back, in their order, none twice (the old producer
never reached the broker). A stuck producer is not replaced while the broker does not answer (a new one could
not do better)."""
import time
import uuid

import pytest

from topics.bus import BusError, TopicPartition, connect


@pytest.mark.slow  # a private broker stopped and started: ~40 s
def test_a_renewed_producer_sends_its_unacknowledged_records_again_and_loses_none(private_broker):
    bus = connect(private_broker.url)
    topic = f"renew-{uuid.uuid4().hex[:10]}"
    bus.admin().create_topic(topic, partitions=2)
    producer = bus.producer()
    producer.send(topic, b"before", key="k", partition=0)
    producer.flush(30)
    producer.stuck_s = 1.0
    private_broker.stop()
    values = [f"v{i}".encode() for i in range(10)]
    for i, v in enumerate(values):
        producer.send(topic, v, key=f"k{i}", partition=i % 2)
    time.sleep(1.5)
    with pytest.raises(BusError, match="unacknowledged"):
        producer.flush(1)
    assert producer.renewals == 0  # stuck, but the broker does not answer: nothing to gain from a new producer
    producer.renew("the test replaces it")
    assert producer.renewals == 1
    private_broker.start()
    producer.flush(120)
    reader = bus.consumer(None)
    reader.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
    reader.seek_to_beginning()
    # A reader in no group starts at the beginning without asking the group coordinator, which a restarted broker
    # may not have for a minute under load (one CI run read nothing in 60 s while librdkafka waited on it).
    got, errors, deadline = [], [], time.monotonic() + 60
    while len(got) < 11 and time.monotonic() < deadline:
        try:
            got += reader.poll(100, 0.5)
        except BusError as e:  # a partition leader not elected yet
            errors.append(str(e))
            time.sleep(0.5)
    reader.close()
    by_partition = {p: [r.value for r in got if r.partition == p] for p in (0, 1)}
    assert by_partition == {0: [b"before", *values[0::2]], 1: values[1::2]}, (by_partition, errors[-3:])
