"""The topic catalog of the embedded ``local://`` bus (:mod:`topics.local`).

Each topic is a directory ``topics/<topic>/`` holding ``meta.json`` (partition count and
config) and one log and lock file per partition; :class:`Topics` creates, looks up and deletes
them. Also the config a new topic gets (:func:`topic_config`) and a partition's log start
offset (:func:`start_offset`, applying retention first when it is due).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Mapping

from topics.bus import BusError
from topics.local_files import now_ms, read_json
from topics.local_log import (DEFAULT_RETENTION_MS, Partition, maintenance_due, new_log_bytes, read_header,
                              rewrite_now)

_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


class Topics:
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
            meta = read_json(self.path(name) / "meta.json", None)
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

    def partition(self, name: str, p: int) -> Partition:
        return Partition(self.path(name), p)

    def create(self, name: str, partitions: int, config: dict[str, str]) -> None:
        """Create ``name`` atomically (build it aside, then rename); a no-op when it exists."""
        if partitions < 1:
            raise BusError(f"topic {name!r}: partitions must be >= 1, got {partitions}")
        final = self.path(name)
        if final.exists():
            return
        tmp = self.dir / f".new-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        header = new_log_bytes(0, 0, now_ms(), 0)
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


def topic_config(compacted: bool, retention_ms: int | None, config: Mapping[str, str] | None) -> dict[str, str]:
    """The config of a new topic: ``config`` over the defaults, then ``compacted`` and ``retention_ms``."""
    cfg = {"cleanup.policy": "delete", "retention.ms": str(DEFAULT_RETENTION_MS)}
    cfg.update({k: str(v) for k, v in (config or {}).items()})
    if compacted:
        cfg["cleanup.policy"] = "compact"
    if retention_ms is not None:
        cfg["retention.ms"] = str(retention_ms)
    return cfg


def start_offset(topics: Topics, topic: str, p: int) -> int:
    """The log start offset of a partition, applying retention first when it is due."""
    part = topics.partition(topic, p)
    cfg = topics.require(topic)["config"]
    try:
        fd = os.open(part.log, os.O_RDONLY)
        try:
            due = maintenance_due(fd, cfg, os.fstat(fd).st_size)[0]
        finally:
            os.close(fd)
        if due:
            rewrite_now(part, cfg, compact=False)
        fd = os.open(part.log, os.O_RDONLY)
    except FileNotFoundError:
        raise BusError(f"topic {topic!r} partition {p} does not exist (deleted?)") from None
    try:
        return read_header(fd)[0]
    finally:
        os.close(fd)
