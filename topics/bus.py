"""The bus API: producer, consumer and admin, one interface for every backend.

``connect(url)`` picks the backend from the URL scheme:

- ``kafka://host:port[,host:port]`` — Apache Kafka through confluent-kafka
  (:mod:`topics.kafka`);
- ``local://PATH`` — the embedded single-machine bus, durable on disk and safe
  for several processes (:mod:`topics.local`).

Semantics follow Kafka's: partitions are ordered logs of records addressed by
offset; a consumer group splits a topic's partitions among its members; a
committed offset is the *next* offset to read; lag is the end offset minus the
committed offset.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, NamedTuple

if TYPE_CHECKING:
    from topics.kafka_security import KafkaSecurity


class TopicPartition(NamedTuple):
    """A partition of a topic."""

    topic: str
    partition: int


@dataclass(frozen=True)
class Record:
    """One consumed record. ``timestamp_ms`` is the producer's create time, milliseconds since the epoch."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes] = field(default_factory=dict)
    timestamp_ms: int = 0

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


@dataclass(frozen=True)
class TopicInfo:
    """A topic's partition count and configuration (``cleanup.policy``, ``retention.ms``, ...)."""

    name: str
    partitions: int
    config: dict[str, str]

    @property
    def compacted(self) -> bool:
        return "compact" in self.config.get("cleanup.policy", "")


class BusError(RuntimeError):
    """A bus operation failed (broker unreachable, unknown topic, bad URL, ...)."""


class FatalBusError(BusError):
    """A bus error that waiting cannot cure (e.g. a transactional producer fenced by a newer instance with
    the same id): the client is unusable; never retried in place (:mod:`topics.patience`)."""


class DeliveryError(BusError):
    """One or more produced records were not acknowledged; ``failures`` lists (topic, key, reason)."""

    def __init__(self, failures: list[tuple[str, bytes | None, str]]):
        self.failures = failures
        first = failures[0]
        super().__init__(f"{len(failures)} record(s) not delivered; first: topic {first[0]} key {first[1]!r}: {first[2]}")


Headers = Mapping[str, str | bytes]


def offsets_after(records: Iterable[Record]) -> dict[TopicPartition, int]:
    """The offsets to commit after processing ``records``: per partition, the highest offset + 1."""
    out: dict[TopicPartition, int] = {}
    for r in records:
        if r.offset + 1 > out.get(r.tp, -1):
            out[r.tp] = r.offset + 1
    return out


class Producer(abc.ABC):
    """Writes records. ``send`` is asynchronous; ``flush`` waits and surfaces delivery errors."""

    @abc.abstractmethod
    def send(self, topic: str, value: bytes | None, key: str | bytes | None = None,
             headers: Headers | None = None, partition: int | None = None) -> None:
        """Queue one record. Records with the same key go to the same partition.

        Raises:
            BusError: the record cannot be queued (unknown topic on the embedded bus, too large, ...).
        """

    @abc.abstractmethod
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued record is acknowledged.

        Raises:
            DeliveryError: some records failed since the last flush.
            BusError: not all records were acknowledged within ``timeout_s`` seconds.
        """

    # Transactions: exactly-once consume-transform-produce on Kafka; on the
    # embedded bus they are at-least-once (commit = flush, then commit offsets).
    @abc.abstractmethod
    def begin_transaction(self) -> None:
        """Start a transaction (needs ``transactional_id`` at creation)."""

    @abc.abstractmethod
    def commit_transaction(self, consumer: "Consumer | None" = None,
                           offsets: Mapping[TopicPartition, int] | None = None,
                           timeout_s: float = 30.0) -> None:
        """Commit the transaction, atomically with ``consumer``'s group ``offsets`` when given.

        Raises:
            BusError: the commit failed: the transaction was aborted and its records are not visible, or (the
                message says "in doubt") its outcome is unknown until a new producer with the same
                ``transactional_id`` settles it; the group's committed offsets then tell whether it committed.
        """

    @abc.abstractmethod
    def abort_transaction(self, timeout_s: float = 30.0) -> None:
        """Abort the open transaction: none of its records become visible to ``read_committed`` readers."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release resources."""


