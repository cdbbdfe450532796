"""Bad records on the changelogs cost one dead letter, written once per run.

Every component reads the compacted changelogs (``weights``, ``control``, ``state``, ``trained``) whole, with no
consumer group (:mod:`topics.follow`): each skips a record it cannot decode, with a warning, and none can
dead-letter it without the others (and every restart) doing the same. The launcher does it once: it reads the
changelogs in a consumer group of its own (:attr:`topics.names.TopicNames.changelog_check_group`), checks each
record against the schemas the layout fixes for its topic (:attr:`topics.layout.TopicSpec.schemas`), writes the
bad ones to ``deadletter`` (acknowledged) and only then commits. A launcher killed between a dead letter and its
commit leaves records its successor reads again: before writing its first dead letter, a check reads the origins
of those already in ``deadletter`` from its group and writes none of them twice.
"""
from __future__ import annotations

import logging

from astraflow.monitor import RunMonitor
from topics.bus import Bus, Consumer, Producer, Record, TopicPartition, offsets_after, read_topic
from topics.codec import MessageError, decode
from topics.deadletter import send_to_deadletter
from topics.layout import RunTopics
from topics.names import TopicNames
from topics.schemas import DeadLetter

log = logging.getLogger(__name__)

#: a record's origin: (topic, partition, offset)
Origin = tuple[str, int, int]


class ChangelogCheck:
    """Dead-letters the undecodable records of a run's changelogs; :meth:`look` is a live-view look.

    Args:
        names: the run's topic names.

    Attributes:
        rejected: records dead-lettered by this check so far.
    """

    def __init__(self, names: TopicNames):
        self.names = names
        self.rejected = 0
        self._schemas = {s.name: s.schemas for s in RunTopics(names).changelogs()}
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._written: set[Origin] | None = None  # origins in deadletter from this group, read at the first bad one
        self._pending: list[tuple[Record, str]] = []  # bad records not yet acknowledged in deadletter
        self._offsets: dict[TopicPartition, int] = {}  # polled, not yet committed

    def look(self, monitor: RunMonitor, timeout_s: float = 0.0) -> None:
        """Check what arrived on the changelogs since the last look (waiting up to ``timeout_s`` seconds), dead-letter
        the records that do not decode as their topic's schemas (a value of None is a tombstone, not bad), then
        commit.

        Raises:
            topics.bus.BusError: the bus failed, or a dead letter was not acknowledged (then nothing is committed:
                the next look sends what is pending again, a next launcher reads those records again).
        """
        if self._consumer is None:
            me = f"{self.names.run}.launcher-changelog-check"
            # static: its close frees the client without librdkafka's consumer close (KafkaConsumer.close)
            self._consumer = monitor.bus.consumer(self.names.changelog_check_group, client_id=me, instance_id=me)
            self._producer = monitor.bus.producer()
            self._consumer.subscribe(list(self._schemas))
        records = self._consumer.poll(500, timeout_s)
        self._pending += [(r, error) for r in records if r.value is not None and (error := self._error(r))]
        self._offsets.update(offsets_after(records))
        if self._pending:
            if self._written is None:
                self._written = self._written_before(monitor.bus)
            fresh = [(r, error) for r, error in self._pending if (r.topic, r.partition, r.offset) not in self._written]
            for r, error in fresh:
                log.warning("dead-lettering %s[%d]@%d: %s", r.topic, r.partition, r.offset, error)
                send_to_deadletter(self._producer, self.names.deadletter, r, error, self._consumer.group)
            self._producer.flush()  # raises: the records stay pending, for the next look
            self._written.update((r.topic, r.partition, r.offset) for r, _ in fresh)
            self.rejected += len(fresh)
            self._pending = []
        if self._offsets:
            self._consumer.commit(self._offsets)
            self._offsets = {}

    def _error(self, r: Record) -> str | None:
        """Why ``r`` is not one of its topic's messages, or None when it is."""
        try:
            decode(r.value, self._schemas[r.topic], topic=r.topic, partition=r.partition, offset=r.offset)
        except MessageError as e:
            return str(e)
        return None

    def _written_before(self, bus: Bus) -> set[Origin]:
        """The origins of the dead letters this check's group wrote to ``deadletter`` so far (any launcher's)."""
        out = set()
        for r in read_topic(bus, self.names.deadletter):
            try:
                letter = decode(r.value, DeadLetter)
            except MessageError:
                continue
            if letter.consumer_group == self.names.changelog_check_group:
                out.add((letter.topic, letter.partition, letter.offset))
        return out

    def close(self) -> None:
        """Leave the group (what was checked is committed) and close the dead-letter producer.

        Raises:
            topics.bus.BusError: the bus does not answer.
        """
        if self._consumer is not None:
            self._consumer.close()
            self._producer.close()
