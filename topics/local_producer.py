"""The producer of the embedded ``local://`` bus (:mod:`topics.local`).

``send`` appends each record to its partition log at once (:class:`topics.local_log.Appender`);
a transaction buffers records until :meth:`LocalProducer.commit_transaction` (at-least-once
here: see :mod:`topics.local`).
"""
from __future__ import annotations

import threading
import zlib
from typing import TYPE_CHECKING, Mapping

from topics.bus import BusError, Consumer, DeliveryError, Headers, Producer, TopicPartition
from topics.local_log import Appender
from topics.local_topics import topic_config

if TYPE_CHECKING:
    from topics.local import LocalBus

#: Largest value (bytes) the embedded bus accepts; larger ones raise BusError at send.
MAX_VALUE_BYTES = 64 * 1024 * 1024


def _as_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


class LocalProducer(Producer):
    """Producer of the embedded bus: ``send`` appends at once (visible to readers immediately). Thread-safe."""

    def __init__(self, bus: "LocalBus", transactional_id: str | None):
        self._bus = bus
        self._transactional_id = transactional_id
        self._appenders: dict[TopicPartition, Appender] = {}
        self._round_robin: dict[str, int] = {}
        self._failures: list[tuple[str, bytes | None, str]] = []
        self._txn: list[tuple[str, bytes | None, dict[str, bytes], bytes | None, int | None]] | None = None
        self._lock = threading.Lock()      # send may be called from several threads, as on Kafka

    def send(self, topic: str, value: bytes | None, key: str | bytes | None = None,
             headers: Headers | None = None, partition: int | None = None) -> None:
        """Append one record (buffered instead inside a transaction). A missing topic is created with 1 partition.

        Raises:
            BusError: the value exceeds MAX_VALUE_BYTES, the topic name is invalid, or ``partition`` is out of range.
        """
        if value is not None and len(value) > MAX_VALUE_BYTES:
            raise BusError(f"record for topic {topic!r}: value of {len(value)} bytes exceeds the embedded bus "
                           f"limit of {MAX_VALUE_BYTES} bytes")
        k = _as_bytes(key)
        h = {}
        for name, v in (headers or {}).items():
            if not isinstance(v, (str, bytes)):
                raise BusError(f"record for topic {topic!r}: header {name!r} must be str or bytes, not {type(v).__name__}")
            h[name] = _as_bytes(v)
        meta = self._bus._topics.meta(topic)
        count = meta["partitions"] if meta is not None else 1     # a missing topic is created with 1 partition
        if partition is not None and not 0 <= partition < count:
            raise BusError(f"topic {topic!r} has {count} partition(s); partition {partition} does not exist")
        with self._lock:
            if self._txn is not None:
                self._txn.append((topic, k, h, value, partition))
            else:
                self._append(topic, k, h, value, partition)

    def _append(self, topic: str, key: bytes | None, headers: dict[str, bytes], value: bytes | None,
                partition: int | None) -> None:
        topics = self._bus._topics
        for attempt in range(2):
            meta = topics.meta(topic)
            if meta is None:
                topics.create(topic, 1, topic_config(False, None, None))
                meta = topics.require(topic)
            if key is None and "compact" in meta["config"].get("cleanup.policy", ""):
                self._failures.append((topic, key, "compacted topic requires a key"))
                return
            n = meta["partitions"]
            if partition is not None:
                p = partition
            elif key is not None:
                p = zlib.crc32(key) % n
            else:
                p = self._round_robin.get(topic, 0) % n
                self._round_robin[topic] = p + 1
            tp = TopicPartition(topic, p)
            appender = self._appenders.get(tp)
            if appender is None:
                appender = self._appenders[tp] = Appender(topics.partition(topic, p))
            try:
                appender.append([(key, headers, value)], meta["config"])
                return
            except FileNotFoundError:               # deleted (maybe recreated) under us: refresh once
                topics.forget(topic)
                self._appenders.pop(tp).close()
                if attempt:
                    self._failures.append((topic, key, f"topic {topic!r} was deleted while producing"))
            except OSError as e:
                self._failures.append((topic, key, f"write failed: {e}"))
                return

    def flush(self, timeout_s: float = 30.0) -> None:
        """Records are already written by ``send``; raise the failures collected since the last flush.

        Inside a transaction the buffered records stay buffered until :meth:`commit_transaction`.

        Raises:
            DeliveryError: some records could not be appended (compacted topic without key, I/O error, ...).
        """
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise DeliveryError(failures)

    def begin_transaction(self) -> None:
        """Start buffering sent records.

        Raises:
            BusError: the producer has no ``transactional_id`` or a transaction is already open.
        """
        if self._transactional_id is None:
            raise BusError("begin_transaction needs a producer made with transactional_id")
        if self._txn is not None:
            raise BusError(f"transaction of {self._transactional_id!r} is already open")
        self._txn = []

    def commit_transaction(self, consumer: Consumer | None = None,
                           offsets: Mapping[TopicPartition, int] | None = None,
                           timeout_s: float = 30.0) -> None:
        """Append the buffered records, then commit ``offsets`` for ``consumer``'s group (at-least-once).

        Raises:
            BusError: no transaction is open, or the offset commit was refused (the records are then
                already visible: the input will be re-delivered and downstream de-duplication applies).
            DeliveryError: some buffered records could not be appended; offsets are not committed.
        """
        if self._txn is None:
            raise BusError("commit_transaction without begin_transaction")
        with self._lock:
            records, self._txn = self._txn, None
            for topic, k, h, v, p in records:
                self._append(topic, k, h, v, p)
        self.flush()
        if consumer is not None and offsets:
            consumer.commit(offsets)

    def abort_transaction(self, timeout_s: float = 30.0) -> None:
        """Drop the buffered records: they are never written.

        Raises:
            BusError: no transaction is open.
        """
        if self._txn is None:
            raise BusError("abort_transaction without begin_transaction")
        self._txn = None

    def close(self) -> None:
        """Release file descriptors; raises like :meth:`flush` when records failed."""
        for appender in self._appenders.values():
            appender.close()
        self._appenders.clear()
        self.flush()
