"""Follow a compacted topic and keep the newest message of one schema per key."""
from __future__ import annotations

import logging
from typing import Generic, TypeVar

from topics.bus import Bus, TopicPartition
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

    def close(self) -> None:
        """Stop following."""
        self._consumer.close()
