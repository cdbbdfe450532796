"""The embedded single-machine bus: ``local://PATH``, durable on disk, no broker.

Layout under ``PATH``::

    topics/<topic>/meta.json        {"partitions": n, "config": {...}}
    topics/<topic>/<p>.log          the partition's append-only log
    topics/<topic>/<p>.lock         flock(2) lock guarding appends and rewrites
    groups/<quoted group>/state.json    members, generation, target assignment
    groups/<quoted group>/offsets.json  committed offsets {topic: {partition: offset}}
    groups/<quoted group>/lock          flock(2) lock guarding both files

A log file starts with a 40-byte header (magic, log start offset, next-offset
hint, time of the last compaction in ms, size after it in bytes), followed by
frames: ``<u32 body length, i64 offset, i64 timestamp_ms>`` then a msgpack body
``[key, headers, value]``. A frame is written with one ``write(2)`` on an
``O_APPEND`` descriptor under the partition's exclusive lock, which also assigns
offsets, so several processes may produce and consume at once. A writer killed
mid-frame leaves a torn tail; readers stop before it and the next writer
truncates it under the lock.

Durability: writes go to the page cache without ``fsync``. They survive the
death of any process (including SIGKILL), not a kernel crash or power loss.

Retention (``retention.ms``, records older than that are dropped and the log
start offset advances) and compaction (``cleanup.policy=compact``: the latest
record per key survives, with its original offset) rewrite the log into a new
file that atomically replaces the old one. Both run lazily: on append when due,
retention also when start offsets are read, and compaction on demand through
:meth:`LocalAdmin.compact`. Compaction is due when ``min.cleanable.dirty.ratio``
(default 0.5) of the log was written since the last one and either
``segment.ms`` (default 1 h) has passed or 16 MiB are dirty. Tombstones (value
None) are dropped ``delete.retention.ms`` (default 1 day) after they were
written.

Consumer groups: each member registers in the group state file under the group
lock and heartbeats from :meth:`LocalConsumer.poll`. A member silent for longer
than its ``session_timeout_s``, or whose process is gone (same host), is expired.
Any membership or topic change bumps the generation and the partitions of each
topic are split over the sorted member ids by ranges (Kafka's range assignor).
A member releases partitions it lost at its next poll and only then may the new
owner take them, starting at the group's committed offset; so two members never
read one partition at once unless one of them stopped polling for longer than
its session timeout. Delivery is at-least-once, as on Kafka: records polled but
not committed before a rebalance are delivered again to the new owner.

Transactions are at-least-once here: :meth:`LocalProducer.commit_transaction`
appends the buffered records, then commits the consumer's offsets. A crash in
between re-delivers the input and duplicates the output; downstream
de-duplication by ``group_id`` makes the pipeline effectively-once.

Modules: this one holds the entry point (:class:`LocalBus`) and :class:`LocalAdmin`;
:mod:`topics.local_producer` and :mod:`topics.local_consumer` the clients;
:mod:`topics.local_log` the log file format, appends, reads, retention and compaction;
:mod:`topics.local_topics` the topic catalog; :mod:`topics.local_groups` consumer-group
state and the range assignor; :mod:`topics.local_files` the shared file primitives.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from topics.bus import Admin, Bus, BusError, TopicInfo, TopicPartition
from topics.local_consumer import LocalConsumer
from topics.local_files import now_ms
from topics.local_groups import Group
from topics.local_log import Tails, rewrite_now
from topics.local_producer import LocalProducer
from topics.local_topics import Topics, start_offset, topic_config


class LocalAdmin(Admin):
    """Admin of the embedded bus."""

    def __init__(self, bus: "LocalBus"):
        self._bus = bus

    def create_topic(self, name: str, partitions: int = 1, compacted: bool = False,
                     retention_ms: int | None = None, config: Mapping[str, str] | None = None) -> None:
        """Create ``name`` unless it exists. Configs read here: cleanup.policy, retention.ms, segment.ms,
        min.cleanable.dirty.ratio, delete.retention.ms; others are stored and reported.

        Raises:
            BusError: the name is invalid or ``partitions`` < 1.
        """
        self._bus._topics.create(name, partitions, topic_config(compacted, retention_ms, config))

    def describe_topic(self, name: str) -> TopicInfo:
        meta = self._bus._topics.require(name, fresh=True)
        return TopicInfo(name, meta["partitions"], dict(meta["config"]))

    def list_topics(self) -> list[str]:
        return self._bus._topics.names()

    def delete_topic(self, name: str) -> None:
        """Delete ``name`` and its data.

        Raises:
            BusError: the topic does not exist.
        """
        self._bus._topics.delete(name)

    def end_offsets(self, topic: str) -> dict[int, int]:
        topics = self._bus._topics
        return {p: self._bus._tails.end_offset(topics.partition(topic, p))
                for p in range(topics.require(topic, fresh=True)["partitions"])}

    def start_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the earliest retained offset (retention that is due is applied first)."""
        return {p: start_offset(self._bus._topics, topic, p)
                for p in range(self._bus._topics.require(topic, fresh=True)["partitions"])}

    def group_offsets(self, group: str, topic: str) -> dict[int, int | None]:
        stored = Group(self._bus.root, group).read_offsets().get(topic, {})
        return {p: stored.get(str(p)) for p in range(self._bus._topics.require(topic, fresh=True)["partitions"])}

    def group_members(self, group: str) -> dict[str, list[TopicPartition]]:
        state = Group(self._bus.root, group).read_state()
        wall_ms = now_ms()
        return {mid: sorted(TopicPartition(t, p) for t, p in m["owned"]) for mid, m in state["members"].items()
                if wall_ms - m["heartbeat_ms"] <= m["session_ms"]}

    def compact(self, topic: str) -> None:
        """Compact (and apply retention to) every partition of ``topic`` now, whatever is due.

        Raises:
            BusError: the topic does not exist or is not compacted.
        """
        meta = self._bus._topics.require(topic, fresh=True)
        if "compact" not in meta["config"].get("cleanup.policy", ""):
            raise BusError(f"topic {topic!r} is not compacted (cleanup.policy={meta['config'].get('cleanup.policy')})")
        for p in range(meta["partitions"]):
            rewrite_now(self._bus._topics.partition(topic, p), meta["config"], compact=True)


class LocalBus(Bus):
    """The embedded bus rooted at directory ``path`` (created if missing)."""

    def __init__(self, path: str):
        if not path:
            raise BusError("local:// bus needs a directory path, e.g. local:///tmp/astraflow-bus")
        self.url = f"local://{path}"
        self.root = Path(path).expanduser()
        try:
            self._topics = Topics(self.root)
        except OSError as e:
            raise BusError(f"local bus directory {self.root}: {e}") from e
        self._tails = Tails()

    def producer(self, transactional_id: str | None = None) -> LocalProducer:
        return LocalProducer(self, transactional_id)

    def consumer(self, group: str | None, *, read_committed: bool = True,
                 session_timeout_s: float = 10.0, client_id: str | None = None,
                 instance_id: str | None = None) -> LocalConsumer:
        return LocalConsumer(self, group, read_committed, session_timeout_s, client_id, instance_id)

    def admin(self) -> LocalAdmin:
        return LocalAdmin(self)
