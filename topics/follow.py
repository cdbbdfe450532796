"""Read a whole topic from its beginning, with no consumer group: the one path for every such reader.

- :class:`TopicReader`: the raw records of every partition, as they arrive, and :meth:`~TopicReader.read_to_end`;
- :class:`Follower`: the decoded messages of one schema (e.g. the ``WeightAnnouncement`` s on ``<run>.weights``);
- :class:`LatestByKey`: the newest message of one schema per record key (a compacted topic's current state);
- :func:`topics.bus.read_topic`: a topic's records up to its end offsets, once.

Nothing is committed, so every reader sees the whole topic (what retention and compaction left of it).

The end of a partition: a partition is read to its end once the consumer's position
(:meth:`topics.bus.Consumer.position`) reaches the end offset. On Kafka, a ``read_committed`` reader of a
transactionally written topic (``samples.<policy>``, ``metrics``, ``deadletter``) never receives the
commit and abort markers, nor an aborted transaction's records, though they take offsets; the position
counts them, the offsets of the records returned do not. As a last resort (a position that does not
move past them), once the reader has received a record, ``idle_s`` seconds without a new record and
without a moving position also end the read, with a warning naming what was left. A reader that has
received nothing yet waits for its deadline instead, so a slow first fetch is not mistaken for an
empty topic.
"""
from __future__ import annotations

import logging
import time
from typing import Generic, Iterable, TypeVar

from topics.bus import Bus, BusError, Record, TopicPartition
from topics.codec import MessageError, decode
from topics.schemas import Message

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

#: Seconds without a new record or a moving position after which a reader that has received records takes
#: a partition still short of its end offset to end in transaction markers or aborted records (module docstring).
IDLE_S = 5.0


class TopicReader:
    """Every partition of ``topic`` (those it has when the reader is made), read from its beginning
    (the earliest retained offset) with no consumer group.

    Args:
        bus: the bus.
        topic: an existing topic.
        client_id: names the consumer in broker logs.

    Attributes:
        positions: partition -> the next offset to read, after the records returned so far (the earliest
            retained offset before any).

    Raises:
        topics.bus.BusError: the topic does not exist, or the bus failed.
    """

    def __init__(self, bus: Bus, topic: str, client_id: str | None = None):
        self.topic = topic
        self._admin = bus.admin()
        self.positions: dict[int, int] = self._admin.start_offsets(topic)
        self._live = False  # a record has arrived: the broker serves this reader
        self._consumer = bus.consumer(None, client_id=client_id)
        tps = [TopicPartition(topic, p) for p in sorted(self.positions)]
        # seek after assign, naming the partitions: both backends apply it to them (a seek_to_beginning()
        # without partitions before any assign would wait for the next assignment instead)
        self._consumer.assign(tps)
        self._consumer.seek_to_beginning(tps)

    def poll(self, timeout_s: float = 0.0) -> list[Record]:
        """The records that arrived (at most 500), waiting up to ``timeout_s`` seconds for the first.

        Raises:
            topics.bus.BusError: the bus failed.
        """
        records = self._consumer.poll(max_records=500, timeout_s=timeout_s)
        for r in records:
            self.positions[r.partition] = r.offset + 1
        self._live = self._live or bool(records)
        return records

    def read_to_end(self, timeout_s: float = 30.0, idle_s: float = IDLE_S) -> tuple[list[Record], dict[int, int]]:
        """Poll until every record written before this call has been read.

        A partition is done when the consumer's position reaches the end offset taken at the start of the
        call; when this reader has received records, ``idle_s`` seconds without a new one or a moving position
        also end the read (module docstring).

        Returns:
            ``(records, ends)``: the records read by this call, in arrival order (each partition's in
            offset order; a few written after the call may be among them), and the end offsets per
            partition the call read up to.

        Raises:
            topics.bus.BusError: the bus failed, or the records did not arrive within ``timeout_s`` seconds.
        """
        ends = {p: end for p, end in self._admin.end_offsets(self.topic).items() if p in self.positions}
        out: list[Record] = []
        deadline = time.monotonic() + timeout_s
        last, seen = time.monotonic(), None
        while True:
            short = [TopicPartition(self.topic, p) for p, end in ends.items() if self.positions[p] < end]
            if not short:
                break
            at = self._consumer.position(short)
            short = [tp for tp in short if (at.get(tp) or 0) < ends[tp.partition]]
            if not short:
                break
            now = time.monotonic()
            if at != seen:
                last, seen = now, at
            if self._live and now - last >= idle_s:
                log.warning("%s: no record and no moving position for %.1f s; taking partitions (position, end) "
                            "%s to end in transaction markers or aborted records", self.topic, idle_s,
                            {tp.partition: (at.get(tp), ends[tp.partition]) for tp in short})
                break
            if now > deadline:
                raise BusError(f"{self.topic}: records up to {ends} did not arrive in {timeout_s} s "
                               f"(read up to {self.positions})")
            records = self.poll(timeout_s=min(0.2, idle_s))
            if records:
                last = time.monotonic()
                out += records
        return out, ends

    def close(self) -> None:
        """Stop reading."""
        self._consumer.close()


