"""Partition logs of the embedded ``local://`` bus (:mod:`topics.local`): frame format and log file I/O.

A log file starts with a 40-byte header (magic, log start offset, next-offset
hint, time of the last compaction in ms, size after it in bytes), followed by
frames: ``<u32 body length, i64 offset, i64 timestamp_ms>`` then a msgpack body
``[key, headers, value]``. :class:`Appender` writes frames, :class:`Reader` reads
them, :class:`Tails` finds end offsets, and :func:`rewrite_now` (or an append when
due) applies retention and compaction by rewriting the log. The concurrency,
durability and retention rules are in :mod:`topics.local`.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterator

import msgpack

from topics.bus import BusError, Record
from topics.local_files import flocked, now_ms

#: Defaults for topic configs the embedded bus reads (strings, as Kafka reports them).
DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
DEFAULT_SEGMENT_MS = 3600 * 1000
DEFAULT_DIRTY_RATIO = 0.5
DEFAULT_DELETE_RETENTION_MS = 24 * 3600 * 1000
#: Dirty bytes that make compaction due regardless of ``segment.ms``.
COMPACT_DIRTY_BYTES = 16 * 1024 * 1024

_MAGIC = b"AFLOG\x00\x01\x00"
_HEADER = struct.Struct("<8sqqqq")   # magic, start offset, next-offset hint, last compaction ms, clean bytes
_FRAME = struct.Struct("<Iqq")       # body length, offset, timestamp_ms
_READ_CHUNK = 1 << 20


def read_header(fd: int) -> tuple[int, int, int, int]:
    """(start offset, next-offset hint, last compaction ms, clean bytes) of an open log."""
    raw = os.pread(fd, _HEADER.size, 0)
    if len(raw) != _HEADER.size or raw[:8] != _MAGIC:
        raise BusError(f"log file (fd {fd}) has no valid header: not an AstraFlow partition log")
    return _HEADER.unpack(raw)[1:]


def new_log_bytes(start: int, next_hint: int, compacted_ms: int, body_size: int) -> bytes:
    """The header of a log whose frames after it take ``body_size`` bytes."""
    return _HEADER.pack(_MAGIC, start, next_hint, compacted_ms, _HEADER.size + body_size)


def _scan(fd: int, pos: int, size: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield (position, body length, offset, timestamp_ms) of each complete frame from ``pos`` to ``size``."""
    while pos + _FRAME.size <= size:
        n, off, ts = _FRAME.unpack(os.pread(fd, _FRAME.size, pos))
        if pos + _FRAME.size + n > size:
            return
        yield pos, n, off, ts
        pos += _FRAME.size + n


def _tail(fd: int, pos: int, next_offset: int) -> tuple[int, int]:
    """From a known frame boundary ``pos``: (end of the last complete frame, next offset)."""
    size = os.fstat(fd).st_size
    for fpos, n, off, _ in _scan(fd, pos, size):
        pos, next_offset = fpos + _FRAME.size + n, max(next_offset, off + 1)
    return pos, next_offset


def _encode_frame(offset: int, ts: int, key: bytes | None, headers: dict[str, bytes], value: bytes | None) -> bytes:
    body = msgpack.packb([key, headers, value], use_bin_type=True)
    return _FRAME.pack(len(body), offset, ts) + body


class Partition:
    """Paths of one partition's log and lock."""

    def __init__(self, topic_dir: Path, partition: int):
        self.log = topic_dir / f"{partition}.log"
        self.lock = topic_dir / f"{partition}.lock"


