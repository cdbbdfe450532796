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
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import struct
import threading
import time
import uuid
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Mapping
from urllib.parse import quote

import msgpack

from topics.bus import (Admin, Bus, BusError, Consumer, DeliveryError, Headers, Producer, Record,
                        TopicInfo, TopicPartition, offsets_after)

#: Largest value (bytes) the embedded bus accepts; larger ones raise BusError at send.
MAX_VALUE_BYTES = 64 * 1024 * 1024
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
_POLL_SLEEP_S = 0.02
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_HOST = socket.gethostname()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@contextmanager
def _flocked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (which must exist; FileNotFoundError otherwise)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_json(path: Path, obj: object) -> None:
    """Replace ``path`` atomically with ``obj`` as JSON."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


def _read_json(path: Path, default: object) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


def _as_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


# --------------------------------------------------------------------------- log files


def _read_header(fd: int) -> tuple[int, int, int, int]:
    """(start offset, next-offset hint, last compaction ms, clean bytes) of an open log."""
    raw = os.pread(fd, _HEADER.size, 0)
    if len(raw) != _HEADER.size or raw[:8] != _MAGIC:
        raise BusError(f"log file (fd {fd}) has no valid header: not an AstraFlow partition log")
    return _HEADER.unpack(raw)[1:]


def _new_log_bytes(start: int, next_hint: int, compacted_ms: int, body_size: int) -> bytes:
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


class _Partition:
    """Paths of one partition's log and lock."""

    def __init__(self, topic_dir: Path, partition: int):
        self.log = topic_dir / f"{partition}.log"
        self.lock = topic_dir / f"{partition}.lock"


class _Tails:
    """Per-process cache of where each log ends, so end offsets scan only new frames."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[int, int, int]] = {}   # path -> (inode, end pos, next offset)

    def end_offset(self, part: _Partition) -> int:
        try:
            fd = os.open(part.log, os.O_RDONLY)
        except FileNotFoundError:
            raise BusError(f"partition log {part.log} does not exist (topic deleted?)") from None
        try:
            ino = os.fstat(fd).st_ino
            cached = self._cache.get(part.log)
            if cached is None or cached[0] != ino:
                _, hint, _, _ = _read_header(fd)
                cached = (ino, _HEADER.size, hint)
            pos, nxt = _tail(fd, cached[1], cached[2])
            self._cache[part.log] = (ino, pos, nxt)
            return nxt
        finally:
            os.close(fd)


def _rewrite(part: _Partition, fd: int, cfg: dict[str, str], compact: bool) -> None:
    """Apply retention (and compaction when ``compact``) to a log; the caller holds its lock."""
    start, hint, compacted_ms, _ = _read_header(fd)
    end, nxt = _tail(fd, _HEADER.size, hint)
    now = _now_ms()
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
        out.write(_new_log_bytes(start, nxt, compacted_ms, body_size))
        for fpos, n, _, _ in kept:
            out.write(os.pread(fd, _FRAME.size + n, fpos))
    os.replace(tmp, part.log)


def _maintenance_due(fd: int, cfg: dict[str, str], end: int) -> tuple[bool, bool]:
    """(retention due, compaction due) for an open log whose complete frames end at ``end``."""
    policy = cfg.get("cleanup.policy", "delete")
    retention_due = compaction_due = False
    if "delete" in policy:
        retention = int(cfg.get("retention.ms", DEFAULT_RETENTION_MS))
        first = os.pread(fd, _FRAME.size, _HEADER.size)
        if retention >= 0 and len(first) == _FRAME.size and end > _HEADER.size:
            retention_due = _FRAME.unpack(first)[2] < _now_ms() - retention
    if "compact" in policy:
        _, _, compacted_ms, clean = _read_header(fd)
        dirty = end - clean
        total = end - _HEADER.size
        ratio = float(cfg.get("min.cleanable.dirty.ratio", DEFAULT_DIRTY_RATIO))
        if total > 0 and dirty > 0 and dirty / total >= ratio:
            elapsed = _now_ms() - compacted_ms >= int(cfg.get("segment.ms", DEFAULT_SEGMENT_MS))
            compaction_due = elapsed or dirty >= COMPACT_DIRTY_BYTES
    return retention_due, compaction_due


class _Appender:
    """Appends frames to one partition log; remembers where the log ends between calls."""

    def __init__(self, part: _Partition):
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
        with _flocked(self.part.lock):
            ino = os.stat(self.part.log).st_ino
            if self.fd is None or ino != self.ino:
                self.close()
                self.fd = os.open(self.part.log, os.O_RDWR | os.O_APPEND)
                self.ino = os.fstat(self.fd).st_ino
                self.end, self.next_offset = _HEADER.size, _read_header(self.fd)[1]
            self.end, self.next_offset = _tail(self.fd, self.end, self.next_offset)
            if os.fstat(self.fd).st_size != self.end:      # a writer died mid-frame: drop the torn tail
                os.ftruncate(self.fd, self.end)
            ts = _now_ms()
            data = b"".join(_encode_frame(self.next_offset + i, ts, k, h, v) for i, (k, h, v) in enumerate(records))
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            self.end += len(data)
            self.next_offset += len(records)
            retention_due, compaction_due = _maintenance_due(self.fd, cfg, self.end)
            if retention_due or compaction_due:
                _rewrite(self.part, self.fd, cfg, compact=compaction_due)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Reader:
    """Reads one partition's frames sequentially from a remembered file position."""

    def __init__(self, part: _Partition, offset: int):
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


