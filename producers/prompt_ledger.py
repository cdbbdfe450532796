"""Out-of-order completion, in-order commit: :class:`PromptLedger`.

A RaaS worker rolls out many prompts at once, and they finish in any order (a long episode, a slow
tool). Their groups are written as soon as they finish, but a partition's committed offset may only
pass prompts that are done: the ledger commits each partition up to its lowest prompt still open
(the pattern of confluent's parallel consumer). A crash re-delivers exactly the open prompts and
those above them; the groups of the latter are written again under the same deterministic
``group_id`` and de-duplicated by the serving stage.

A record that must be dead-lettered behind an open prompt of its partition (a prompt too long for a
model, or one whose rollout failed) is *held* until every prompt below it is done, so that a batch given
up and re-delivered (:meth:`PromptLedger.rewind`) does not dead-letter it twice.
"""
from __future__ import annotations

from dataclasses import dataclass

from topics.bus import Record, TopicPartition


@dataclass
class _Open:
    record: Record
    held: str = ""  # the dead-letter reason of a held record, '' for a prompt being rolled out
    kind: str = ""  # what the caller counts a held record as when it dead-letters it


class PromptLedger:
    """The prompts a worker has polled and not yet finished, per partition, in offset order."""

    def __init__(self) -> None:
        self._open: dict[TopicPartition, dict[int, _Open]] = {}
        self._next: dict[TopicPartition, int] = {}  # per partition: the highest offset polled + 1
        self._moved: set[TopicPartition] = set()  # partitions whose commit point moved since the last commit

    def __len__(self) -> int:
        """Records open (rolling out or held)."""
        return sum(len(x) for x in self._open.values())

    def add(self, record: Record) -> None:
        """Open ``record``: a prompt being rolled out."""
        self._open.setdefault(record.tp, {})[record.offset] = _Open(record)
        self._next[record.tp] = max(self._next.get(record.tp, 0), record.offset + 1)

    def hold(self, record: Record, reason: str, kind: str) -> None:
        """Open ``record`` as held: to be dead-lettered with ``reason`` once all below it are done (``kind``: what
        the caller counts it as then)."""
        self.add(record)
        self.fail(record, reason, kind)

    def fail(self, record: Record, reason: str, kind: str) -> None:
        """Hold the open ``record`` (its rollout failed): as :meth:`hold`. A record no longer tracked (its
        partition was rewound or moved away) is ignored."""
        entry = self._open.get(record.tp, {}).get(record.offset)
        if entry is not None:
            entry.held, entry.kind = reason, kind

    def blocked(self, record: Record) -> bool:
        """Whether a prompt below ``record`` in its partition is open."""
        return any(o < record.offset for o in self._open.get(record.tp, ()))

    def polled(self, offsets: dict[TopicPartition, int]) -> None:
        """Note a poll's offsets (per partition: the highest offset polled + 1), records not opened included
        (dead-lettered at once): with nothing open below, the commit point moves past them."""
        for tp, offset in offsets.items():
            self._next[tp] = max(self._next.get(tp, 0), offset)
            self._moved.add(tp)

    def done(self, record: Record) -> None:
        """Close ``record`` (its groups are written, or it was dead-lettered). A record no longer tracked
        (its partition was rewound or moved away) is ignored."""
        if self._open.get(record.tp, {}).pop(record.offset, None) is not None:
            self._moved.add(record.tp)

    def releasable(self) -> list[tuple[Record, str, str]]:
        """The held records with nothing open below them, with their reasons and kinds (lowest first per
        partition): the caller dead-letters each and marks it :meth:`done`."""
        out = []
        for entries in self._open.values():
            for offset in sorted(entries):
                entry = entries[offset]
                if not entry.held:
                    break
                out.append((entry.record, entry.held, entry.kind))
        return out

    def rewind(self) -> dict[TopicPartition, int]:
        """Forget every open record; per partition that had one, the lowest open offset (to seek back to:
        it and everything after it will be delivered again)."""
        back = {tp: min(entries) for tp, entries in self._open.items() if entries}
        for tp, offset in back.items():
            self._next[tp] = offset
            self._moved.add(tp)
        self._open.clear()
        return back

    def forget(self, keep: set[TopicPartition]) -> None:
        """Drop the partitions not in ``keep`` (moved to another worker in a rebalance)."""
        for tp in set(self._open) | set(self._next):
            if tp not in keep:
                self._open.pop(tp, None)
                self._next.pop(tp, None)
                self._moved.discard(tp)

    def commit_offsets(self) -> dict[TopicPartition, int]:
        """Per partition whose commit point moved since the last call: the offset to commit (its lowest
        open offset, or the highest polled + 1 when none is open). The caller commits them once the
        groups written before are durable."""
        out = {}
        for tp in self._moved:
            entries = self._open.get(tp)
            out[tp] = min(entries) if entries else self._next[tp]
        self._moved.clear()
        return out
