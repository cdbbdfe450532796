"""A watchdog on a group member that reads nothing: it names where the member reads and where each partition
ends, and gives up when records wait past positions that do not move.

A member of a consumer group that is assigned partitions but receives no record is either caught up (its
positions are at the ends) or blocked: a consumer wedged after a broker restart, or a ``read_committed``
reader held back by a transaction that is never ended. The first is quiet idleness; the second would be a run
that stops without a word. :class:`ReaderWatch` logs the positions against the log ends every ``every_s``
seconds of idleness (INFO when caught up, WARNING when records wait), and raises once some partition has held records past an unmoved position for
``stuck_s`` seconds, so the component exits and its supervisor (``astraflow run``) restarts it from what it
committed.
"""
from __future__ import annotations

import logging
import time

from topics.bus import Admin, BusError, Consumer, TopicPartition


class ReaderWatch:
    """Watch ``consumer``'s reads of ``topic`` while they return nothing.

    Args:
        consumer: the group member (its :meth:`~topics.bus.Consumer.assignment` and
            :meth:`~topics.bus.Consumer.position`).
        admin: reads the partitions' end offsets (the log ends, open transactions included).
        topic: the topic read.
        who: names the reader in messages (e.g. ``trainer actor``).
        log: where the positions go (WARNING).
        every_s: seconds of idleness between two looks.
        stuck_s: seconds a partition may hold records past an unmoved position before :meth:`check` raises.
    """

    def __init__(self, consumer: Consumer, admin: Admin, topic: str, who: str, log: logging.Logger, *,
                 every_s: float = 30.0, stuck_s: float = 240.0):
        self.consumer, self.admin, self.topic, self.who, self.log = consumer, admin, topic, who, log
        self.every_s, self.stuck_s = every_s, stuck_s
        self._looked = 0.0
        self._behind: tuple[dict[TopicPartition, int | None], float] = ({}, 0.0)
        self._unassigned: tuple[float, float] | None = None  # (since, last logged) while no partition is assigned

    def note_unassigned(self) -> float:
        """Called while the consumer holds no partition of the topic (a rebalance, a group that never assigns it
        any): log it at most every ``every_s`` seconds, with for how long; returns now (``time.monotonic()``),
        so that the caller's idleness restarts once partitions come."""
        now = time.monotonic()
        since, logged = self._unassigned if self._unassigned is not None else (now, now)
        if now - logged >= self.every_s:
            self.log.warning("%s: no partition of %s assigned for %.0f s (waiting for the consumer group)", self.who,
                             self.topic, now - since)
            logged = now
        self._unassigned = (since, logged)
        return now

    def check(self, idle_since: float) -> None:
        """Look at the positions if nothing was read since ``idle_since`` (``time.monotonic()`` seconds) for
        ``every_s`` and the last look is ``every_s`` old; log them (WARNING when some partition is behind).

        A partition is behind when its end is more than one past the position (one is the transaction
        marker after the last record of a transactionally written partition).

        Raises:
            topics.bus.BusError: the same partitions have been behind at the same positions for ``stuck_s``
                seconds; the message names each partition's position and end.
        """
        now = time.monotonic()
        self._unassigned = None
        if now - idle_since < self.every_s or now - self._looked < self.every_s:
            return
        self._looked = now
        try:
            parts = self.consumer.assignment()
            position = self.consumer.position(parts)
            # no position until a record is read after an assignment (librdkafka): reading starts at the committed
            # offset then, so a member caught up since its assignment is not counted as behind
            unread = [tp for tp in parts if position.get(tp) is None]
            if unread:
                position.update(self.consumer.committed(unread))
            ends = self.admin.end_offsets(self.topic)
        except BusError as e:
            self.log.warning("%s: nothing read for %.0f s; positions on %s unknown (%s)", self.who, now - idle_since,
                             self.topic, e)
            return
        where = ", ".join(f"p{tp.partition} at {position.get(tp)} of {ends.get(tp.partition)}" for tp in parts)
        behind = {tp: position.get(tp) for tp in parts if (position.get(tp) or 0) < ends.get(tp.partition, 0) - 1}
        self.log.log(logging.WARNING if behind else logging.INFO, "%s: nothing read for %.0f s; %s: %s%s", self.who,
                     now - idle_since, self.topic, where, " (records wait past the position)" if behind else "")
        if not behind or behind != self._behind[0]:
            self._behind = (behind, now)
        elif now - self._behind[1] >= self.stuck_s:
            raise BusError(f"{self.who}: reading {self.topic} is blocked: {where}, and no position moved in "
                           f"{now - self._behind[1]:.0f} s (a wedged consumer, or a transaction that is never ended)")
