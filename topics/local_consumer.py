"""The consumer of the embedded ``local://`` bus (:mod:`topics.local`).

:class:`LocalConsumer` reads partition logs (:class:`topics.local_log.Reader`) and, when
subscribed, is a member of its consumer group (:mod:`topics.local_groups`): it registers,
heartbeats and takes or releases partitions at each poll, by the rules in :mod:`topics.local`.
"""
from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING, Iterable, Mapping

from topics.bus import BusError, Consumer, Record, TopicPartition, offsets_after
from topics.local_files import now_ms
from topics.local_groups import HOST, Group, pid_alive, range_assign
from topics.local_log import Reader, offset_for_time
from topics.local_topics import start_offset

if TYPE_CHECKING:
    from topics.local import LocalBus

_POLL_SLEEP_S = 0.02


class LocalConsumer(Consumer):
    """Consumer of the embedded bus; a group member when subscribed (see :mod:`topics.local`).

    ``read_committed`` has no effect: aborted records are never written here, so there is nothing to filter.
    """

    def __init__(self, bus: "LocalBus", group: str | None, read_committed: bool, session_timeout_s: float,
                 client_id: str | None, instance_id: str | None = None):
        if session_timeout_s <= 0:
            raise BusError(f"session_timeout_s must be > 0, got {session_timeout_s}")
        self._bus = bus
        self.group = group
        self._session_ms = int(session_timeout_s * 1000)
        self._heartbeat_s = min(1.0, session_timeout_s / 4)
        self._check_s = min(0.25, self._heartbeat_s)     # how often to look for expired members
        self._member_id = f"{client_id or 'consumer'}-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._instance_id = instance_id
        self._group = Group(bus.root, group) if group is not None else None
        self._topics: list[str] | None = None            # subscribed topics (None: not subscribed)
        self._assigned = False
        self._readers: dict[TopicPartition, Reader] = {}
        self._pending: dict[TopicPartition, tuple[str, int]] = {}   # seeks awaiting assignment
        self._default_seek: tuple[str, int] | None = None   # seek for the first partitions assigned
        self._paused: set[TopicPartition] = set()
        self._signature: tuple[int, int] | None = None
        self._last_heartbeat = 0.0
        self._last_check = 0.0
        self._rotation = 0
        self._closed = False

    # -- membership

    def subscribe(self, topics: list[str]) -> None:
        """Join the group on ``topics``.

        Raises:
            BusError: no group, a topic name is invalid, or :meth:`assign` was used.
        """
        if self._group is None:
            raise BusError("subscribe needs a consumer group; use assign() for a consumer without one")
        if self._assigned:
            raise BusError(f"consumer {self._member_id} already uses assign(); it cannot also subscribe")
        for t in topics:
            self._bus._topics.path(t)
        self._topics = sorted(set(topics))
        self._sync(force=True)

    def assign(self, partitions: list[TopicPartition]) -> None:
        """Read exactly ``partitions`` from the group's committed offsets (or the beginning).

        Raises:
            BusError: the consumer already subscribed.
        """
        if self._topics is not None:
            raise BusError(f"consumer {self._member_id} is subscribed; it cannot also assign()")
        self._assigned = True
        wanted = {TopicPartition(*tp) for tp in partitions}
        for tp in set(self._readers) - wanted:
            self._readers.pop(tp).close()
        self._take(wanted - set(self._readers))

    def assignment(self) -> list[TopicPartition]:
        return sorted(self._readers)

    def _take(self, partitions: Iterable[TopicPartition], committed: dict[str, dict[str, int]] | None = None) -> None:
        """Start reading ``partitions``: at a pending seek, else the committed offset, else the log start."""
        partitions = list(partitions)
        if not partitions:
            return
        if committed is None:
            committed = self._group.read_offsets() if self._group is not None else {}
        if self._default_seek is not None:
            for tp in partitions:
                self._pending.setdefault(tp, self._default_seek)
            self._default_seek = None
        for tp in partitions:
            self._bus._topics.require(tp.topic)
            offset = committed.get(tp.topic, {}).get(str(tp.partition))
            if tp in self._pending:
                offset = self._resolve_seek(tp, *self._pending.pop(tp))
            if offset is None:
                offset = start_offset(self._bus._topics, tp.topic, tp.partition)
            self._readers[tp] = Reader(self._bus._topics.partition(*tp), offset)

    def _drop(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            reader = self._readers.pop(tp, None)
            if reader is not None:
                reader.close()
            self._paused.discard(tp)

    def _sync(self, force: bool = False) -> None:
        """Heartbeat, expire dead members, recompute the assignment, release lost and take free partitions.

        Cheap (one stat) unless forced, the group state changed on disk, or a check or heartbeat is due.
        """
        if self._topics is None or self._closed:
            return
        now = time.monotonic()
        signature = self._group.state_signature()
        due = now - self._last_heartbeat >= self._heartbeat_s
        if not (force or due or signature != self._signature or now - self._last_check >= self._check_s):
            return
        self._last_check = now
        with self._group.locked():
            state = self._group.read_state()
            members: dict[str, dict] = state["members"]
            wall_ms = now_ms()
            dirty = False
            me = members.get(self._member_id)
            if self._member_id in state.get("fenced", []):
                raise BusError(f"consumer {self._member_id} of group {self.group} was fenced: another process "
                               f"joined as static member {self._instance_id!r}")
            if me is None:                          # joining, or expired by the others: start afresh
                self._drop(list(self._readers))
                me = members[self._member_id] = {"pid": os.getpid(), "host": HOST, "owned": [],
                                                 "session_ms": self._session_ms, "heartbeat_ms": wall_ms,
                                                 "instance": self._instance_id}
                if self._instance_id is not None:   # static membership: replace the earlier holder at once
                    for mid, m in list(members.items()):
                        if mid != self._member_id and m.get("instance") == self._instance_id:
                            del members[mid]
                            state["fenced"] = (state.get("fenced", []) + [mid])[-100:]
                dirty = True
            if me.get("topics") != self._topics:
                me["topics"] = self._topics
                dirty = True
            for mid, m in list(members.items()):
                if mid != self._member_id and (wall_ms - m["heartbeat_ms"] > m["session_ms"]
                                               or (m["host"] == HOST and not pid_alive(m["pid"]))):
                    del members[mid]
                    dirty = True
            counts = {}
            for t in {t for m in members.values() for t in m["topics"]}:
                meta = self._bus._topics.meta(t)
                if meta is not None:
                    counts[t] = meta["partitions"]
            target = range_assign(members, counts)
            if target != state["assignment"]:
                state["assignment"] = target
                state["generation"] += 1
                dirty = True
            mine = {TopicPartition(t, p) for t, p in target[self._member_id]}
            owned = {TopicPartition(t, p) for t, p in me["owned"]}
            taken_by_others = {TopicPartition(t, p) for mid, m in members.items() if mid != self._member_id
                               for t, p in m["owned"]}
            release = owned - mine
            take = {tp for tp in mine - owned if tp not in taken_by_others}
            if release or take:
                me["owned"] = sorted([t, p] for t, p in (owned - release) | take)
                dirty = True
            if dirty or due:
                me["heartbeat_ms"] = wall_ms
                self._group.write_state(state)
                self._last_heartbeat = now
            self._signature = self._group.state_signature()
            committed = self._group.read_offsets() if take else {}
        self._drop(release | (set(self._readers) - owned - take))
        self._take(take, committed)

    # -- reading

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records from the assigned, unpaused partitions, waiting up to ``timeout_s`` s."""
        if self._closed:
            raise BusError(f"consumer {self._member_id} is closed")
        deadline = time.monotonic() + timeout_s
        while True:
            self._sync()
            out: list[Record] = []
            active = [tp for tp in sorted(self._readers) if tp not in self._paused]
            if active:
                self._rotation = (self._rotation + 1) % len(active)
                for tp in active[self._rotation:] + active[:self._rotation]:
                    out.extend(self._readers[tp].read(tp.topic, tp.partition, max_records - len(out)))
                    if len(out) >= max_records:
                        break
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                return out
            time.sleep(min(_POLL_SLEEP_S, remaining))

    def commit(self, offsets: Mapping[TopicPartition, int] | Iterable[Record]) -> None:
        """Commit synchronously.

        Raises:
            BusError: no group, or (when subscribed) this member does not own one of the partitions now.
        """
        if self._group is None:
            raise BusError("commit needs a consumer group")
        if isinstance(offsets, Mapping):
            todo = {TopicPartition(*tp): int(o) for tp, o in offsets.items()}
        else:
            todo = offsets_after(offsets)
        if not todo:
            return
        with self._group.locked():
            if self._topics is not None:
                me = self._group.read_state()["members"].get(self._member_id)
                owned = {TopicPartition(t, p) for t, p in me["owned"]} if me else set()
                lost = sorted(set(todo) - owned)
                if lost:
                    raise BusError(f"commit refused for group {self.group!r}: member {self._member_id} no longer "
                                   f"owns {lost} (rebalanced); those records will be delivered again")
            stored = self._group.read_offsets()
            for tp, off in todo.items():
                stored.setdefault(tp.topic, {})[str(tp.partition)] = off
            self._group.write_offsets(stored)

    def committed(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        stored = self._group.read_offsets() if self._group is not None else {}
        return {TopicPartition(*tp): stored.get(tp[0], {}).get(str(tp[1])) for tp in partitions}

    def pause(self, partitions: list[TopicPartition]) -> None:
        self._paused.update(TopicPartition(*tp) for tp in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self._paused.difference_update(TopicPartition(*tp) for tp in partitions)

    # -- seeking

    def _resolve_seek(self, tp: TopicPartition, kind: str, value: int) -> int:
        if kind == "offset":
            return value
        if kind == "beginning":
            return start_offset(self._bus._topics, tp.topic, tp.partition)
        part = self._bus._topics.partition(*tp)
        return offset_for_time(part, value, self._bus._tails.end_offset(part))

    def _seek(self, tp: TopicPartition, kind: str, value: int) -> None:
        tp = TopicPartition(*tp)
        if tp in self._readers:
            self._readers[tp].close()
            self._readers[tp] = Reader(self._bus._topics.partition(*tp), self._resolve_seek(tp, kind, value))
        else:
            self._pending[tp] = (kind, value)

    def _seek_many(self, partitions: list[TopicPartition] | None, kind: str, value: int) -> None:
        if partitions is None and not self._readers:
            self._default_seek = (kind, value)      # nothing assigned yet: apply to the first assignment
            return
        for tp in (self.assignment() if partitions is None else partitions):
            self._seek(tp, kind, value)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._seek(tp, "offset", offset)

    def seek_to_beginning(self, partitions: list[TopicPartition] | None = None) -> None:
        """Read from the log start offset; with None and nothing assigned yet, applies to the first assignment."""
        self._seek_many(partitions, "beginning", 0)

    def seek_to_timestamp(self, timestamp_ms: int, partitions: list[TopicPartition] | None = None) -> None:
        """Read from the first record with timestamp >= ``timestamp_ms`` (the end when none); with None and
        nothing assigned yet, applies to the first assignment."""
        self._seek_many(partitions, "timestamp", timestamp_ms)

    def position(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        return {tp: (self._readers[tp].next_offset if tp in self._readers else None) for tp in partitions}

    def lag(self) -> dict[TopicPartition, int]:
        committed = self.committed(self.assignment())
        out = {}
        for tp, off in committed.items():
            end = self._bus._tails.end_offset(self._bus._topics.partition(*tp))
            out[tp] = end - (off if off is not None else start_offset(self._bus._topics, tp.topic, tp.partition))
        return out

    def close(self) -> None:
        """Leave the group (the others rebalance at their next poll); nothing is committed."""
        if self._closed:
            return
        self._drop(list(self._readers))
        if self._topics is not None:
            with self._group.locked():
                state = self._group.read_state()
                if state["members"].pop(self._member_id, None) is not None:
                    self._group.write_state(state)
        self._closed = True
