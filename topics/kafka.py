"""The Kafka backend of the bus API, through confluent-kafka (librdkafka).

Every client failure (a ``KafkaException``, or an admin request with no answer)
surfaces as :class:`topics.bus.BusError`; librdkafka's own error log is routed
through one line per condition (:class:`_Reporter`).

Records carry already-compressed values (zstd, see :mod:`topics.codec`), so the
producer does not compress again. Producers are idempotent with ``acks=all``.
Consumers never auto-commit: offsets are committed explicitly, after the work
is durable. A static group member that the coordinator fences (as happens after a
broker restart) is re-created in place, not given up (:meth:`KafkaConsumer._renew`), and so is a member stuck
after one: no coordinator for its commits, or left out of its group, while the cluster answers (its own client, or
another one when its own gets no answer: :meth:`KafkaConsumer._cluster_answers`); so is a plain (not
transactional) producer whose records stay unacknowledged while the broker answers (:meth:`KafkaProducer.flush`).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from typing import Callable, Iterable, Mapping, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer as _Consumer,
    KafkaError,
    KafkaException,
    Producer as _Producer,
    TopicPartition as _TP,
)
from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    NewTopic,
)

from topics.bus import (
    Admin,
    Bus,
    BusError,
    Consumer,
    DeliveryError,
    FatalBusError,
    Headers,
    Producer,
    Record,
    TopicInfo,
    TopicPartition,
    offsets_after,
)
from topics.kafka_groups import GroupDescriber
from topics.kafka_security import KafkaSecurity

log = logging.getLogger(__name__)

#: Largest record value we produce or accept on our topics (bytes).
MAX_MESSAGE_BYTES = 64 << 20
_INVALID_OFFSET = -1001


class _Reporter:
    """librdkafka's client errors as one log line per condition, not a line per reconnect attempt.

    Installed as ``error_cb`` with librdkafka's own logging at critical only (``log_level`` 2):
    the first error of each code is logged as a warning, then at most one per ``every_s``
    seconds with the count of repeats. The errors stay visible to callers as :class:`BusError`.
    """

    def __init__(self, client: str, every_s: float = 30.0):
        self.client, self.every_s = client, every_s
        self._seen: dict[int, tuple[float, int]] = {}  # code -> (last logged, repeats since)
        self.last: str | None = None  # the newest error's text, for the message of a failure it explains
        self.quiet = False  # record only: the caller reports the failure itself

    def __call__(self, err: KafkaError) -> None:
        self.last = err.str()
        if self.quiet:
            return
        now = time.monotonic()
        last, repeats = self._seen.get(err.code(), (None, 0))
        if last is not None and now - last < self.every_s:
            self._seen[err.code()] = (last, repeats + 1)
            return
        self._seen[err.code()] = (now, 0)
        more = f" ({repeats} more like it in the last {self.every_s:.0f} s)" if repeats else ""
        log.warning("kafka %s: %s%s", self.client, err.str(), more)

    def conf(self) -> dict:
        """The client config entries that route errors here."""
        return {"error_cb": self, "log_level": 2}


def _tp(tp: TopicPartition, offset: int = _INVALID_OFFSET) -> _TP:
    return _TP(tp[0], tp[1], offset)


def _headers(headers: Headers | None) -> list[tuple[str, bytes]] | None:
    if not headers:
        return None
    return [(k, v.encode() if isinstance(v, str) else bytes(v)) for k, v in headers.items()]


def _txn_error(what: str, e: KafkaException) -> BusError:
    """``what: e`` as a :class:`FatalBusError` when librdkafka says the producer is unusable (e.g. fenced
    by a newer instance with the same ``transactional.id``), else as a (retriable) :class:`BusError`."""
    err = e.args[0]
    return (FatalBusError if err.fatal() else BusError)(f"{what}: {err}")


T = TypeVar("T")


class _StillRunning(Exception):
    """A :func:`_bounded` call had not returned at its bound (its thread is left behind, blocked)."""


def _bounded(name: str, fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` on a daemon thread named ``name``, waited for ``timeout_s`` seconds, for librdkafka calls that can
    block past any timeout of their own: a synchronous consumer commit has none, and a transactional producer's
    ``send_offsets_to_transaction`` waits for ever on a group coordinator that went down during the call, even
    once the broker is back (librdkafka #5456).

    Returns:
        What ``fn`` returned; what it raised is raised.

    Raises:
        _StillRunning: ``fn`` had not returned after ``timeout_s`` seconds; the client it uses must be given up.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _StillRunning(name)
    if "error" in box:
        raise box["error"]
    return box.get("result")


#: seconds past its deadline that a transaction's commit may take before its producer is given up as wedged
TXN_GRACE_S = 10.0


def _broker_answers(client: _Producer | _Consumer) -> bool:
    """Whether the broker answers ``client``'s metadata request within 5 s (a client that gets no acknowledgement
    or no coordinator while the broker answers is stuck, not waiting out an outage)."""
    try:
        client.list_topics(timeout=5)
        return True
    except KafkaException:
        return False


_describers: dict[tuple, GroupDescriber] = {}  # one per cluster and credentials, for the clients of a process
_describers_lock = threading.Lock()


def _group_members(client: Mapping[str, str], group: str) -> dict[str, list[TopicPartition]]:
    """:meth:`topics.kafka_groups.GroupDescriber.members` through one helper process per cluster for the whole
    process (its admin clients and consumers ask one at a time).

    Raises:
        BusError: the cluster did not answer, or the helper died (it is started afresh on the next call).
    """
    key = tuple(sorted(client.items()))
    with _describers_lock:
        describer = _describers.get(key)
        if describer is None:
            describer = _describers[key] = GroupDescriber(client)
        return describer.members(group)


def _check_result(what: str, result: Iterable[_TP]) -> None:
    for tp in result:
        if tp.error is not None:
            raise BusError(f"{what} failed for {tp.topic}[{tp.partition}]: {tp.error}")


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
            **_Reporter(f"producer {transactional_id or ''}".strip()).conf(), **security,
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
                raise _txn_error(f"cannot initialise transactions for {transactional_id!r} on {bootstrap}", e) from None

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
                  "headers": _headers(headers)}
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
            if not self._transactional and waited >= self.stuck_s and _broker_answers(self._p):
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
            raise _txn_error("cannot begin a transaction", e) from None

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
                tps, group = [_tp(tp, off) for tp, off in offsets.items()], consumer._c.consumer_group_metadata()
                retried(lambda left: self._p.send_offsets_to_transaction(tps, group, left))
            retried(self._p.commit_transaction)

        try:
            _bounded("commit-transaction", commit, timeout_s + TXN_GRACE_S)
            self._raise_failures()
        except _StillRunning:
            self._wedged = (f"a transaction's commit has not returned in {timeout_s + TXN_GRACE_S:.0f} s (librdkafka "
                            f"#5456: a coordinator request that outlives its timeout)")
            raise BusError(f"transaction in doubt: {self._wedged}; a new producer with this transactional.id "
                           f"settles it") from None
        except KafkaException as e:
            err = e.args[0]
            if err.fatal():
                raise _txn_error("transaction failed", e) from None
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
            raise _txn_error("cannot abort the transaction", e) from None
        finally:
            self._failures.clear()

    def close(self) -> None:
        if not self._transactional:
            self.flush()


#: Seconds a consumer's close may take before it is left behind (:meth:`KafkaConsumer.close`).
CLOSE_TIMEOUT_S = 30.0
#: Seconds the release of a replaced or closed static member's librdkafka consumer may take
#: (:meth:`KafkaConsumer._release`).
RELEASE_TIMEOUT_S = 10.0
#: Seconds a consumer's offset commit may take before the consumer is given up (see :meth:`KafkaConsumer.commit`).
COMMIT_TIMEOUT_S = 60.0
#: seconds a group member's commits may be refused for want of a coordinator, the broker answering, before the
#: member is re-created (:meth:`KafkaConsumer._coordinator_lost`)
NO_COORDINATOR_RENEW_S = 60.0
#: seconds a subscribed group member may read nothing, the broker answering, before it asks the group whether it is a
#: member, and whether any member owns its topics' partitions (:meth:`KafkaConsumer._left_out`)
QUIET_RENEW_S = 60.0


class _Fenced(Exception):
    """A group member's commit was fenced, or never returned: its librdkafka consumer must be re-created."""


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
        self._conf = {**static, **_Reporter(f"consumer {self.name}".strip()).conf(), **security,
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
        self._early: list[Record] = []  # read while a renewed consumer joined its group (_renew): the next poll's
        #: times this consumer was fenced and re-created in place (:meth:`_renew`)
        self.renewals = 0
        self._no_coordinator_since: float | None = None  # the first of the consecutive commits refused for want of
        # a group coordinator (_WAIT_COORD)
        self._client = {**security, "bootstrap.servers": bootstrap}  # for the group's description (_left_out)
        self._quiet: tuple[float, float] | None = None  # (since, last asked the group) while polls return nothing

    # membership
    def subscribe(self, topics: list[str]) -> None:
        self._subscribed = list(topics)
        self._c.subscribe(topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                          on_lost=self._on_revoke)

    def _fenced(self, err: KafkaError) -> bool:
        """Whether ``err`` says this group member was fenced (a fatal consumer error: librdkafka's only one is
        FENCED_INSTANCE_ID, a static member whose ``group.instance.id`` the coordinator mapped to a newer member
        id), and the member can be re-created in place (:meth:`_renew`): it subscribed."""
        return bool(self._subscribed) and (err.fatal() or err.code() in (KafkaError._FATAL,
                                                                         KafkaError.FENCED_INSTANCE_ID))

    def _renew(self, why: str) -> None:
        """Re-create the fenced librdkafka consumer in place: same config (the same ``group.instance.id``, so the
        coordinator hands it the old member's place), same subscription; its partitions restart from the group's
        committed offsets, so what was read and not committed is read again (consumers de-duplicate by id).

        A static member is fenced by the coordinator when it asks with a member id the coordinator no longer
        maps to its ``group.instance.id``. Seen after a broker restart (the data directory, and with it the
        group's static member, survives it): a member whose session expired while the broker came back rejoins
        and gets a new member id, while a commit made before the rejoin is served still carries the old one
        (``OffsetCommit failed: Broker: Static consumer fenced by other consumer with same group.instance.id``).
        librdkafka makes that error fatal for the whole consumer; no other member has this id, so re-joining is
        safe. The old consumer is released, not closed (:meth:`_release`); the coordinator hands its place to the
        new member."""
        self.renewals += 1
        log.warning("kafka consumer %s: %s; re-creating it in place (group %s, the same group.instance.id); it "
                    "resumes from the group's committed offsets", self.name, why, self.group)
        self._release()
        self._on_revoke(None, [_tp(tp) for tp in self._assigned])
        self._quiet = None
        self._c = _Consumer(self._conf)
        self.subscribe(self._subscribed)

    def _release(self) -> None:
        """Destroy the librdkafka consumer without its consumer close (librdkafka's
        ``RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE``, what confluent-kafka does to a consumer it frees), on a helper
        thread waited for :data:`RELEASE_TIMEOUT_S`. A close runs the revoke through confluent-kafka's rebalance
        callback, which calls ``rd_kafka_rebalance_protocol`` and ``rd_kafka_assign`` holding the interpreter lock,
        and those can wait for ever on a consumer being closed (librdkafka #4041, #4884), freezing the whole process
        (no thread of it runs again, not even its watch on the launcher). A static member sends no LeaveGroup at its
        close anyway, and commits are manual, so nothing is lost: the coordinator gives its place to the next member
        with its ``group.instance.id``, or moves its partitions when its session times out. A call still running on
        it (a commit that never returned) keeps it alive until that call returns."""
        box, self._c = [self._c], None  # the helper thread drops the last reference: the free runs there
        try:
            _bounded(f"release-{self.name}", box.clear, RELEASE_TIMEOUT_S)
        except _StillRunning:
            log.warning("kafka consumer %s: its librdkafka client was not freed in %.0f s; left behind", self.name,
                        RELEASE_TIMEOUT_S)

    def _join(self, timeout_s: float) -> None:
        """Poll a renewed consumer until the group has assigned it partitions, or ``timeout_s`` has passed; the
        records read meanwhile are kept for the next :meth:`poll`."""
        deadline = time.monotonic() + timeout_s
        while not self._assigned and time.monotonic() < deadline:
            self._early += self._consume(500, 0.2)

    def _on_assign(self, consumer, partitions: list[_TP]) -> None:
        tps = [TopicPartition(p.topic, p.partition) for p in partitions]
        self._resolve_default_seek(tps)
        for p, tp in zip(partitions, tps):
            if tp in self._pending:
                p.offset = self._pending.pop(tp)
        consumer.assign(partitions)
        self._assigned = set(tps)
        if self._paused & self._assigned:
            consumer.pause([_tp(tp) for tp in self._paused & self._assigned])
        if self._assigned - self._paused:  # librdkafka keeps a partition's pause flag across revoke and assign
            consumer.resume([_tp(tp) for tp in self._assigned - self._paused])

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
        start = _INVALID_OFFSET if self.group is not None else OFFSET_BEGINNING
        self._c.assign([_tp(tp, self._pending.pop(tp, start)) for tp in partitions])
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
        if self._early:
            out, self._early = self._early[:max_records], self._early[max_records:]
            return out
        return self._consume(max_records, timeout_s)

    def _consume(self, max_records: int, timeout_s: float) -> list[Record]:
        """:meth:`poll` from librdkafka. A fenced member is re-created (:meth:`_renew`) and returns nothing: what it
        had read and not committed comes again to the new member."""
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
                    if self._fenced(err):
                        self._renew(f"fenced while reading ({err.str()})")
                        return []
                    if err.fatal() or err.code() == KafkaError._FATAL:
                        raise FatalBusError(f"consume failed: {err}")
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
        if out:
            self._quiet = None
        elif self._left_out():
            self._renew(f"nothing read for {QUIET_RENEW_S:.0f} s while the broker answers, and the group has it as no "
                        "member, or has given no member a partition of its topics")
        return out

    def _left_out(self) -> bool:
        """Whether this subscribed member has read nothing for :data:`QUIET_RENEW_S` seconds while the broker answers
        and its topics exist, and the group (described through :mod:`topics.kafka_groups`, at most every quarter of
        that) either has no member that is this one, or has this one holding no partition and no other member
        owning one of its topics. Both seen after a broker restart: a RaaS worker whose librdkafka consumer never
        rejoined its group (the group empty, the worker polling its old partitions for minutes), and a filter
        processor that never got partitions again (240 s, until its supervisor restarted the process), while a new
        member got them at once. A member that is caught up, or idle because the group has more members than
        partitions, is a member: it is left alone."""
        if not self._subscribed or self.group is None:
            return False
        now = time.monotonic()
        since, asked = self._quiet or (now, 0.0)
        self._quiet = (since, asked)
        if now - since < QUIET_RENEW_S or now - asked < QUIET_RENEW_S / 4:
            return False
        self._quiet = (since, now)
        try:
            topics = self._c.list_topics(timeout=5).topics
        except KafkaException:
            return self._cluster_answers(f"nothing read for {now - since:.0f} s")
        if not any(topics.get(t) is not None and topics[t].partitions for t in self._subscribed):
            return False  # nothing to assign yet
        try:
            members = _group_members(self._client, self.group)
        except BusError as e:
            log.warning("kafka consumer %s: nothing read for %.0f s; cannot describe group %s: %s", self.name,
                        now - since, self.group, e)
            return False
        mine, me = self._conf.get("group.instance.id"), self._c.memberid()
        others, ours = [], False
        for member, parts in members.items():
            instance, _, member_id = member.partition(" ")
            if (mine is not None and instance == mine) or (me and member_id == me):
                ours = True
            else:
                others.append(parts)
        if not ours:
            return True
        return not self._assigned and not any(tp.topic in self._subscribed for parts in others for tp in parts)

    def _apply_pending(self) -> None:
        for tp in [tp for tp in self._pending if tp in self._assigned]:
            try:
                self._c.seek(_tp(tp, self._pending[tp]))
                del self._pending[tp]
            except KafkaException:
                pass  # not fetchable yet right after assignment; retried on the next poll

    def commit(self, offsets, timeout_s: float = COMMIT_TIMEOUT_S) -> None:
        """Commit ``offsets`` synchronously, within ``timeout_s`` seconds. A group member fenced at the commit, whose
        commit does not return, or whose commits find no group coordinator for :data:`NO_COORDINATOR_RENEW_S` while
        the broker answers (each seen after a broker restart) is re-created in place (:meth:`_renew`);
        once the group has given it back partitions, the offsets of those partitions are committed by the new member
        and it reads on from them.

        A re-created member starts at ``offsets`` whether or not its commit then goes through: a commit that fails
        then raises, and a retry commits the same offsets (a new process would start from the group's commits).

        Raises:
            BusError: the commit was refused, or the re-created member was given no partition of ``offsets`` in
                ``timeout_s``. FatalBusError: the consumer is unusable and is not a group member that can be
                re-created.
        """
        if not isinstance(offsets, Mapping):
            offsets = offsets_after(offsets)
        if not offsets:
            return
        try:
            self._commit(offsets, timeout_s)
            return
        except _Fenced as fenced:
            self._renew(str(fenced))
        # Done up to there: the new member starts there, not at the old commit. Given to librdkafka with the
        # assignment (:meth:`_on_assign`), not sought after it: a seek made while the assignment's own fetch of the
        # committed offsets is in flight is undone by its answer (the partition would be read again from the old
        # commit).
        self._pending.update(offsets)
        self._join(timeout_s)
        owned = {tp: off for tp, off in offsets.items() if tp in self._assigned}
        for tp in offsets.keys() - owned.keys():
            self._pending.pop(tp, None)  # another member owns it now and reads on from the group's commits
        if not owned:
            raise BusError(f"commit not made: the re-created member of group {self.group} owns none of "
                           f"{sorted(offsets)} after {timeout_s:.0f} s")
        try:
            self._commit(owned, timeout_s)
        except _Fenced as fenced:
            raise FatalBusError(f"{fenced}, again right after it was re-created") from None

    def _commit(self, offsets: Mapping[TopicPartition, int], timeout_s: float) -> None:
        # librdkafka's synchronous commit has no timeout, and one made as the broker stops can wait forever,
        # even after the broker is back (seen: a trainer blocked in rd_kafka_commit_queue for minutes).
        try:
            result = _bounded(f"commit-{self.group}", lambda: self._c.commit(
                offsets=[_tp(tp, off) for tp, off in offsets.items()], asynchronous=False), timeout_s)
        except _StillRunning:
            if self._subscribed:
                raise _Fenced(f"a commit did not complete in {timeout_s:.0f} s") from None
            raise FatalBusError(f"commit for group {self.group} did not complete in {timeout_s:.0f} s; this consumer "
                                "is given up") from None
        except KafkaException as e:
            err = e.args[0]
            if self._fenced(err):
                raise _Fenced(f"fenced at a commit ({err.str()})") from None
            if self._coordinator_lost(err):
                raise _Fenced(f"no group coordinator for its commits for {NO_COORDINATOR_RENEW_S:.0f} s while the "
                              "broker answers") from None
            kind = FatalBusError if err.fatal() or err.code() == KafkaError._FATAL else BusError
            raise kind(f"commit refused for group {self.group}: {e}") from None
        self._no_coordinator_since = None
        _check_result("commit", result or [])

    def _coordinator_lost(self, err: KafkaError, codes: tuple[int, ...] = (KafkaError._WAIT_COORD,)) -> bool:
        """Whether a subscribed member's requests to its group coordinator have failed with ``codes`` (default: no
        coordinator, ``_WAIT_COORD``) for :data:`NO_COORDINATOR_RENEW_S` seconds while the broker answers a
        metadata request: seen once after a broker restart, a member that never found its coordinator again (180 s
        of refused commits, while a new member found it at once), so it is re-created (:meth:`_renew`)."""
        if err.code() not in codes or not self._subscribed:
            self._no_coordinator_since = None
            return False
        now = time.monotonic()
        self._no_coordinator_since = self._no_coordinator_since or now
        if now - self._no_coordinator_since < NO_COORDINATOR_RENEW_S:
            return False
        if not _broker_answers(self._c) and not self._cluster_answers(
                f"no group coordinator for {now - self._no_coordinator_since:.0f} s"):
            return False  # the broker is down: waiting for it is all there is to do
        self._no_coordinator_since = None
        return True

    def _cluster_answers(self, why: str) -> bool:
        """Whether the cluster answers another client (the group's description through the helper process of
        :mod:`topics.kafka_groups`, a client of its own) while this member's librdkafka client, ``why``, gets no
        answer to its own metadata request: then that client is stuck, not waiting out an outage. Seen in CI after
        a broker restart: a trainer whose commits found no coordinator and a filter processor given no partition,
        each for minutes, while every other client of the run went on, and neither was re-created: the one test
        their two ways to a re-creation share was the client's own metadata request."""
        try:
            _group_members(self._client, self.group)
        except BusError as e:
            log.warning("kafka consumer %s: %s, its metadata request is not answered, and the group's description "
                        "neither (%s): waiting for the broker", self.name, why, e)
            return False
        log.warning("kafka consumer %s: %s and its metadata request is not answered, while the cluster answers "
                    "another client: its client is stuck", self.name, why)
        return True

    def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offsets of ``partitions`` (None where none is), asked for up to 10 s. A subscribed
        member whose asks have found no coordinator or timed out for :data:`NO_COORDINATOR_RENEW_S` while the
        broker answers is re-created in place (:meth:`_renew`; it owns no partition until it has joined again)
        and asks once more: after a broker restart a member's asks can keep timing out while the broker serves
        every other client.

        Raises:
            BusError: the offsets did not come (a transaction that holds offsets of the group and is not ended
                keeps them from coming: Kafka answers only with stable offsets).
        """
        try:
            return self._committed(partitions)
        except KafkaException as e:
            if not self._coordinator_lost(e.args[0], (KafkaError._WAIT_COORD, KafkaError._TIMED_OUT)):
                raise BusError(f"cannot read committed offsets of group {self.group}: {e}") from None
        self._renew(f"its asks for committed offsets found no coordinator or timed out for "
                    f"{NO_COORDINATOR_RENEW_S:.0f} s while the broker answers")
        try:
            return self._committed(partitions)
        except KafkaException as e:
            raise BusError(f"cannot read committed offsets of group {self.group}, re-created: {e}") from None

    def _committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        result = self._c.committed([_tp(tp) for tp in partitions], timeout=10)
        self._no_coordinator_since = None
        return {TopicPartition(p.topic, p.partition): (p.offset if p.offset >= 0 else None) for p in result}

    def position(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        try:
            result = self._c.position([_tp(tp) for tp in partitions])
        except KafkaException as e:
            raise BusError(f"cannot read the position of consumer {self.group}: {e}") from None
        return {TopicPartition(p.topic, p.partition): (p.offset if p.offset >= 0 else None) for p in result}

    def pause(self, partitions: list[TopicPartition]) -> None:
        self._paused |= set(partitions)
        owned = [_tp(tp) for tp in partitions if tp in self._assigned]
        if owned:
            self._c.pause(owned)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self._paused -= set(partitions)
        owned = [_tp(tp) for tp in partitions if tp in self._assigned]
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
        result = self._c.offsets_for_times([_tp(tp, timestamp_ms) for tp in tps], timeout=10)
        out = {}
        for p in result:
            tp = TopicPartition(p.topic, p.partition)
            # -1: no record at or after the time: start at the end.
            out[tp] = p.offset if p.offset >= 0 else self._c.get_watermark_offsets(_tp(tp), timeout=10)[1]
        return out

    def lag(self) -> dict[TopicPartition, int]:
        tps = self.assignment()
        committed = self.committed(tps) if tps else {}
        out = {}
        for tp in tps:
            low, high = self._c.get_watermark_offsets(_tp(tp), timeout=10, cached=False)
            out[tp] = high - (committed[tp] if committed.get(tp) is not None else low)
        return out

    def close(self) -> None:
        """Leave the group and release the client. A static member (``instance_id``), which sends no LeaveGroup
        at its close, is released without one (:meth:`_release`: a close can freeze the process). Others close,
        waiting up to :data:`CLOSE_TIMEOUT_S`: a close that has not returned by then is left to its daemon thread,
        with a warning, so that no shutdown waits on it (a member closed before it has polled can hold its close in
        the assignment callback)."""
        if self._c is None:
            return
        if "group.instance.id" in self._conf:
            self._release()
            self._assigned.clear()
            self._paused.clear()
            return
        try:
            _bounded(f"close-{self.name}", self._c.close, CLOSE_TIMEOUT_S)
        except _StillRunning:
            log.warning("kafka consumer %s: its close has not returned in %.0f s; left behind (its partitions move "
                        "when its session times out)", self.name, CLOSE_TIMEOUT_S)


class KafkaAdmin(Admin):
    """Topic administration through confluent-kafka's AdminClient; group offsets and watermarks through
    consumers; group membership through a helper process (:mod:`topics.kafka_groups`). ``security``:
    librdkafka security properties (:meth:`topics.kafka_security.KafkaSecurity.librdkafka`).

    Raises:
        BusError: no broker answered within ``connect_timeout_s`` (unreachable, or refusing the credentials).
    """

    def __init__(self, bootstrap: str, connect_timeout_s: float = 10.0, security: Mapping[str, str] = {}):
        # an unreachable broker is reported once, by the BusError below, not by a librdkafka
        # "Connection refused" line per reconnect attempt on stderr
        self._client = {**security, "bootstrap.servers": bootstrap}
        reporter = _Reporter("admin")
        self._a = AdminClient({**self._client, **reporter.conf()})
        self._bootstrap = bootstrap
        self._watermark_reader: _Consumer | None = None
        self._offset_readers: dict[str, _Consumer] = {}  # group -> a consumer that only reads its offsets
        try:
            self._a.list_topics(timeout=connect_timeout_s)
        except KafkaException as e:
            reporter.quiet = True
            self._a.poll(0)  # serves the error callback: an authentication or TLS failure says so there
            why = reporter.last or e
            raise BusError(f"cannot reach Kafka at {bootstrap} within {connect_timeout_s:.0f} s ({why}); "
                           f"start a broker (scripts/kafka-local.sh start), fix bus=, or check the "
                           f"kafka.* security settings (protocol {self._client.get('security.protocol', 'plaintext')})") from None

    def _metadata(self, topic: str | None = None, timeout_s: float = 10.0) -> dict:
        """Topic name -> metadata (of ``topic`` only, when given).

        Raises:
            BusError: the cluster did not answer (e.g. the broker is down).
        """
        try:
            return self._a.list_topics(topic, timeout=timeout_s).topics
        except KafkaException as e:
            raise BusError(f"cannot read the metadata of {topic or 'the cluster'} from {self._bootstrap}: {e}") from None

    def create_topic(self, name, partitions=1, compacted=False, retention_ms=None, config=None) -> None:
        conf = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
        if compacted:
            conf["cleanup.policy"] = "compact"
        if retention_ms is not None:
            conf["retention.ms"] = str(retention_ms)
        conf.update({k: str(v) for k, v in (config or {}).items()})
        fut = self._a.create_topics([NewTopic(name, num_partitions=partitions, config=conf)])[name]
        try:
            fut.result(30)
        except TimeoutError:
            raise BusError(f"cannot create topic {name} on {self._bootstrap}: no answer in 30 s") from None
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise BusError(f"cannot create topic {name}: {e}") from None
        self._wait_for_leaders(name)

    def _wait_for_leaders(self, name: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            md = self._metadata(name).get(name)
            if md is not None and md.error is None and md.partitions and all(
                    p.leader >= 0 for p in md.partitions.values()):
                return
            time.sleep(0.1)
        raise BusError(f"topic {name} has no leader for every partition after {timeout_s} s")

    def describe_topic(self, name: str) -> TopicInfo:
        md = self._metadata(name).get(name)
        if md is None or md.error is not None:
            raise BusError(f"topic {name} does not exist on {self._bootstrap}")
        res = ConfigResource(ConfigResource.Type.TOPIC, name)
        try:
            entries = self._a.describe_configs([res])[res].result(30)
        except (KafkaException, TimeoutError) as e:
            raise BusError(f"cannot describe topic {name}: {e}") from None
        return TopicInfo(name, len(md.partitions), {k: str(v.value) for k, v in entries.items()})

    def list_topics(self) -> list[str]:
        return sorted(t for t in self._metadata() if not t.startswith("__"))

    def delete_topic(self, name: str) -> None:
        try:
            self._a.delete_topics([name])[name].result(30)
        except TimeoutError:
            raise BusError(f"cannot delete topic {name}: no answer in 30 s") from None
        except KafkaException as e:
            if e.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise BusError(f"cannot delete topic {name}: {e}") from None

    def _partitions(self, topic: str) -> list[int]:
        md = self._metadata(topic).get(topic)
        if md is None or md.error is not None:
            raise BusError(f"topic {topic} does not exist on {self._bootstrap}")
        return sorted(md.partitions)

    def _watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        """Per partition, (log start offset, log end offset), from the consumer API's watermark query.

        Not AdminClient.list_offsets: during a broker outage its request futures can trip a
        librdkafka assertion (``rd_kafka_enq_once_del_source_return``) that aborts the process. The reader
        is ``read_uncommitted``: the end is the log's end, past any open transaction (a ``read_committed``
        query answers the last stable offset instead, which an open transaction holds back).
        """
        if self._watermark_reader is None:
            self._watermark_reader = _Consumer({**self._client, **_Reporter("offsets").conf(),
                                                "group.id": f"astraflow-offsets-{uuid.uuid4().hex}",
                                                "isolation.level": "read_uncommitted",
                                                "enable.auto.commit": False})
        out = {}
        for p in self._partitions(topic):
            try:
                out[p] = self._watermark_reader.get_watermark_offsets(_TP(topic, p), timeout=30, cached=False)
            except KafkaException as e:
                raise BusError(f"cannot list offsets of {topic}[{p}]: {e}") from None
            if out[p] is None:
                raise BusError(f"cannot list offsets of {topic}[{p}]: no answer in 30 s")
        return out

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: high for p, (_, high) in self._watermarks(topic).items()}

    def start_offsets(self, topic: str) -> dict[int, int]:
        return {p: low for p, (low, _) in self._watermarks(topic).items()}

    def group_offsets(self, group: str, topic: str) -> dict[int, int | None]:
        parts = self._partitions(topic)
        # The consumer API's OffsetFetch, by a member of no group (it never subscribes), rather than the
        # AdminClient's request futures, which can crash the process across a broker outage.
        if group not in self._offset_readers:
            self._offset_readers[group] = _Consumer({**self._client, "group.id": group,
                                                     **_Reporter(f"offsets {group}").conf(),
                                                     "enable.auto.commit": False})
        try:
            res = self._offset_readers[group].committed([_TP(topic, p) for p in parts], timeout=30)
        except KafkaException as e:
            raise BusError(f"cannot read offsets of group {group}: {e}") from None
        return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in res}


    def group_members(self, group: str) -> dict[str, list[TopicPartition]]:
        """Through a helper process (:mod:`topics.kafka_groups`): librdkafka's DescribeGroups can abort the
        process across a broker outage. Raises BusError when the cluster does not answer."""
        return _group_members(self._client, group)

    def close(self) -> None:
        """Close the consumers that read watermarks and group offsets (none of them ever joined a group; a later
        read opens them again). The AdminClient has no close of its own: it is released with this object."""
        readers = [*self._offset_readers.values(), *([self._watermark_reader] if self._watermark_reader else [])]
        self._offset_readers, self._watermark_reader = {}, None
        for reader in readers:
            reader.close()


class KafkaBus(Bus):
    """The bus on an Apache Kafka cluster at ``bootstrap`` (``host:port[,host:port]``), every client
    authenticated and encrypted as ``security`` says (default: what the ``ASTRAFLOW_KAFKA_*`` environment
    variables say, else plaintext without authentication).

    Raises:
        pydantic.ValidationError: ``security`` is None and the ``ASTRAFLOW_KAFKA_*`` variables are inconsistent.
    """

    def __init__(self, bootstrap: str, security: KafkaSecurity | None = None):
        self.bootstrap = bootstrap
        self.url = f"kafka://{bootstrap}"
        self._security = (security or KafkaSecurity()).librdkafka()

    def producer(self, transactional_id: str | None = None) -> KafkaProducer:
        return KafkaProducer(self.bootstrap, transactional_id, security=self._security)

    def consumer(self, group, *, read_committed=True, session_timeout_s=10.0, client_id=None,
                 instance_id=None) -> KafkaConsumer:
        return KafkaConsumer(self.bootstrap, group, read_committed, session_timeout_s, client_id, instance_id,
                             security=self._security)

    def admin(self) -> KafkaAdmin:
        return KafkaAdmin(self.bootstrap, security=self._security)