# --------------------------------------------------------------------------- topics


class _Topics:
    """Topic metadata on disk, with a per-process cache (partition counts never change)."""

    def __init__(self, root: Path):
        self.dir = root / "topics"
        self.trash = root / "trash"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trash.mkdir(parents=True, exist_ok=True)
        self._meta: dict[str, dict] = {}

    def path(self, name: str) -> Path:
        if not _TOPIC_NAME.match(name) or name in (".", ".."):
            raise BusError(f"topic name {name!r} may only hold 1-249 letters, digits, '.', '_' and '-'")
        return self.dir / name

    def meta(self, name: str, fresh: bool = False) -> dict | None:
        """{"partitions": n, "config": {...}} of ``name``, or None when it does not exist.

        ``fresh`` reads the disk instead of this process's cache (another process may have deleted it).
        """
        meta = None if fresh else self._meta.get(name)
        if meta is None:
            meta = _read_json(self.path(name) / "meta.json", None)
            if meta is None:
                self._meta.pop(name, None)
            else:
                self._meta[name] = meta
        return meta

    def require(self, name: str, fresh: bool = False) -> dict:
        meta = self.meta(name, fresh)
        if meta is None:
            raise BusError(f"topic {name!r} does not exist")
        return meta

    def forget(self, name: str) -> None:
        self._meta.pop(name, None)

    def partition(self, name: str, p: int) -> _Partition:
        return _Partition(self.path(name), p)

    def create(self, name: str, partitions: int, config: dict[str, str]) -> None:
        """Create ``name`` atomically (build it aside, then rename); a no-op when it exists."""
        if partitions < 1:
            raise BusError(f"topic {name!r}: partitions must be >= 1, got {partitions}")
        final = self.path(name)
        if final.exists():
            return
        tmp = self.dir / f".new-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        header = _new_log_bytes(0, 0, _now_ms(), 0)
        for p in range(partitions):
            (tmp / f"{p}.log").write_bytes(header)
            (tmp / f"{p}.lock").touch()
        (tmp / "meta.json").write_text(json.dumps({"partitions": partitions, "config": config}))
        try:
            os.rename(tmp, final)
        except OSError:          # created concurrently by another process
            shutil.rmtree(tmp, ignore_errors=True)

    def delete(self, name: str) -> None:
        final = self.path(name)
        aside = self.trash / f"{name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(final, aside)
        except FileNotFoundError:
            raise BusError(f"topic {name!r} does not exist") from None
        self.forget(name)
        shutil.rmtree(aside, ignore_errors=True)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.dir.iterdir() if not p.name.startswith(".") and (p / "meta.json").exists())


def _topic_config(compacted: bool, retention_ms: int | None, config: Mapping[str, str] | None) -> dict[str, str]:
    cfg = {"cleanup.policy": "delete", "retention.ms": str(DEFAULT_RETENTION_MS)}
    cfg.update({k: str(v) for k, v in (config or {}).items()})
    if compacted:
        cfg["cleanup.policy"] = "compact"
    if retention_ms is not None:
        cfg["retention.ms"] = str(retention_ms)
    return cfg


