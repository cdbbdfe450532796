"""Atomic file replacement: the one way AstraFlow writes a small state file (positions, pointers,
process tables) that a crash must leave either old or new, never torn."""
from __future__ import annotations

import os
import uuid
from pathlib import Path


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` atomically: write a uniquely named temporary file in the same
    directory, fsync it, then ``os.replace`` it over ``path`` (POSIX rename is atomic within a file
    system). Concurrent writers never share a temporary file; the last rename wins.

    Raises:
        OSError: the directory does not exist or cannot be written (the temporary file is removed).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
