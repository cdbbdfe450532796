"""Follow a compacted topic and keep the newest message of one schema per key.

Written by non-transactional producers (no transaction markers), so a partition
is read to its end when the next offset to read reaches the end offset.
"""
from __future__ import annotations

import logging
import time
from typing import Generic, TypeVar

from topics.bus import Bus, BusError, TopicPartition
from topics.codec import MessageError, decode
from topics.schemas import Message

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class LatestByKey(Generic[M]):
    """The newest ``schema`` message per record key on ``topic``, read from its beginning.

    No consumer group (nothing is committed): every follower sees the whole topic.
    Records of other schemas (told by the ``schema`` header, without decoding) are
    skipped; a record that fails to decode is logged and skipped.

    Args:
        bus: the bus.
        topic: a topic with ``partitions`` partitions (compacted ones have 1 in a run).
        schema: the message class kept.
        client_id: names the consumer in broker logs.
    """

    def __init__(self, bus: Bus, topic: str, schema: type[M], client_id: str, partitions: int = 1):
        self.topic, self.schema = topic, schema
        self.latest: dict[str, M] = {}
        self._bus = bus
        self._next: dict[int, int] = {}  # partition -> next offset to read
        self._consumer = bus.consumer(None, client_id=client_id)
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        self._consumer.assign(tps)
        self._consumer.seek_to_beginning(tps)

    def poll(self, timeout_s: float = 0.0) -> dict[str, M]:
        """Read what arrived (waiting up to ``timeout_s`` seconds for the first record); returns :attr:`latest`.

        Raises:
            topics.bus.BusError: the bus failed.
        """
        for rec in self._consumer.poll(timeout_s=timeout_s):
            self._next[rec.partition] = rec.offset + 1
            if rec.headers.get("schema", self.schema.SCHEMA.encode()) != self.schema.SCHEMA.encode():
                continue
            try:
                msg = decode(rec.value, self.schema, topic=rec.topic, partition=rec.partition, offset=rec.offset)
            except MessageError as e:
                log.warning("%s: skipping a bad record: %s", self.topic, e)
                continue
            key = rec.key.decode("utf-8", "replace") if rec.key is not None else ""
            self.latest[key] = msg
        return self.latest

    def read_to_end(self, timeout_s: float = 30.0) -> dict[str, M]:
        """Poll until every record written before this call has been read; returns :attr:`latest`.

        Raises:
            topics.bus.BusError: the bus failed, or the records did not arrive within ``timeout_s`` seconds.
        """
        ends = self._bus.admin().end_offsets(self.topic)
        deadline = time.monotonic() + timeout_s
        while any(self._next.get(p, 0) < end for p, end in ends.items()):
            if time.monotonic() > deadline:
                raise BusError(f"{self.topic}: records up to {ends} did not arrive in {timeout_s} s")
            self.poll(timeout_s=0.2)
        return self.latest

    def close(self) -> None:
        """Stop following."""
        self._consumer.close()
