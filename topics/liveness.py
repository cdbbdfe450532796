"""The liveness rule of a component that reads a topic as a member of a consumer group: a component that makes no
progress for ``stall_s`` seconds while records wait for it and the cluster answers raises :class:`Stalled`, so it
exits and its supervisor (``astraflow run``, or a container's restart policy) restarts it from what its group
committed, which is restart-safe by construction.

Progress and waiting records are judged from the broker's durable state, never from the component's own account:

- a member that holds partitions is stalled when some partition has records past its position (more than one: one
  is the transaction marker after a transactionally written partition's last record) and no such position has moved
  for ``stall_s`` seconds;
- a member that holds no partition is stalled when, for ``stall_s`` seconds, its group has left records waiting past
  committed offsets that did not move: no member reads them (a member left out of its group after a broker restart,
  or a group that never assigned them). A member that is idle because the group has more members than partitions
  sees the others' commits move and is left alone.

A cluster that does not answer is an outage, not a stall: the clocks start again. The same rule, seen from outside,
kills a process none of whose threads runs any more (:mod:`astraflow.launcher.supervision`'s heartbeat).
"""
from __future__ import annotations

import logging
import time

from topics.bus import Admin, BusError, Consumer, TopicPartition

#: Default of ``stall_s``: seconds without progress, records waiting, before a component is stalled.
STALL_S = 240.0


class Stalled(BusError):
    """A component made no progress for ``stall_s`` seconds while records waited for it and the cluster answered;
    the message names the partitions, positions and ends."""


class ProgressWatch:
    """The liveness rule for ``consumer``'s reads of ``topic`` as a member of ``group``, looked at while the reads
    return nothing.

    Args:
        consumer: the group member (its :meth:`~topics.bus.Consumer.assignment` and
            :meth:`~topics.bus.Consumer.position`).
        admin: reads the partitions' end offsets and the group's committed offsets.
        topic: the topic read.
        group: the member's consumer group.
        who: names the component in messages (e.g. ``trainer actor``).
        log: where the positions go.
        every_s: seconds between two looks (and of idleness before the first).
        stall_s: seconds without progress, records waiting, before :meth:`check` raises :class:`Stalled`.
    """

    def __init__(self, consumer: Consumer, admin: Admin, topic: str, group: str, who: str, log: logging.Logger, *,
                 every_s: float = 30.0, stall_s: float = STALL_S):
        self.consumer, self.admin, self.topic, self.group, self.who, self.log = consumer, admin, topic, group, who, log
        self.every_s, self.stall_s = every_s, stall_s
        self._looked = 0.0
        #: what waited at the last look (partition -> position or committed offset) and since when unmoved
        self._waiting: tuple[dict, float] = ({}, 0.0)

    def check(self, idle_since: float) -> None:
        """Look at the durable state if nothing was read since ``idle_since`` (``time.monotonic()`` seconds) for
        ``every_s`` and the last look is ``every_s`` old; log it (WARNING when records wait).

        Raises:
            Stalled: records have waited at the same positions (a member holding partitions) or at the group's
                same committed offsets (a member holding none) for ``stall_s`` seconds, the cluster answering.
        """
        now = time.monotonic()
        if now - idle_since < self.every_s or now - self._looked < self.every_s:
            return
        self._looked = now
        parts = self.consumer.assignment()
        try:
            waiting, where = self._held(parts) if parts else self._unread()
        except BusError as e:
            self.log.warning("%s: nothing read for %.0f s; the cluster does not answer (%s)", self.who,
                             now - idle_since, e)
            self._waiting = ({}, now)
            return
        self.log.log(logging.WARNING if waiting else logging.INFO, "%s: nothing read for %.0f s; %s", self.who,
                     now - idle_since, where)
        if not waiting or waiting != self._waiting[0]:
            self._waiting = (waiting, now)
        elif now - self._waiting[1] >= self.stall_s:
            raise Stalled(f"{self.who} stalled: {where}, unmoved for {now - self._waiting[1]:.0f} s while the "
                          "cluster answers; it exits to be restarted from its group's committed offsets")

    def _held(self, parts: list[TopicPartition]) -> tuple[dict, str]:
        """The partitions held with records past their positions, and a description of all held."""
        position = self.consumer.position(parts)
        # no position until a record is read after an assignment (librdkafka): reading starts at the committed
        # offset then, so a member caught up since its assignment is not counted as behind
        unread = [tp for tp in parts if position.get(tp) is None]
        if unread:
            position.update(self.consumer.committed(unread))
        ends = self.admin.end_offsets(self.topic)
        waiting = {tp: position.get(tp) for tp in parts if (position.get(tp) or 0) < ends.get(tp.partition, 0) - 1}
        where = ", ".join(f"p{tp.partition} at {position.get(tp)} of {ends.get(tp.partition)}" for tp in parts)
        return waiting, f"{self.topic}: {where}" + (" (records wait past the position)" if waiting else "")

    def _unread(self) -> tuple[dict, str]:
        """The partitions whose records wait past the group's committed offsets, while this member holds none."""
        committed = self.admin.group_offsets(self.group, self.topic)
        lag = self.admin.group_lag(self.group, self.topic, committed)
        waiting = {p: committed.get(p) for p, n in lag.items() if n > 1}
        where = (f"holds no partition of {self.topic}; group {self.group}'s committed offsets "
                 + ", ".join(f"p{p} at {committed.get(p)} ({lag[p]} behind)" for p in sorted(lag)))
        return waiting, where