class Tails:
    """Per-process cache of where each log ends, so end offsets scan only new frames."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[int, int, int]] = {}   # path -> (inode, end pos, next offset)

    def end_offset(self, part: Partition) -> int:
        try:
            fd = os.open(part.log, os.O_RDONLY)
        except FileNotFoundError:
            raise BusError(f"partition log {part.log} does not exist (topic deleted?)") from None
        try:
            ino = os.fstat(fd).st_ino
            cached = self._cache.get(part.log)
            if cached is None or cached[0] != ino:
                _, hint, _, _ = read_header(fd)
                cached = (ino, _HEADER.size, hint)
            pos, nxt = _tail(fd, cached[1], cached[2])
            self._cache[part.log] = (ino, pos, nxt)
            return nxt
        finally:
            os.close(fd)


def _rewrite(part: Partition, fd: int, cfg: dict[str, str], compact: bool) -> None:
    """Apply retention (and compaction when ``compact``) to a log; the caller holds its lock."""
    start, hint, compacted_ms, _ = read_header(fd)
    end, nxt = _tail(fd, _HEADER.size, hint)
    now = now_ms()
    frames = list(_scan(fd, _HEADER.size, end))
    keep = [True] * len(frames)
    policy = cfg.get("cleanup.policy", "delete")
    if compact:
        latest: dict[bytes | None, int] = {}
        tombstones: set[int] = set()
        horizon = now - int(cfg.get("delete.retention.ms", DEFAULT_DELETE_RETENTION_MS))
        for i, (fpos, n, _, ts) in enumerate(frames):
            key, _, value = msgpack.unpackb(os.pread(fd, n, fpos + _FRAME.size), raw=False)
            if key in latest:
                keep[latest[key]] = False
            latest[key] = i
            if value is None and ts < horizon:
                tombstones.add(i)
        for i in tombstones:
            keep[i] = False
        compacted_ms = now
    if "delete" in policy and int(cfg.get("retention.ms", DEFAULT_RETENTION_MS)) >= 0:
        cutoff = now - int(cfg.get("retention.ms", DEFAULT_RETENTION_MS))
        for i, (_, _, off, ts) in enumerate(frames):
            if ts >= cutoff:
                break
            keep[i] = False
            start = off + 1
    kept = [f for f, k in zip(frames, keep) if k]
    if "compact" not in policy:
        start = kept[0][2] if kept else nxt
    body_size = sum(_FRAME.size + n for _, n, _, _ in kept)
    tmp = part.log.with_name(part.log.name + ".rewrite")
    with open(tmp, "wb") as out:
        out.write(new_log_bytes(start, nxt, compacted_ms, body_size))
        for fpos, n, _, _ in kept:
            out.write(os.pread(fd, _FRAME.size + n, fpos))
    os.replace(tmp, part.log)


def rewrite_now(part: Partition, cfg: dict[str, str], compact: bool) -> None:
    """Apply retention (and compaction when ``compact``) to a partition's log now, under its lock.

    Raises:
        FileNotFoundError: the log does not exist (topic deleted).
    """
    with flocked(part.lock):
        fd = os.open(part.log, os.O_RDONLY)
        try:
            _rewrite(part, fd, cfg, compact=compact)
        finally:
            os.close(fd)


def maintenance_due(fd: int, cfg: dict[str, str], end: int) -> tuple[bool, bool]:
    """(retention due, compaction due) for an open log whose complete frames end at ``end``."""
    policy = cfg.get("cleanup.policy", "delete")
    retention_due = compaction_due = False
    if "delete" in policy:
        retention = int(cfg.get("retention.ms", DEFAULT_RETENTION_MS))
        first = os.pread(fd, _FRAME.size, _HEADER.size)
        if retention >= 0 and len(first) == _FRAME.size and end > _HEADER.size:
            retention_due = _FRAME.unpack(first)[2] < now_ms() - retention
    if "compact" in policy:
        _, _, compacted_ms, clean = read_header(fd)
        dirty = end - clean
        total = end - _HEADER.size
        ratio = float(cfg.get("min.cleanable.dirty.ratio", DEFAULT_DIRTY_RATIO))
        if total > 0 and dirty > 0 and dirty / total >= ratio:
            elapsed = now_ms() - compacted_ms >= int(cfg.get("segment.ms", DEFAULT_SEGMENT_MS))
            compaction_due = elapsed or dirty >= COMPACT_DIRTY_BYTES
    return retention_due, compaction_due


class Appender:
    """Appends frames to one partition log; remembers where the log ends between calls."""

    def __init__(self, part: Partition):
        self.part = part
        self.fd: int | None = None
        self.ino = -1
        self.end = _HEADER.size
        self.next_offset = 0

    def append(self, records: list[tuple[bytes | None, dict[str, bytes], bytes | None]],
               cfg: dict[str, str]) -> None:
        """Append ``records`` (key, headers, value) under the partition lock.

        Raises:
            FileNotFoundError: the topic was deleted.
            OSError: the write failed (disk full, ...).
        """
        with flocked(self.part.lock):
            ino = os.stat(self.part.log).st_ino
            if self.fd is None or ino != self.ino:
                self.close()
                self.fd = os.open(self.part.log, os.O_RDWR | os.O_APPEND)
                self.ino = os.fstat(self.fd).st_ino
                self.end, self.next_offset = _HEADER.size, read_header(self.fd)[1]
            self.end, self.next_offset = _tail(self.fd, self.end, self.next_offset)
            if os.fstat(self.fd).st_size != self.end:      # a writer died mid-frame: drop the torn tail
                os.ftruncate(self.fd, self.end)
            ts = now_ms()
            data = b"".join(_encode_frame(self.next_offset + i, ts, k, h, v) for i, (k, h, v) in enumerate(records))
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            self.end += len(data)
            self.next_offset += len(records)
            retention_due, compaction_due = maintenance_due(self.fd, cfg, self.end)
            if retention_due or compaction_due:
                _rewrite(self.part, self.fd, cfg, compact=compaction_due)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Reader:
    """Reads one partition's frames sequentially from a remembered file position."""

    def __init__(self, part: Partition, offset: int):
        self.part = part
        self.next_offset = offset
        self.fd: int | None = None
        self.ino = -1
        self.pos = _HEADER.size

    def _open(self) -> bool:
        self.close()
        try:
            self.fd = os.open(self.part.log, os.O_RDONLY)
        except FileNotFoundError:
            return False
        self.ino = os.fstat(self.fd).st_ino
        self.pos = _HEADER.size
        for fpos, n, off, _ in _scan(self.fd, _HEADER.size, os.fstat(self.fd).st_size):
            if off >= self.next_offset:
                break
            self.pos = fpos + _FRAME.size + n
        return True

    def read(self, topic: str, partition: int, max_records: int) -> list[Record]:
        """Up to ``max_records`` records at or after ``next_offset``; [] when none are complete yet."""
        if self.fd is None and not self._open():
            return []
        out = self._read_frames(topic, partition, max_records)
        if not out:
            try:
                replaced = os.stat(self.part.log).st_ino != self.ino
            except FileNotFoundError:
                replaced = False
            if replaced and self._open():         # retention or compaction rewrote the log
                out = self._read_frames(topic, partition, max_records)
        return out

    def _read_frames(self, topic: str, partition: int, max_records: int) -> list[Record]:
        assert self.fd is not None
        out: list[Record] = []
        while len(out) < max_records:
            data = os.pread(self.fd, _READ_CHUNK, self.pos)
            i = 0
            while len(out) < max_records and i + _FRAME.size <= len(data):
                n, off, ts = _FRAME.unpack_from(data, i)
                end = i + _FRAME.size + n
                if end > len(data):
                    if i > 0:
                        break
                    data = os.pread(self.fd, _FRAME.size + n, self.pos)   # one frame larger than a chunk
                    if len(data) < _FRAME.size + n:
                        break                                             # still being written
                    end = len(data)
                if off >= self.next_offset:
                    key, headers, value = msgpack.unpackb(data[i + _FRAME.size:end], raw=False)
                    out.append(Record(topic, partition, off, key, value, headers, ts))
                    self.next_offset = off + 1
                i = end
            if i == 0:
                break
            self.pos += i
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def offset_for_time(part: Partition, timestamp_ms: int, end: int) -> int:
    """The first offset whose timestamp is >= ``timestamp_ms``; ``end`` when there is none."""
    try:
        fd = os.open(part.log, os.O_RDONLY)
    except FileNotFoundError:
        raise BusError(f"partition log {part.log} does not exist (topic deleted?)") from None
    try:
        for _, _, off, ts in _scan(fd, _HEADER.size, os.fstat(fd).st_size):
            if ts >= timestamp_ms:
                return off
        return end
    finally:
        os.close(fd)
