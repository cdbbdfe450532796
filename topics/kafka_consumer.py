"""The Kafka consumer of the bus API (:class:`KafkaConsumer`), through confluent-kafka: manual commits, pending
seeks applied on assignment, and an unusable client raised as :class:`topics.bus.FatalBusError`."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Mapping

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer as _Consumer,
    KafkaError,
    KafkaException,
    TopicPartition as _TP,
)

from topics.bus import (
    BusError,
    Consumer,
    FatalBusError,
    Record,
    TopicPartition,
    offsets_after,
)
from topics.kafka_client import (
    INVALID_OFFSET,
    Reporter,
    StillRunning,
    bounded,
    check_result,
    is_fatal,
    to_tp,
)

log = logging.getLogger(__name__)

#: Seconds a consumer's close may take before it is left behind (:meth:`KafkaConsumer.close`).
CLOSE_TIMEOUT_S = 30.0
#: Seconds the release of a closed static member's librdkafka consumer may take
#: (:meth:`KafkaConsumer._release`).
RELEASE_TIMEOUT_S = 10.0
#: Seconds a consumer's offset commit may take before the consumer is given up (see :meth:`KafkaConsumer.commit`).
COMMIT_TIMEOUT_S = 60.0


class KafkaConsumer(Consumer):
    """A confluent-kafka consumer: manual commits, pending seeks applied on assignment. ``security``:
    librdkafka security properties (:meth:`topics.kafka_security.KafkaSecurity.librdkafka`)."""

    def __init__(self, bootstrap: str, group: str | None, read_committed: bool = True,
                 session_timeout_s: float = 10.0, client_id: str | None = None, instance_id: str | None = None,
                 security: Mapping[str, str] = {}):
        self.group = group
        session_ms = int(session_timeout_s * 1000)
        static = {"group.instance.id": instance_id} if instance_id and group else {}
        self.name = client_id or group or ""
        self._conf = {**static, **Reporter(f"consumer {self.name}".strip()).conf(), **security,
            "bootstrap.servers": bootstrap,
            "group.id": group or f"astraflow-free-{uuid.uuid4().hex}",
            "client.id": client_id or f"astraflow-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed" if read_committed else "read_uncommitted",
            "session.timeout.ms": session_ms,
            "heartbeat.interval.ms": max(100, session_ms // 4),
            "max.poll.interval.ms": max(session_ms, 300_000),
            "topic.metadata.refresh.interval.ms": 2000,
            "fetch.wait.max.ms": 50,
        }
        self._c = _Consumer(self._conf)
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._pending: dict[TopicPartition, int] = {}  # partition -> offset to seek to
        self._on_assign_seek: tuple[str, int] | None = None  # ("beginning"|"ts", ms) for future partitions
        self._subscribed: list[str] = []  # the topics subscribed to

    # membership
    def group_metadata(self) -> object:
        """librdkafka's group metadata of this member, for offsets sent to a producer's transaction."""
        return self._c.consumer_group_metadata()

    def subscribe(self, topics: list[str]) -> None:
        self._subscribed = list(topics)
        self._c.subscribe(topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                          on_lost=self._on_revoke)

    def _release(self) -> None:
        """Destroy the librdkafka consumer without its consumer close (librdkafka's
        ``RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE``, what confluent-kafka does to a consumer it frees), on a helper
        thread waited for :data:`RELEASE_TIMEOUT_S`. A close runs the revoke through confluent-kafka's rebalance
        callback, which calls ``rd_kafka_rebalance_protocol`` and ``rd_kafka_assign`` holding the interpreter lock,
        and those can wait for ever on a consumer being closed (librdkafka #4041, #4884), freezing the process.
        A static member sends no LeaveGroup at its close anyway, and commits are manual, so nothing is lost: the
        coordinator gives its place to the next member with its ``group.instance.id``, or moves its partitions when
        its session times out. A call still running on it (a commit that never returned) keeps it alive until that
        call returns."""
        box, self._c = [self._c], None  # the helper thread drops the last reference: the free runs there
        try:
            bounded(f"release-{self.name}", box.clear, RELEASE_TIMEOUT_S)
        except StillRunning:
            log.warning("kafka consumer %s: its librdkafka client was not freed in %.0f s; left behind", self.name,
                        RELEASE_TIMEOUT_S)

    def _on_assign(self, consumer, partitions: list[_TP]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self._resolve_default_seek(tps)
        for p, tp in zip(partitions, tps):
            if tp in self._pending:
                p.offset = self._pending.pop(tp)
        consumer.assign(partitions)
        self._assigned = set(tps)
        if self._paused & self._assigned:
            consumer.pause([to_tp(tp) for tp in self._paused & self._assigned])
        if self._assigned - self._paused:  # librdkafka keeps a partition's pause flag across revoke and assign
            consumer.resume([to_tp(tp) for tp in self._assigned - self._paused])

    def _on_revoke(self, consumer, partitions: list[_TP]) -> None:
        # A pause belongs to the ownership, as on the embedded bus: a partition that comes back later
        # is not paused unless the member pauses it again.
        for p in partitions:
            tp = TopicPartition(p.topic, p.partition)
            self._assigned.discard(tp)
            self._paused.discard(tp)

    def assign(self, partitions: list[TopicPartition]) -> None:
        partitions = [TopicPartition(*tp) for tp in partitions]
        self._resolve_default_seek(partitions)
        # A member of no group has no committed offset: start it at the beginning explicitly. Left to
        # librdkafka (an invalid offset), it first asks the group coordinator for the made-up group's commits,
        # and just after a broker restart the coordinator may not answer for a minute: nothing is read meanwhile.
        start = INVALID_OFFSET if self.group is not None else OFFSET_BEGINNING
        self._c.assign([to_tp(tp, self._pending.pop(tp, start)) for tp in partitions])
        self._assigned = set(partitions)

    def assignment(self) -> list[TopicPartition]:
        return sorted(self._assigned)

    def _resolve_default_seek(self, tps: list[TopicPartition]) -> None:
        if self._on_assign_seek is None:
            return
        kind, ts = self._on_assign_seek
        self._on_assign_seek = None
        if kind == "beginning":
            for tp in tps:
                self._pending.setdefault(tp, OFFSET_BEGINNING)
        else:
            for tp, off in self._offsets_for_time(tps, ts).items():
                self._pending.setdefault(tp, off)

    # reading
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, waiting up to ``timeout_s`` seconds for the first.

        Raises:
            FatalBusError: the consumer is unusable (librdkafka's fatal error; for a static group member,
                FENCED_INSTANCE_ID: another member took its ``group.instance.id``). The component exits and
                its supervisor restarts it from the group's committed offsets.
            BusError: any other failure of the read.
        """
        self._apply_pending()
        deadline = time.monotonic() + timeout_s
        out: list[Record] = []
        while len(out) < max_records:
            # librdkafka's consume(n, timeout) waits until it has n messages or the timeout passes:
            # block for the first record only, then take what is already fetched without waiting.
            left = deadline - time.monotonic()
            wait = 0.0 if out else max(0.0, left)
            msgs = self._c.consume(num_messages=1 if wait > 0 else max_records - len(out), timeout=wait)
            for m in msgs:
                err = m.error()
                if err is not None:
                    if is_fatal(err):
                        raise FatalBusError(f"consumer {self.name} of group {self.group} is unusable: {err.str()}")
                    if err.code() not in (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART,
                                          KafkaError._TRANSPORT):
                        raise BusError(f"consume failed: {err}")
                    continue
                if (m.topic(), m.partition()) in self._pending:
                    continue  # fetched before a pending seek on its partition: refetched after the seek
                ts_type, ts = m.timestamp()
                out.append(Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(),
                                  {k: v for k, v in (m.headers() or [])}, ts))
            if self._pending:
                self._apply_pending()
            if not msgs and (out or left <= 0):
                break
        return out

    def _apply_pending(self) -> None:
        for tp in [tp for tp in self._pending if tp in self._assigned]:
            try:
                self._c.seek(to_tp(tp, self._pending[tp]))
                del self._pending[tp]
            except KafkaException:
                pass  # not fetchable yet right after assignment; retried on the next poll

    def commit(self, offsets, timeout_s: float = COMMIT_TIMEOUT_S) -> None:
        """Commit ``offsets`` synchronously, within ``timeout_s`` seconds.

        Raises:
            FatalBusError: the consumer is unusable (fenced, librdkafka's fatal error) or its commit did not
                return in ``timeout_s`` (librdkafka's synchronous commit has no timeout of its own); the
                component exits and restarts from the group's committed offsets.
            BusError: the commit was refused (e.g. no group coordinator yet, a rebalance); retriable.
        """
        if not isinstance(offsets, Mapping):
            offsets = offsets_after(offsets)
        if not offsets:
            return
        try:
            result = bounded(f"commit-{self.group}", lambda: self._c.commit(
                offsets=[to_tp(tp, off) for tp, off in offsets.items()], asynchronous=False), timeout_s)
        except StillRunning:
            raise FatalBusError(f"commit for group {self.group} did not complete in {timeout_s:.0f} s; consumer "
                                f"{self.name} is given up") from None
        except KafkaException as e:
            kind = FatalBusError if is_fatal(e.args[0]) else BusError
            raise kind(f"commit refused for group {self.group}: {e}") from None
        check_result("commit", result or [])

    def commit_async(self, offsets: Mapping[TopicPartition, int]) -> None:
        """librdkafka's asynchronous commit (:meth:`topics.bus.Consumer.commit_async`); its outcome is not reported.

        Raises:
            FatalBusError: the consumer is unusable. BusError: librdkafka refused to send it.
        """
        if not offsets:
            return
        try:
            self._c.commit(offsets=[to_tp(tp, off) for tp, off in offsets.items()], asynchronous=True)
        except KafkaException as e:
            kind = FatalBusError if is_fatal(e.args[0]) else BusError
            raise kind(f"commit refused for group {self.group}: {e}") from None

    def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offsets of ``partitions`` (None where none is), asked for up to 10 s.

        Raises:
            BusError: the offsets did not come (a transaction that holds offsets of the group and is not ended
                keeps them from coming: Kafka answers only with stable offsets).
        """
        try:
            result = self._c.committed([to_tp(tp) for tp in partitions], timeout=10)
        except KafkaException as e:
            raise BusError(f"cannot read committed offsets of group {self.group}: {e}") from None
        return {TopicPartition(p.topic, p.partition): (p.offset if p.offset >= 0 else None) for p in result}

    def position(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        try:
            result = self._c.position([to_tp(tp) for tp in partitions])
        except KafkaException as e:
            raise BusError(f"cannot read the position of consumer {self.group}: {e}") from None
        return {TopicPartition(p.topic, p.partition): (p.offset if p.offset >= 0 else None) for p in result}

    def pause(self, partitions: list[TopicPartition]) -> None:
        self._paused |= set(partitions)
        owned = [to_tp(tp) for tp in partitions if tp in self._assigned]
        if owned:
            self._c.pause(owned)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self._paused -= set(partitions)
        owned = [to_tp(tp) for tp in partitions if tp in self._assigned]
        if owned:
            self._c.resume(owned)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._pending[tp] = offset
        self._apply_pending()

    def seek_to_beginning(self, partitions: list[TopicPartition] | None = None) -> None:
        if partitions is None and not self._assigned:
            self._on_assign_seek = ("beginning", 0)
            return
        for tp in partitions if partitions is not None else self.assignment():
            self._pending[tp] = OFFSET_BEGINNING
        self._apply_pending()

    def seek_to_timestamp(self, timestamp_ms: int, partitions: list[TopicPartition] | None = None) -> None:
        if partitions is None and not self._assigned:
            self._on_assign_seek = ("ts", timestamp_ms)
            return
        tps = partitions if partitions is not None else self.assignment()
        self._pending.update(self._offsets_for_time(tps, timestamp_ms))
        self._apply_pending()

    def _offsets_for_time(self, tps: list[TopicPartition], timestamp_ms: int) -> dict[TopicPartition, int]:
        result = self._c.offsets_for_times([to_tp(tp, timestamp_ms) for tp in tps], timeout=10)
        out = {}
        for p in result:
            tp = TopicPartition(p.topic, p.partition)
            # -1: no record at or after the time: start at the end.
            out[tp] = p.offset if p.offset >= 0 else self._c.get_watermark_offsets(to_tp(tp), timeout=10)[1]
        return out

    def lag(self) -> dict[TopicPartition, int]:
        tps = self.assignment()
        committed = self.committed(tps) if tps else {}
        out = {}
        for tp in tps:
            low, high = self._c.get_watermark_offsets(to_tp(tp), timeout=10, cached=False)
            out[tp] = high - (committed[tp] if committed.get(tp) is not None else low)
        return out

    def close(self) -> None:
        """Leave the group and release the client. A static member (``instance_id``), which sends no LeaveGroup
        at its close, is released without one (:meth:`_release`: a close can freeze the process). Others close,
        waiting up to :data:`CLOSE_TIMEOUT_S`: a close that has not returned by then is left to its daemon thread,
        with a warning, so that no shutdown waits on it."""
        if self._c is None:
            return
        if "group.instance.id" in self._conf:
            self._release()
            self._assigned.clear()
            self._paused.clear()
            return
        try:
            bounded(f"close-{self.name}", self._c.close, CLOSE_TIMEOUT_S)
        except StillRunning:
            log.warning("kafka consumer %s: its close has not returned in %.0f s; left behind (its partitions move "
                        "when its session times out)", self.name, CLOSE_TIMEOUT_S)
