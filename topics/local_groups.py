"""Consumer-group state of the embedded ``local://`` bus (:mod:`topics.local`) and partition assignment.

A group's files live under ``groups/<quoted group>/``: ``state.json`` (members, generation,
target assignment), ``offsets.json`` (committed offsets) and ``lock`` (:class:`Group`).
The membership rules are in :mod:`topics.local`; :class:`topics.local_consumer.LocalConsumer`
applies them under the group lock, with :func:`range_assign` for the target assignment and
:func:`pid_alive` to expire members whose process is gone.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import quote

from topics.local_files import flocked, read_json, write_json

#: This machine's name: a member on it whose process is gone is expired at once.
HOST = socket.gethostname()


class Group:
    """A consumer group's files: state (members, generation, assignment) and committed offsets."""

    def __init__(self, root: Path, group: str):
        self.dir = root / "groups" / quote(group, safe="")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = self.dir / "lock"
        self.lock.touch(exist_ok=True)
        self.state_path = self.dir / "state.json"
        self.offsets_path = self.dir / "offsets.json"

    def locked(self):
        return flocked(self.lock)

    def read_state(self) -> dict:
        return read_json(self.state_path, {"generation": 0, "members": {}, "assignment": {}})

    def write_state(self, state: dict) -> None:
        write_json(self.state_path, state)

    def read_offsets(self) -> dict[str, dict[str, int]]:
        return read_json(self.offsets_path, {})

    def write_offsets(self, offsets: dict[str, dict[str, int]]) -> None:
        write_json(self.offsets_path, offsets)

    def state_signature(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.state_path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (one this process may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def range_assign(members: dict[str, dict], counts: dict[str, int]) -> dict[str, list[list]]:
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
