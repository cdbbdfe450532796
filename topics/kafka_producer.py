"""The Kafka producer of the bus API (:class:`KafkaProducer`), through confluent-kafka."""
from __future__ import annotations

import functools
import logging
import time
from typing import Mapping

from confluent_kafka import (
    KafkaException,
    Producer as _Producer,
)

from topics.bus import (
    BusError,
    DeliveryError,
    Producer,
)
from topics.kafka_consumer import KafkaConsumer
from topics.kafka_client import (
    MAX_MESSAGE_BYTES,
    TXN_GRACE_S,
    Reporter,
    StillRunning,
    bounded,
    broker_answers,
    kafka_headers,
    to_tp,
    txn_error,
)

log = logging.getLogger(__name__)


class KafkaProducer(Producer):
    """A confluent-kafka producer (idempotent, ``acks=all``); transactional with ``transactional_id``.
    ``security``: librdkafka security properties (:meth:`topics.kafka_security.KafkaSecurity.librdkafka`).

    A plain producer keeps each record until its delivery report. When records have stayed unacknowledged for
    :attr:`stuck_s` seconds with no delivery report at all while the broker answers a metadata request, the
    producer is stuck (after a broker restart an idempotent producer can keep its records forever: librdkafka
    #3009): :meth:`flush` replaces the librdkafka producer in place and sends
    the unacknowledged records again through the new one (:meth:`renew`), so nothing is lost and the component is
    not restarted. A record the old producer had delivered without its report arriving is then written twice:
    the topics a plain producer writes are read at least once, by key (trajectory groups, announcements, metrics).

    Attributes:
        renewals: how many times the producer was replaced.
        stuck_s: seconds without a delivery report, records waiting and the broker answering, before a
            :meth:`flush` replaces the producer.
    """

    #: Default of :attr:`stuck_s`: longer than any delivery after a broker restart seen here (~30 s).
    STUCK_S = 60.0

    def __init__(self, bootstrap: str, transactional_id: str | None = None, security: Mapping[str, str] = {}):
        conf = {
            **Reporter(f"producer {transactional_id or ''}".strip()).conf(), **security,
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "compression.type": "none",
            "message.max.bytes": MAX_MESSAGE_BYTES,
            "queue.buffering.max.kbytes": 1 << 20,
        }
        if transactional_id:
            conf["transactional.id"] = transactional_id
        self._conf = conf
        self._p = _Producer(conf)
        self._wedged: str | None = None  # a transactional call that never returned: the producer is unusable
        self._failures: list[tuple[str, bytes | None, str]] = []
        self._transactional = bool(transactional_id)
        self.renewals, self.stuck_s = 0, self.STUCK_S
        # a plain producer's records not yet reported on: sequence number -> (topic, value, key, headers, partition)
        self._unacked: dict[int, tuple] = {}
        self._sequence = 0
        self._generation = 0  # reports from a replaced producer are ignored
        self._last_report = time.monotonic()
        if self._transactional:
            try:
                self._p.init_transactions(30)
            except KafkaException as e:
                raise txn_error(f"cannot initialise transactions for {transactional_id!r} on {bootstrap}", e) from None

    def _on_delivery(self, generation: int, sequence: int | None, err, msg) -> None:
        if generation != self._generation:
            return  # a replaced producer's report: its record was sent again
        self._last_report = time.monotonic()
        if sequence is not None:
            self._unacked.pop(sequence, None)
        if err is not None:
            self._failures.append((msg.topic(), msg.key(), str(err)))

    def send(self, topic, value, key=None, headers=None, partition=None) -> None:
        key = key.encode() if isinstance(key, str) else key
        sequence = None
        if not self._transactional:
            sequence, self._sequence = self._sequence, self._sequence + 1
            if not self._unacked:
                self._last_report = time.monotonic()  # waiting starts with the first record in flight
            self._unacked[sequence] = (topic, value, key, headers, partition)
        self._produce(topic, value, key, headers, partition, sequence)

    def _produce(self, topic, value, key, headers, partition, sequence: int | None) -> None:
        kwargs = {"on_delivery": functools.partial(self._on_delivery, self._generation, sequence),
                  "headers": kafka_headers(headers)}
        if partition is not None:
            kwargs["partition"] = partition
        for _ in range(600):
            try:
                self._p.produce(topic, value, key, **kwargs)
                break
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._p.poll(0.1)
            except KafkaException as e:
                raise BusError(f"cannot send to {topic}: {e}") from None
        else:
            raise BusError(f"cannot send to {topic}: the producer queue stayed full for 60 s")
        self._p.poll(0)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait up to ``timeout_s`` for every record's delivery report; replace a stuck producer (class docstring).

        Raises:
            DeliveryError: records were refused or timed out.
            BusError: records are still unacknowledged (a stuck producer is replaced first, its records sent
                again: the next flush waits for them).
        """
        left = self._p.flush(timeout_s)
        self._raise_failures()
        if left:
            waited = time.monotonic() - self._last_report
            if not self._transactional and waited >= self.stuck_s and broker_answers(self._p):
                self.renew(f"{left} record(s) unacknowledged and no delivery report for {waited:.0f} s while the "
                           f"broker answers")
            raise BusError(f"{left} record(s) still unacknowledged after {timeout_s} s")

    def renew(self, why: str) -> None:
        """Replace the librdkafka producer with a new one and send every unacknowledged record again through it,
        in the order they were first sent (a plain producer only).

        Raises:
            ValueError: the producer is transactional (a new one with its ``transactional.id`` fences this one).
        """
        if self._transactional:
            raise ValueError("a transactional producer is renewed by a new producer with its transactional.id")
        old, self._generation = self._p, self._generation + 1
        old.purge(in_queue=True, in_flight=True, blocking=False)
        old.poll(0)
        self._p = _Producer(self._conf)
        self.renewals += 1
        self._last_report = time.monotonic()
        log.warning("producer: %s; replaced it (renewal %d), sending %d record(s) again", why, self.renewals,
                    len(self._unacked))
        for sequence, (topic, value, key, headers, partition) in sorted(self._unacked.items()):
            self._produce(topic, value, key, headers, partition, sequence)

    def _raise_failures(self) -> None:
        if self._failures:
            failures, self._failures = self._failures, []
            raise DeliveryError(failures)

    def begin_transaction(self) -> None:
        self._check_wedged()
        try:
            self._p.begin_transaction()
        except KafkaException as e:
            raise txn_error("cannot begin a transaction", e) from None

    def commit_transaction(self, consumer=None, offsets=None, timeout_s: float = 30.0) -> None:
        """Per librdkafka's transactional API: a call that fails with a retriable error (a timeout) is made
        again until ``timeout_s`` has passed; one whose error requires an abort is aborted. A commit still
        failing retriably at the deadline is in doubt (it may yet complete, and an abort would conflict with
        it): a :class:`BusError` says so and the producer is left to be replaced (a new producer with this
        ``transactional.id`` completes or aborts the transaction; the group's committed offsets then tell
        which). The calls run on a helper thread (:func:`_bounded`): past ``timeout_s`` + ``TXN_GRACE_S`` the
        producer is wedged, the transaction is in doubt too, and every later transactional call raises at once.
        """
        self._check_wedged()
        deadline = time.monotonic() + timeout_s

        def retried(call):
            while True:
                try:
                    return call(max(0.1, deadline - time.monotonic()))
                except KafkaException as e:
                    if not e.args[0].retriable() or time.monotonic() >= deadline:
                        raise

        def commit() -> None:
            if consumer is not None and offsets:
                assert isinstance(consumer, KafkaConsumer), "offsets must come from a Kafka consumer"
                tps, group = [to_tp(tp, off) for tp, off in offsets.items()], consumer.group_metadata()
                retried(lambda left: self._p.send_offsets_to_transaction(tps, group, left))
            retried(self._p.commit_transaction)

        try:
            bounded("commit-transaction", commit, timeout_s + TXN_GRACE_S)
            self._raise_failures()
        except StillRunning:
            self._wedged = (f"a transaction's commit has not returned in {timeout_s + TXN_GRACE_S:.0f} s (librdkafka "
                            f"#5456: a coordinator request that outlives its timeout)")
            raise BusError(f"transaction in doubt: {self._wedged}; a new producer with this transactional.id "
                           f"settles it") from None
        except KafkaException as e:
            err = e.args[0]
            if err.fatal():
                raise txn_error("transaction failed", e) from None
            if err.retriable():
                raise BusError(f"transaction in doubt: still failing after {timeout_s:.0f} s ({err}); a new producer "
                               f"with this transactional.id settles it") from None
            try:
                self.abort_transaction(timeout_s)
            except BusError as abort_error:
                raise BusError(f"transaction failed ({err}) and so did its abort ({abort_error}): in doubt; a new "
                               f"producer with this transactional.id settles it") from None
            raise BusError(f"transaction aborted: {err}") from None

    def _check_wedged(self) -> None:
        if self._wedged:
            raise BusError(f"this producer is given up: {self._wedged}")

    def abort_transaction(self, timeout_s: float = 30.0) -> None:
        self._check_wedged()
        try:
            self._p.abort_transaction(timeout_s)
        except KafkaException as e:
            raise txn_error("cannot abort the transaction", e) from None
        finally:
            self._failures.clear()

    def close(self) -> None:
        if not self._transactional:
            self.flush()