class Follower(Generic[M]):
    """The ``schema`` messages of ``topic``: every partition, from its beginning, no consumer group
    (:class:`TopicReader`).

    Records of other schemas (told by the ``schema`` header, without decoding) are skipped; a record that
    fails to decode is logged and skipped (no dead letter: every follower re-reads it from the beginning).

    Args:
        bus: the bus.
        topic: an existing topic.
        schema: the message class read.
        client_id: names the consumer in broker logs.

    Raises:
        topics.bus.BusError: the topic does not exist, or the bus failed.
    """

    def __init__(self, bus: Bus, topic: str, schema: type[M], client_id: str | None = None):
        self.topic, self.schema = topic, schema
        self._reader = TopicReader(bus, topic, client_id)

    @property
    def positions(self) -> dict[int, int]:
        """Partition -> the next offset to read, skipped records included."""
        return self._reader.positions

    def poll(self, timeout_s: float = 0.0) -> list[tuple[Record, M]]:
        """``(record, message)`` for each new ``schema`` record, in arrival order, waiting up to
        ``timeout_s`` seconds for the first record.

        Raises:
            topics.bus.BusError: the bus failed.
        """
        return self._decode(self._reader.poll(timeout_s))

    def read_to_end(self, timeout_s: float = 30.0, idle_s: float = IDLE_S) -> list[tuple[Record, M]]:
        """Like :meth:`poll`, for every record written before this call (:meth:`TopicReader.read_to_end`).

        Raises:
            topics.bus.BusError: the bus failed, or the records did not arrive within ``timeout_s`` seconds.
        """
        return self._decode(self._reader.read_to_end(timeout_s, idle_s)[0])

    def _decode(self, records: Iterable[Record]) -> list[tuple[Record, M]]:
        schema = self.schema.SCHEMA.encode()
        out = []
        for rec in records:
            if rec.headers.get("schema", schema) != schema:
                continue
            try:
                out.append((rec, decode(rec.value, self.schema, topic=rec.topic, partition=rec.partition,
                                        offset=rec.offset)))
            except MessageError as e:
                log.warning("%s: skipping a bad record: %s", self.topic, e)
        return out

    def close(self) -> None:
        """Stop following."""
        self._reader.close()


class LatestByKey(Generic[M]):
    """The newest ``schema`` message per record key on ``topic`` (a compacted topic's current state),
    read with a :class:`Follower`.

    Args:
        bus: the bus.
        topic: an existing topic.
        schema: the message class kept.
        client_id: names the consumer in broker logs.

    Attributes:
        latest: record key (UTF-8; ``""`` for none) -> the newest message.

    Raises:
        topics.bus.BusError: the topic does not exist, or the bus failed.
    """

    def __init__(self, bus: Bus, topic: str, schema: type[M], client_id: str | None = None):
        self.topic, self.schema = topic, schema
        self.latest: dict[str, M] = {}
        self._follower = Follower(bus, topic, schema, client_id)

    def poll(self, timeout_s: float = 0.0) -> dict[str, M]:
        """Read what arrived (waiting up to ``timeout_s`` seconds for the first record); returns :attr:`latest`.

        Raises:
            topics.bus.BusError: the bus failed.
        """
        return self._keep(self._follower.poll(timeout_s))

    def read_to_end(self, timeout_s: float = 30.0) -> dict[str, M]:
        """Read every record written before this call; returns :attr:`latest`.

        Raises:
            topics.bus.BusError: the bus failed, or the records did not arrive within ``timeout_s`` seconds.
        """
        return self._keep(self._follower.read_to_end(timeout_s))

    def _keep(self, messages: list[tuple[Record, M]]) -> dict[str, M]:
        for rec, msg in messages:
            self.latest[rec.key.decode("utf-8", "replace") if rec.key is not None else ""] = msg
        return self.latest

    def close(self) -> None:
        """Stop following."""
        self._follower.close()