class Consumer(abc.ABC):
    """A member of a consumer group (or, with ``group=None``, a free reader of assigned partitions)."""

    group: str | None

    @abc.abstractmethod
    def subscribe(self, topics: list[str]) -> None:
        """Join the group on ``topics``; partitions are assigned and rebalanced as members come and go."""

    @abc.abstractmethod
    def assign(self, partitions: list[TopicPartition]) -> None:
        """Read exactly ``partitions``, outside any group rebalance."""

    @abc.abstractmethod
    def assignment(self) -> list[TopicPartition]:
        """The partitions this member currently owns."""

    @abc.abstractmethod
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Return up to ``max_records`` records, waiting at most ``timeout_s`` seconds for the first.

        Starts at the committed offset of each partition, or at the beginning
        when none is committed. Also drives membership (heartbeats, rebalance).
        """

    @abc.abstractmethod
    def commit(self, offsets: Mapping[TopicPartition, int] | Iterable[Record]) -> None:
        """Commit synchronously. Given records, commits per partition the highest offset + 1.

        Raises:
            BusError: the commit was refused (for example this member lost the partition).
        """

    def commit_async(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit ``offsets`` without waiting for the broker's answer: a later commit supersedes one that has not
        landed, and one that fails is dropped (the next carries the same or later offsets). For commits that signal
        progress and are not the durability point of the work: a trainer's (its checkpoint holds the offsets it
        resumes from), which then never waits on a broker outage. Default: :meth:`commit`.

        Raises:
            BusError: the commit was refused before it left (e.g. this member does not own a partition now).
        """
        self.commit(offsets)

    @abc.abstractmethod
    def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offsets (None where nothing is committed)."""

    @abc.abstractmethod
    def pause(self, partitions: list[TopicPartition]) -> None:
        """Stop returning records from ``partitions`` (membership is kept).

        A pause lasts while this member owns the partition: one revoked by a rebalance
        comes back unpaused (pause it again if the member still wants it paused). A pause
        of a partition not yet assigned applies when it is assigned.
        """

    @abc.abstractmethod
    def resume(self, partitions: list[TopicPartition]) -> None:
        """Undo :meth:`pause`."""

    @abc.abstractmethod
    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read ``tp`` from ``offset`` next. Applied when the partition is (or becomes) assigned."""

    @abc.abstractmethod
    def seek_to_beginning(self, partitions: list[TopicPartition] | None = None) -> None:
        """Read from the earliest retained offset (all assigned partitions when None)."""

    @abc.abstractmethod
    def seek_to_timestamp(self, timestamp_ms: int, partitions: list[TopicPartition] | None = None) -> None:
        """Read from the first record with timestamp >= ``timestamp_ms`` (ms since the epoch)."""

    @abc.abstractmethod
    def lag(self) -> dict[TopicPartition, int]:
        """Per assigned partition: end offset - committed offset (records)."""

    @abc.abstractmethod
    def position(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        """Per assigned partition, the offset of the next record this consumer will read (None while
        unknown). Past what :meth:`poll` returned, it also counts offsets a ``read_committed`` reader
        never receives (Kafka's transaction markers, aborted records).

        Raises:
            BusError: the bus failed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the group (a rebalance follows) without committing."""


class Admin(abc.ABC):
    """Creates and describes topics and reads group offsets."""

    @abc.abstractmethod
    def create_topic(self, name: str, partitions: int = 1, compacted: bool = False,
                     retention_ms: int | None = None, config: Mapping[str, str] | None = None) -> None:
        """Create ``name`` if it does not exist (idempotent; an existing topic is left as is)."""

    @abc.abstractmethod
    def describe_topic(self, name: str) -> TopicInfo:
        """Partition count and config of ``name``.

        Raises:
            BusError: the topic does not exist.
        """

    @abc.abstractmethod
    def list_topics(self) -> list[str]:
        """All topic names."""

    @abc.abstractmethod
    def delete_topic(self, name: str) -> None:
        """Delete ``name`` and its data."""

    @abc.abstractmethod
    def end_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the offset the next record will get."""

    @abc.abstractmethod
    def group_offsets(self, group: str, topic: str) -> dict[int, int | None]:
        """Per partition, ``group``'s committed offset on ``topic`` (None where nothing is committed)."""

    def group_lag(self, group: str, topic: str, committed: dict[int, int | None] | None = None) -> dict[int, int]:
        """Per partition, end offset minus ``group``'s committed offset (from the start where none).
        ``committed``: the group's offsets (:meth:`group_offsets`) when the caller has just read them (None:
        read here)."""
        ends = self.end_offsets(topic)
        starts = self.start_offsets(topic)
        if committed is None:
            committed = self.group_offsets(group, topic)
        return {p: end - (committed.get(p) if committed.get(p) is not None else starts.get(p, 0))
                for p, end in ends.items()}

    @abc.abstractmethod
    def group_members(self, group: str) -> dict[str, list[TopicPartition]]:
        """The live members of ``group`` (member id, which names the client) -> the partitions each owns.

        Raises:
            BusError: the bus failed.
        """

    @abc.abstractmethod
    def start_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the earliest retained offset."""

    def close(self) -> None:
        """Release the clients this admin opened for its reads (a later read opens them again). The embedded
        bus's admin holds none."""


class Bus(abc.ABC):
    """A connection to one bus; makes producers, consumers and an admin."""

    url: str

    @abc.abstractmethod
    def producer(self, transactional_id: str | None = None) -> Producer:
        """A producer; with ``transactional_id`` it supports transactions."""

    @abc.abstractmethod
    def consumer(self, group: str | None, *, read_committed: bool = True,
                 session_timeout_s: float = 10.0, client_id: str | None = None,
                 instance_id: str | None = None) -> Consumer:
        """A consumer in ``group`` (None: no group; use :meth:`Consumer.assign`).

        ``session_timeout_s``: a member silent this long is considered dead and
        its partitions are reassigned.

        ``instance_id``: static membership (Kafka's ``group.instance.id``, KIP-345). A
        member that joins with the instance id of an earlier member replaces it at once and
        takes back its partitions, instead of waiting out the old session; the earlier member,
        if still alive, is fenced out of the group. On Kafka a static
        member's close does not hand its partitions over before its session times out. One id per
        component instance, e.g. ``trainer.<policy>`` or ``raas-<worker id>``.
        """

    @abc.abstractmethod
    def admin(self) -> Admin:
        """The admin client."""


def read_topic(bus: Bus, topic: str, timeout_s: float = 30.0) -> list[Record]:
    """Every record of ``topic`` up to its current end offsets, all partitions, read from the
    beginning with no consumer group (nothing is committed), in (partition, offset) order.

    Read by a :class:`topics.follow.TopicReader`: on a transactionally written topic (Kafka,
    ``read_committed``) the commit and abort markers are never received, so a partition short of its end
    offset is taken to end in markers once no record has arrived for :data:`topics.follow.IDLE_S` seconds.

    Raises:
        BusError: the topic does not exist, or its records did not arrive within ``timeout_s`` seconds.
    """
    from topics.follow import TopicReader  # topics.follow builds on this module

    reader = TopicReader(bus, topic)
    try:
        records, ends = reader.read_to_end(timeout_s)
    finally:
        reader.close()
    return sorted((r for r in records if r.offset < ends[r.partition]), key=lambda r: (r.partition, r.offset))


def connect(url: str, security: "KafkaSecurity | None" = None) -> Bus:
    """Open the bus at ``url``: ``kafka://host:port`` or ``local://PATH``.

    Args:
        url: the bus URL.
        security: Kafka authentication and TLS (a run config's ``kafka`` section); None: from the
            ``ASTRAFLOW_KAFKA_*`` environment variables (:mod:`topics.kafka_security`).

    Raises:
        BusError: the scheme is unknown, the URL is malformed, or Kafka security settings are given for the
            embedded bus (which has no network side to secure).
    """
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise BusError(f"bus URL {url!r} must look like kafka://host:port or local://PATH")
    if scheme == "kafka":
        from topics.kafka import KafkaBus

        return KafkaBus(rest, security)
    if security is not None and not security.is_default:
        raise BusError(f"kafka security settings (kafka.security_protocol={security.security_protocol}) apply to "
                       f"a kafka:// bus, not to {url}")
    if scheme == "local":
        from topics.local import LocalBus

        return LocalBus(rest)
    raise BusError(f"bus URL {url!r}: unknown scheme {scheme!r} (use kafka:// or local://)")

