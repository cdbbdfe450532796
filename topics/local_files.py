"""File primitives the embedded ``local://`` bus (:mod:`topics.local`) shares across its modules.

An exclusive ``flock(2)`` on a lock file, JSON files replaced atomically, and the wall clock in ms
(record timestamps, heartbeats, retention).
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from topics.atomic_write import atomic_write


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


@contextmanager
def flocked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (which must exist; FileNotFoundError otherwise)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_json(path: Path, obj: object) -> None:
    """Replace ``path`` atomically (:func:`topics.atomic_write.atomic_write`) with ``obj`` as JSON."""
    atomic_write(path, json.dumps(obj, sort_keys=True))


def read_json(path: Path, default: object) -> object:
    """The JSON value in ``path``, or ``default`` when the file does not exist."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
