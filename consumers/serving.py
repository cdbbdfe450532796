"""The serving stage: assembles training batches from ``samples.<policy>`` (DESIGN.md, step 5).

- Records are decoded as :class:`~topics.schemas.TrajectoryGroup`; anything else
  goes to the run's ``deadletter`` topic (:class:`topics.deadletter.ValidatingConsumer`).
- Groups are buffered and served earliest ``min_version`` first.
- A group too stale for the trainer (:func:`policies.staleness.too_stale`: ``trainer_version - min_version``
  exceeds ``max_staleness``) is dropped and counted, whenever it is looked at (it can age in the buffer).
- Groups are de-duplicated by ``group_id``: against the buffer, and against the ids served (or dropped)
  in the last versions, which are part of the checkpoint state (:attr:`ServingStage.served_ids`).
- A serving policy (replay), when configured, supplies a fraction ``replay.ratio`` of
  each batch, under the same ``max_staleness`` (its own bound, if set, may only be tighter).
- Groups rolled out on versions that are off the trainer's lineage (:attr:`ServingStage.off_lineage`:
  published by steps a restarted trainer redid from an older checkpoint) are dropped as stale.
- Offsets are committed only by :meth:`ServingStage.commit`, which the trainer calls
  after the trained step is checkpointed. The offset committed per partition is
  the lowest offset still buffered (not yet served), or the end of what was
  polled; a group re-read after a restart is then dropped as already served.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from policies.base import ServingPolicy
from policies.staleness import too_stale

#: Versions a served group id is remembered at least (:attr:`ServingStage.served_ids`): a prompt that a RaaS
#: worker redelivers (it crashed before committing it) is rolled out again and its copy comes back after the
#: worker's session timed out and it restarted, seconds to minutes; 32 versions are minutes of training even
#: at the tiny model's steps of about a second.
REDELIVERY_VERSIONS = 32
from topics.bus import Consumer, Producer, TopicPartition
from topics.deadletter import ValidatingConsumer
from topics.schemas import TrajectoryGroup


@dataclass
class ServedBatch:
    """One batch for the trainer.

    ``groups``: fresh groups (earliest version first) followed by replayed ones;
    ``replayed``: how many of them came from the replay pool; ``dropped_stale`` and
    ``duplicates``: groups dropped while assembling it; ``wait_s``: seconds spent
    waiting for records; ``rejected``: records dead-lettered while assembling it.
    """

    groups: list[TrajectoryGroup]
    replayed: int = 0
    dropped_stale: int = 0
    duplicates: int = 0
    rejected: int = 0
    wait_s: float = 0.0


@dataclass(order=True)
class _Buffered:
    min_version: int
    partition: int
    offset: int
    topic: str = field(compare=False)
    group: TrajectoryGroup = field(compare=False)


class ServingStage:
    """Batch assembly for one policy's trainer.

    Args:
        consumer: a consumer in the trainer's group (``trainer.<policy>``); this stage
            subscribes it to ``topic`` unless it already has an assignment.
        producer: used for dead-letter writes.
        topic: the ``samples.<policy>`` topic.
        deadletter_topic: the run's ``deadletter`` topic.
        batch_groups: batch size in groups.
        max_staleness: versions; a group with ``version - min_version > max_staleness`` is dropped.
        replay: a serving policy (:class:`policies.replay.Replay`) that supplies ``replay.ratio`` of each
            batch and is offered every fresh group served, or None. Its ``max_staleness`` is set to
            ``max_staleness`` when it has none.
        max_buffer: groups buffered at most before a batch is cut (bounds memory).

    Attributes:
        served_ids: group id -> the trainer version that served (or dropped) its group, -1 for a group
            without generated tokens (never stale, so kept). An id is forgotten once the trainer is more than
            ``max(max_staleness, REDELIVERY_VERSIONS)`` versions past that: a copy read again from the committed
            offsets (after a restart) is then too stale to train anyway (its ``min_version`` is at most the
            version that served it), and a copy of a prompt redelivered by a RaaS worker (rolled out again, on
            newer weights) has come back long before (:data:`REDELIVERY_VERSIONS`). So it holds the groups of
            the last ``max(max_staleness, REDELIVERY_VERSIONS) + 1`` versions.

    Raises:
        ValueError: ``batch_groups`` below 1, a ``replay.ratio`` outside [0, 1), or a ``replay.max_staleness``
            above ``max_staleness``.
    """

    def __init__(self, consumer: Consumer, producer: Producer, topic: str, deadletter_topic: str, *,
                 batch_groups: int, max_staleness: int = 8, replay: ServingPolicy | None = None,
                 max_buffer: int = 4096):
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        replay_fraction = replay.ratio if replay is not None else 0.0
        if not 0.0 <= replay_fraction < 1.0:
            raise ValueError(f"the serving policy's ratio must be in [0, 1), got {replay_fraction}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if replay is not None:
            if replay.max_staleness is None:
                replay.max_staleness = max_staleness
            elif replay.max_staleness > max_staleness:
                raise ValueError(f"the serving policy's max_staleness {replay.max_staleness} is above the policy's "
                                 f"{max_staleness}: it would train groups the policy drops as stale")
        self.consumer, self.topic = consumer, topic
        self.reader = ValidatingConsumer(consumer, producer, deadletter_topic, TrajectoryGroup)
        if not consumer.assignment():
            consumer.subscribe([topic])
        self.max_staleness, self.batch_groups = max_staleness, batch_groups
        self.replay, self.replay_fraction, self.max_buffer = replay, replay_fraction, max_buffer
        self._buffer: list[_Buffered] = []
        self._buffered_ids: set[str] = set()
        self.served_ids: dict[str, int] = {}
        self._polled_end: dict[TopicPartition, int] = {}
        #: inclusive version ranges off the trainer's lineage (see :class:`trainer.checkpoint.Checkpoint`'s
        #: ``renumbered``): a group with a sample of one of them is dropped as stale
        self.off_lineage: list[tuple[int, int]] = []
        #: totals since start: groups dropped as stale, as duplicates, records dead-lettered.
        self.total_dropped_stale = 0
        self.total_duplicates = 0

    # -- state ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The served group ids (:attr:`served_ids`, the de-duplication set) and the counters."""
        return {"served_ids": dict(self.served_ids), "dropped_stale": self.total_dropped_stale,
                "duplicates": self.total_duplicates}

    def load_state_dict(self, state: dict[str, Any], offsets: dict[TopicPartition, int] | None = None) -> None:
        """Restore :meth:`state_dict` and read each partition in ``offsets`` from that offset next."""
        served = state.get("served_ids", {})
        # a checkpoint written before the ids were bounded lists them without versions: kept as never stale
        self.served_ids = dict(served) if isinstance(served, dict) else dict.fromkeys(served, -1)
        self.total_dropped_stale = int(state.get("dropped_stale", 0))
        self.total_duplicates = int(state.get("duplicates", 0))
        self._buffer.clear()
        self._buffered_ids.clear()
        self._polled_end = dict(offsets or {})
        for tp, off in (offsets or {}).items():
            self.consumer.seek(tp, off)

    def offsets_to_commit(self) -> dict[TopicPartition, int]:
        """Per partition, the next offset a restart must read: the lowest buffered offset, else the polled end."""
        out = dict(self._polled_end)
        for b in self._buffer:
            tp = TopicPartition(b.topic, b.partition)
            out[tp] = min(out.get(tp, b.offset), b.offset)
        return out

    def progress_offsets(self) -> dict[TopicPartition, int]:
        """:meth:`offsets_to_commit`, with each assigned partition that holds no buffered record moved on to the
        consumer's position where that is further: past the transaction markers and aborted records that a poll
        never returns, so that the group's committed lag is 0 when nothing waits for the trainer.

        Raises:
            topics.bus.BusError: the consumer's position could not be read.
        """
        out = self.offsets_to_commit()
        buffered = {TopicPartition(b.topic, b.partition) for b in self._buffer}
        free = [tp for tp in self.consumer.assignment() if tp not in buffered]
        for tp, position in (self.consumer.position(free) if free else {}).items():
            if position is not None and position > out.get(tp, -1):
                out[tp] = position
        return out

    def consumed(self) -> int:
        """Records of ``topic`` taken out of it so far: polled and no longer buffered (served or dropped).

        Offsets are absolute, so this is comparable with the topic's end offsets: their
        sum minus this is what waits for the trainer (records, summed over partitions).
        """
        return sum(self._polled_end.values()) - len(self._buffer)

    def commit(self, offsets: dict[TopicPartition, int] | None = None, wait: bool = True) -> None:
        """Commit ``offsets`` (default :meth:`offsets_to_commit`) for the consumer group; without ``wait``, without
        waiting for the broker (:meth:`topics.bus.Consumer.commit_async`).

        Call only after the steps trained on everything before them are checkpointed.

        Raises:
            topics.bus.BusError: the commit was refused (with ``wait``: or it did not land).
        """
        offsets = self.offsets_to_commit() if offsets is None else offsets
        if offsets:
            (self.consumer.commit if wait else self.consumer.commit_async)(offsets)

    # -- batches ------------------------------------------------------------
    def _ingest(self, polled, batch: ServedBatch) -> None:
        for record, group in polled:
            if group.group_id in self.served_ids or group.group_id in self._buffered_ids:
                batch.duplicates += 1
                continue
            self._buffered_ids.add(group.group_id)
            self._buffer.append(_Buffered(group.min_version, record.partition, record.offset, record.topic, group))
        for tp, end in self.reader.last_offsets.items():
            self._polled_end[TopicPartition(*tp)] = max(end, self._polled_end.get(TopicPartition(*tp), 0))

    def _drop_stale(self, version: int, batch: ServedBatch) -> None:
        keep = []
        for b in self._buffer:
            if too_stale(b.group.min_version, version, self.max_staleness) or self._off_lineage(b.group):
                batch.dropped_stale += 1
                self._buffered_ids.discard(b.group.group_id)
                self._remember(b.group, version)  # consumed: never served later either
            else:
                keep.append(b)
        self._buffer = keep

    def _remember(self, group: TrajectoryGroup, version: int) -> None:
        """Add ``group``, served or dropped at trainer ``version``, to :attr:`served_ids`."""
        self.served_ids[group.group_id] = version if group.min_version >= 0 else -1

    def _forget_served(self, version: int) -> None:
        """Bound :attr:`served_ids`: forget the ids served more than the window's versions before ``version``."""
        window = max(self.max_staleness, REDELIVERY_VERSIONS)
        self.served_ids = {gid: served_at for gid, served_at in self.served_ids.items()
                           if not too_stale(served_at, version, window)}

    def _off_lineage(self, group: TrajectoryGroup) -> bool:
        return group.min_version >= 0 and any(lo <= group.max_version and group.min_version <= hi
                                              for lo, hi in self.off_lineage)

    def _fresh_target(self) -> int:
        """Fresh groups wanted in a batch (the rest is replayed)."""
        return self.batch_groups - round(self.replay_fraction * self.batch_groups)

    def next_batch(self, version: int, timeout_s: float = 30.0, poll_timeout_s: float = 0.5,
                   on_poll: Callable[[], None] | None = None) -> ServedBatch | None:
        """Assemble the next batch for a trainer at ``version``.

        Polls until the buffer holds enough fresh, non-stale groups, or ``timeout_s``
        seconds pass; then returns what there is (a short batch), or None when there
        is nothing to train on (drops are still counted in the ``total_*`` counters).
        Records already available are drained without waiting first, so that
        earliest-version-first ordering sees all of them. ``on_poll()`` is called after each poll
        while waiting (e.g. to report :meth:`consumed`, which stale drops move before any batch is ready).

        Raises:
            topics.bus.BusError: the bus failed (including a dead-letter write).
        """
        self._forget_served(version)
        batch = ServedBatch(groups=[])
        target = self._fresh_target()
        start = time.perf_counter()
        deadline = start + timeout_s
        rejected_before = self.reader.rejected
        while True:
            self._drop_stale(version, batch)
            ready = len(self._buffer) >= target
            if ready and len(self._buffer) >= self.max_buffer:
                break
            remaining = deadline - time.perf_counter()
            if not ready and remaining <= 0:
                break
            t0 = time.perf_counter()
            polled = self.reader.poll(timeout_s=0.0 if ready else min(poll_timeout_s, max(remaining, 0.0)))
            if not ready:
                batch.wait_s += time.perf_counter() - t0
            if not polled and not self.reader.last_offsets and ready:
                break
            self._ingest(polled, batch)
            if on_poll is not None:
                self._drop_stale(version, batch)
                on_poll()
        batch.rejected = self.reader.rejected - rejected_before
        self._drop_stale(version, batch)
        self._buffer.sort()
        taken = []
        while self._buffer and len(taken) < target:
            b = self._buffer.pop(0)
            self._buffered_ids.discard(b.group.group_id)
            taken.append(b.group)
        for g in taken:
            self._remember(g, version)
        replayed: list[TrajectoryGroup] = []
        if self.replay is not None:
            if self.replay_fraction and taken:
                want = self.batch_groups - target
                replayed = self.replay.sample(want, version) if want else []
            self.replay.add(taken, version)
        self.total_dropped_stale += batch.dropped_stale
        self.total_duplicates += batch.duplicates
        if not taken and not replayed:
            return None
        batch.groups = taken + replayed
        batch.replayed = len(replayed)
        return batch
