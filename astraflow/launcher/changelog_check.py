"""Bad records on the changelogs cost one dead letter, written once per run.

Every component reads the compacted changelogs (``weights``, ``control``, ``state``, ``trained``) whole, with no
consumer group (:mod:`topics.follow`): each skips a record it cannot decode, with a warning, and none can
dead-letter it without the others (and every restart) doing the same. The launcher does it once: it reads the
changelogs in a consumer group of its own (:attr:`topics.names.TopicNames.changelog_check_group`), checks each
record against the schemas the layout fixes for its topic (:attr:`topics.layout.TopicSpec.schemas`), writes the
bad ones to ``deadletter`` (acknowledged) and only then commits, so a launcher restarted on the run resumes after
what it checked.
"""
from __future__ import annotations

from astraflow.monitor import RunMonitor
from topics.bus import Consumer, Producer, offsets_after
from topics.deadletter import ValidatingConsumer
from topics.layout import RunTopics
from topics.names import TopicNames


class ChangelogCheck:
    """Dead-letters the undecodable records of a run's changelogs; :meth:`look` is a live-view look.

    Args:
        names: the run's topic names.

    Attributes:
        rejected: records dead-lettered by this check so far.
    """

    def __init__(self, names: TopicNames):
        self.names = names
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._checks: dict[str, ValidatingConsumer] = {}

    @property
    def rejected(self) -> int:
        return sum(c.rejected for c in self._checks.values())

    def look(self, monitor: RunMonitor, timeout_s: float = 0.0) -> None:
        """Check what arrived on the changelogs since the last look (waiting up to ``timeout_s`` seconds), dead-letter
        the records that do not decode as their topic's schemas, then commit.

        Raises:
            topics.bus.BusError: the bus failed, or a dead letter was not acknowledged (then nothing is committed:
                the next launcher checks those records again).
        """
        if self._consumer is None:
            specs = RunTopics(self.names).changelogs()
            self._consumer = monitor.bus.consumer(self.names.changelog_check_group,
                                                  client_id=f"{self.names.run}.launcher-changelog-check")
            self._producer = monitor.bus.producer()
            self._checks = {s.name: ValidatingConsumer(self._consumer, self._producer, self.names.deadletter,
                                                       s.schemas) for s in specs}
            self._consumer.subscribe([s.name for s in specs])
        records = self._consumer.poll(500, timeout_s)
        if not records:
            return
        for topic, check in self._checks.items():  # a value of None is a tombstone (compaction's delete): not bad
            check.decode(r for r in records if r.topic == topic and r.value is not None)
        self._consumer.commit(offsets_after(records))

    def close(self) -> None:
        """Leave the group (what was checked is committed) and close the dead-letter producer.

        Raises:
            topics.bus.BusError: the bus does not answer.
        """
        if self._consumer is not None:
            self._consumer.close()
            self._producer.close()
