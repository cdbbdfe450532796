"""The dead-letter path: a consuming helper that never drops a message silently.

A record whose value cannot be decoded or validated is written to the run's
``deadletter`` topic with its raw bytes, the error and its origin. The write is
acknowledged (flushed) before :meth:`ValidatingConsumer.poll` returns, so a
caller that commits after processing the returned messages never commits past
a rejected record before it is durable in ``deadletter``.
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping

from topics.bus import Consumer, Producer, Record, TopicPartition, offsets_after
from topics.codec import MessageError, decode, encode
from topics.schemas import DeadLetter, Message

log = logging.getLogger(__name__)


def send_to_deadletter(producer: Producer, topic: str, record: Record, error: str, group: str | None) -> None:
    """Queue ``record`` on the dead-letter ``topic`` with ``error`` and its origin (not flushed)."""
    letter = DeadLetter(topic=record.topic, partition=record.partition, offset=record.offset, key=record.key,
                        value=record.value, headers=dict(record.headers), error=error, consumer_group=group or "")
    producer.send(topic, encode(letter), key=record.key,
                  headers={"schema": DeadLetter.SCHEMA, "origin": f"{record.topic}[{record.partition}]@{record.offset}"})


class ValidatingConsumer:
    """Wraps a :class:`~topics.bus.Consumer`: decodes records as ``expect`` and dead-letters the rest.

    Args:
        consumer: a subscribed or assigned consumer.
        producer: used for dead-letter writes (may be the caller's transactional
            producer; then the dead letter commits with the caller's transaction).
        deadletter_topic: the run's ``deadletter`` topic name.
        expect: the schema class (or classes) accepted.
        flush_timeout_s: seconds to wait for the dead-letter acknowledgement.

    Attributes:
        rejected: number of records sent to ``deadletter`` so far.
        last_offsets: offsets to commit once the last batch is processed: per
            partition, the highest polled offset + 1, dead-lettered records included.
    """

    def __init__(self, consumer: Consumer, producer: Producer, deadletter_topic: str,
                 expect: type[Message] | tuple[type[Message], ...], flush_timeout_s: float = 30.0):
        self.consumer, self.producer = consumer, producer
        self.deadletter_topic, self.expect = deadletter_topic, expect
        self.flush_timeout_s = flush_timeout_s
        self.rejected = 0
        self.last_offsets: dict[TopicPartition, int] = {}

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[tuple[Record, Message]]:
        """Poll and decode; returns ``(record, message)`` for each valid record, in order.

        Raises:
            topics.bus.DeliveryError: a dead-letter write was not acknowledged;
                nothing may then be committed past the rejected record.
        """
        return self.decode(self.consumer.poll(max_records, timeout_s))

    def decode(self, records: Iterable[Record]) -> list[tuple[Record, Message]]:
        """Decode ``records``; dead-letter (and flush) the invalid ones. See :meth:`poll`."""
        records = list(records)
        good, bad = [], 0
        for r in records:
            try:
                good.append((r, decode(r.value, self.expect, topic=r.topic, partition=r.partition, offset=r.offset)))
            except MessageError as e:
                log.warning("dead-lettering %s", e)
                send_to_deadletter(self.producer, self.deadletter_topic, r, str(e), self.consumer.group)
                bad += 1
        if bad:
            self.producer.flush(self.flush_timeout_s)
            self.rejected += bad
        self.last_offsets = offsets_after(records)
        return good

    def commit(self, offsets: Mapping[TopicPartition, int] | Iterable[Record]) -> None:
        """Commit on the wrapped consumer (see :meth:`topics.bus.Consumer.commit`)."""
        self.consumer.commit(offsets)