def _start_offset(topics: _Topics, topic: str, p: int) -> int:
    """The log start offset of a partition, applying retention first when it is due."""
    part = topics.partition(topic, p)
    cfg = topics.require(topic)["config"]
    try:
        fd = os.open(part.log, os.O_RDONLY)
        try:
            due = _maintenance_due(fd, cfg, os.fstat(fd).st_size)[0]
        finally:
            os.close(fd)
        if due:
            with _flocked(part.lock):
                fd = os.open(part.log, os.O_RDONLY)
                try:
                    _rewrite(part, fd, cfg, compact=False)
                finally:
                    os.close(fd)
        fd = os.open(part.log, os.O_RDONLY)
    except FileNotFoundError:
        raise BusError(f"topic {topic!r} partition {p} does not exist (deleted?)") from None
    try:
        return _read_header(fd)[0]
    finally:
        os.close(fd)


def _offset_for_time(part: _Partition, timestamp_ms: int, end: int) -> int:
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


# --------------------------------------------------------------------------- groups


class _Group:
    """A consumer group's files: state (members, generation, assignment) and committed offsets."""

    def __init__(self, root: Path, group: str):
        self.dir = root / "groups" / quote(group, safe="")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = self.dir / "lock"
        self.lock.touch(exist_ok=True)
        self.state_path = self.dir / "state.json"
        self.offsets_path = self.dir / "offsets.json"

    def locked(self):
        return _flocked(self.lock)

    def read_state(self) -> dict:
        return _read_json(self.state_path, {"generation": 0, "members": {}, "assignment": {}})

    def write_state(self, state: dict) -> None:
        _write_json(self.state_path, state)

    def read_offsets(self) -> dict[str, dict[str, int]]:
        return _read_json(self.offsets_path, {})

    def write_offsets(self, offsets: dict[str, dict[str, int]]) -> None:
        _write_json(self.offsets_path, offsets)

    def state_signature(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.state_path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _range_assign(members: dict[str, dict], counts: dict[str, int]) -> dict[str, list[list]]:
    """Kafka's range assignor: per topic, contiguous partition ranges over the sorted subscribed member ids."""
    out: dict[str, list[list]] = {mid: [] for mid in members}
    for topic, n in sorted(counts.items()):
        subs = sorted(mid for mid, m in members.items() if topic in m["topics"])
        if not subs:
            continue
        per, extra = divmod(n, len(subs))
        p = 0
        for i, mid in enumerate(subs):
            take = per + (1 if i < extra else 0)
            out[mid].extend([topic, q] for q in range(p, p + take))
            p += take
    return out


# --------------------------------------------------------------------------- clients


class LocalProducer(Producer):
    """Producer of the embedded bus: ``send`` appends at once (visible to readers immediately). Thread-safe."""

    def __init__(self, bus: "LocalBus", transactional_id: str | None):
        self._bus = bus
        self._transactional_id = transactional_id
        self._appenders: dict[TopicPartition, _Appender] = {}
        self._round_robin: dict[str, int] = {}
        self._failures: list[tuple[str, bytes | None, str]] = []
        self._txn: list[tuple[str, bytes | None, dict[str, bytes], bytes | None, int | None]] | None = None
        self._lock = threading.Lock()      # send may be called from several threads, as on Kafka

    def send(self, topic: str, value: bytes | None, key: str | bytes | None = None,
             headers: Headers | None = None, partition: int | None = None) -> None:
        """Append one record (buffered instead inside a transaction). A missing topic is created with 1 partition.

        Raises:
            BusError: the value exceeds MAX_VALUE_BYTES, the topic name is invalid, or ``partition`` is out of range.
        """
        if value is not None and len(value) > MAX_VALUE_BYTES:
            raise BusError(f"record for topic {topic!r}: value of {len(value)} bytes exceeds the embedded bus "
                           f"limit of {MAX_VALUE_BYTES} bytes")
        k = _as_bytes(key)
        h = {}
        for name, v in (headers or {}).items():
            if not isinstance(v, (str, bytes)):
                raise BusError(f"record for topic {topic!r}: header {name!r} must be str or bytes, not {type(v).__name__}")
            h[name] = _as_bytes(v)
        meta = self._bus._topics.meta(topic)
        count = meta["partitions"] if meta is not None else 1     # a missing topic is created with 1 partition
        if partition is not None and not 0 <= partition < count:
            raise BusError(f"topic {topic!r} has {count} partition(s); partition {partition} does not exist")
        with self._lock:
            if self._txn is not None:
                self._txn.append((topic, k, h, value, partition))
            else:
                self._append(topic, k, h, value, partition)

    def _append(self, topic: str, key: bytes | None, headers: dict[str, bytes], value: bytes | None,
                partition: int | None) -> None:
        topics = self._bus._topics
        for attempt in range(2):
            meta = topics.meta(topic)
            if meta is None:
                topics.create(topic, 1, _topic_config(False, None, None))
                meta = topics.require(topic)
            if key is None and "compact" in meta["config"].get("cleanup.policy", ""):
                self._failures.append((topic, key, "compacted topic requires a key"))
                return
            n = meta["partitions"]
            if partition is not None:
                p = partition
            elif key is not None:
                p = zlib.crc32(key) % n
            else:
                p = self._round_robin.get(topic, 0) % n
                self._round_robin[topic] = p + 1
            tp = TopicPartition(topic, p)
            appender = self._appenders.get(tp)
            if appender is None:
                appender = self._appenders[tp] = _Appender(topics.partition(topic, p))
            try:
                appender.append([(key, headers, value)], meta["config"])
                return
            except FileNotFoundError:               # deleted (maybe recreated) under us: refresh once
                topics.forget(topic)
                self._appenders.pop(tp).close()
                if attempt:
                    self._failures.append((topic, key, f"topic {topic!r} was deleted while producing"))
            except OSError as e:
                self._failures.append((topic, key, f"write failed: {e}"))
                return

    def flush(self, timeout_s: float = 30.0) -> None:
        """Records are already written by ``send``; raise the failures collected since the last flush.

        Inside a transaction the buffered records stay buffered until :meth:`commit_transaction`.

        Raises:
            DeliveryError: some records could not be appended (compacted topic without key, I/O error, ...).
        """
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise DeliveryError(failures)

    def begin_transaction(self) -> None:
        """Start buffering sent records.

        Raises:
            BusError: the producer has no ``transactional_id`` or a transaction is already open.
        """
        if self._transactional_id is None:
            raise BusError("begin_transaction needs a producer made with transactional_id")
        if self._txn is not None:
            raise BusError(f"transaction of {self._transactional_id!r} is already open")
        self._txn = []

    def commit_transaction(self, consumer: Consumer | None = None,
                           offsets: Mapping[TopicPartition, int] | None = None,
                           timeout_s: float = 30.0) -> None:
        """Append the buffered records, then commit ``offsets`` for ``consumer``'s group (at-least-once).

        Raises:
            BusError: no transaction is open, or the offset commit was refused (the records are then
                already visible: the input will be re-delivered and downstream de-duplication applies).
            DeliveryError: some buffered records could not be appended; offsets are not committed.
        """
        if self._txn is None:
            raise BusError("commit_transaction without begin_transaction")
        with self._lock:
            records, self._txn = self._txn, None
            for topic, k, h, v, p in records:
                self._append(topic, k, h, v, p)
        self.flush()
        if consumer is not None and offsets:
            consumer.commit(offsets)

    def abort_transaction(self, timeout_s: float = 30.0) -> None:
        """Drop the buffered records: they are never written.

        Raises:
            BusError: no transaction is open.
        """
        if self._txn is None:
            raise BusError("abort_transaction without begin_transaction")
        self._txn = None

    def close(self) -> None:
        """Release file descriptors; raises like :meth:`flush` when records failed."""
        for appender in self._appenders.values():
            appender.close()
        self._appenders.clear()
        self.flush()


class LocalConsumer(Consumer):
    """Consumer of the embedded bus; a group member when subscribed (see the module docstring)."""

    def __init__(self, bus: "LocalBus", group: str | None, read_committed: bool, session_timeout_s: float,
                 client_id: str | None, instance_id: str | None = None):
        if session_timeout_s <= 0:
            raise BusError(f"session_timeout_s must be > 0, got {session_timeout_s}")
        self._bus = bus
        self.group = group
        self._read_committed = read_committed   # aborted records are never written here: nothing to filter
        self._session_ms = int(session_timeout_s * 1000)
        self._heartbeat_s = min(1.0, session_timeout_s / 4)
        self._check_s = min(0.25, self._heartbeat_s)     # how often to look for expired members
        self._member_id = f"{client_id or 'consumer'}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._instance_id = instance_id
        self._group = _Group(bus.root, group) if group is not None else None
        self._topics: list[str] | None = None            # subscribed topics (None: not subscribed)
        self._assigned = False
        self._readers: dict[TopicPartition, _Reader] = {}
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
                offset = _start_offset(self._bus._topics, tp.topic, tp.partition)
            self._readers[tp] = _Reader(self._bus._topics.partition(*tp), offset)

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
            now_ms = _now_ms()
            dirty = False
            me = members.get(self._member_id)
            if self._member_id in state.get("fenced", []):
                raise BusError(f"consumer {self._member_id} of group {self.group} was fenced: another process "
                               f"joined as static member {self._instance_id!r}")
            if me is None:                          # joining, or expired by the others: start afresh
                self._drop(list(self._readers))
                me = members[self._member_id] = {"pid": os.getpid(), "host": _HOST, "owned": [],
                                                 "session_ms": self._session_ms, "heartbeat_ms": now_ms,
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
                if mid != self._member_id and (now_ms - m["heartbeat_ms"] > m["session_ms"]
                                               or (m["host"] == _HOST and not _pid_alive(m["pid"]))):
                    del members[mid]
                    dirty = True
            counts = {}
            for t in {t for m in members.values() for t in m["topics"]}:
                meta = self._bus._topics.meta(t)
                if meta is not None:
                    counts[t] = meta["partitions"]
            target = _range_assign(members, counts)
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
                me["heartbeat_ms"] = now_ms
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
            return _start_offset(self._bus._topics, tp.topic, tp.partition)
        part = self._bus._topics.partition(*tp)
        return _offset_for_time(part, value, self._bus._tails.end_offset(part))

    def _seek(self, tp: TopicPartition, kind: str, value: int) -> None:
        tp = TopicPartition(*tp)
        if tp in self._readers:
            self._readers[tp].close()
            self._readers[tp] = _Reader(self._bus._topics.partition(*tp), self._resolve_seek(tp, kind, value))
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

    def lag(self) -> dict[TopicPartition, int]:
        committed = self.committed(self.assignment())
        out = {}
        for tp, off in committed.items():
            end = self._bus._tails.end_offset(self._bus._topics.partition(*tp))
            out[tp] = end - (off if off is not None else _start_offset(self._bus._topics, tp.topic, tp.partition))
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
        self._bus._topics.create(name, partitions, _topic_config(compacted, retention_ms, config))

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
        return {p: _start_offset(self._bus._topics, topic, p)
                for p in range(self._bus._topics.require(topic, fresh=True)["partitions"])}

    def group_offsets(self, group: str, topic: str) -> dict[int, int | None]:
        stored = _Group(self._bus.root, group).read_offsets().get(topic, {})
        return {p: stored.get(str(p)) for p in range(self._bus._topics.require(topic, fresh=True)["partitions"])}

    def group_members(self, group: str) -> dict[str, list[TopicPartition]]:
        state = _Group(self._bus.root, group).read_state()
        now_ms = _now_ms()
        return {mid: sorted(TopicPartition(t, p) for t, p in m["owned"]) for mid, m in state["members"].items()
                if now_ms - m["heartbeat_ms"] <= m["session_ms"]}

    def compact(self, topic: str) -> None:
        """Compact (and apply retention to) every partition of ``topic`` now, whatever is due.

        Raises:
            BusError: the topic does not exist or is not compacted.
        """
        meta = self._bus._topics.require(topic, fresh=True)
        if "compact" not in meta["config"].get("cleanup.policy", ""):
            raise BusError(f"topic {topic!r} is not compacted (cleanup.policy={meta['config'].get('cleanup.policy')})")
        for p in range(meta["partitions"]):
            part = self._bus._topics.partition(topic, p)
            with _flocked(part.lock):
                fd = os.open(part.log, os.O_RDONLY)
                try:
                    _rewrite(part, fd, meta["config"], compact=True)
                finally:
                    os.close(fd)


class LocalBus(Bus):
    """The embedded bus rooted at directory ``path`` (created if missing)."""

    def __init__(self, path: str):
        if not path:
            raise BusError("local:// bus needs a directory path, e.g. local:///tmp/astraflow-bus")
        self.url = f"local://{path}"
        self.root = Path(path).expanduser()
        try:
            self._topics = _Topics(self.root)
        except OSError as e:
            raise BusError(f"local bus directory {self.root}: {e}") from e
        self._tails = _Tails()

    def producer(self, transactional_id: str | None = None) -> LocalProducer:
        return LocalProducer(self, transactional_id)

    def consumer(self, group: str | None, *, read_committed: bool = True,
                 session_timeout_s: float = 10.0, client_id: str | None = None,
                 instance_id: str | None = None) -> LocalConsumer:
        return LocalConsumer(self, group, read_committed, session_timeout_s, client_id, instance_id)

    def admin(self) -> LocalAdmin:
        return LocalAdmin(self)
