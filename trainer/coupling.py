"""Version coupling across co-trained policies (DESIGN.md, "Multi-policy").

With ``coupling: independent`` each trainer advances as fast as its data
allows. With ``coupling: barrier`` the trainers move in lockstep: a trainer at
version ``v`` does not start step ``v + 1`` until every other policy has
announced version ``v`` on the ``weights`` topic. A peer that stops early (its
``steps`` is smaller) holds nobody back past its final version.

The barrier reads announcements only (``WeightAnnouncement`` s on the compacted
``weights`` topic, through a :class:`~topics.follow.Follower`: from the beginning,
no consumer group), so it works across machines and survives restarts: a
restarted trainer re-reads the newest version of each peer.
"""
from __future__ import annotations

import threading
import time
from typing import Mapping

from topics.bus import Bus
from topics.follow import Follower
from topics.layout import RunTopics
from topics.names import TopicNames
from topics.schemas import WeightAnnouncement


class VersionBarrier:
    """Waits until every peer policy has announced a version.

    Args:
        bus: the run's bus.
        names: the run's topic names.
        peers: peer policy -> the last version it will produce (its ``steps``);
            the policy this barrier belongs to is not a peer.

    Raises:
        ValueError: ``peers`` is empty or a final version is < 1.
        topics.bus.BusError: the ``weights`` topic cannot be created or read.
    """

    def __init__(self, bus: Bus, names: TopicNames, peers: Mapping[str, int]):
        if not peers:
            raise ValueError("a version barrier needs at least one peer policy")
        bad = {p: s for p, s in peers.items() if s < 1}
        if bad:
            raise ValueError(f"version barrier: final versions must be >= 1, got {bad}")
        self.finals = dict(peers)
        self.newest = {p: 0 for p in peers}  # version 0 (the base model) needs no announcement
        RunTopics(names).weights.create(bus.admin())
        self._announcements = Follower(bus, names.weights, WeightAnnouncement,
                                       client_id=f"barrier-{'-'.join(sorted(peers))}")

    def poll(self, timeout_s: float = 0.0) -> dict[str, int]:
        """Read new announcements, waiting up to ``timeout_s`` seconds for the first; returns peer -> newest
        announced version. Malformed ones are logged and skipped.

        Raises:
            topics.bus.BusError: the bus failed.
        """
        for _, ann in self._announcements.poll(timeout_s):
            if ann.policy in self.newest:
                self.newest[ann.policy] = max(self.newest[ann.policy], ann.version)
        return dict(self.newest)

    def behind(self, version: int) -> dict[str, int]:
        """Peers (-> their newest version) that have not yet reached ``min(version, their final version)``."""
        return {p: v for p, v in self.newest.items() if v < min(version, self.finals[p])}

    def wait(self, version: int, stop: threading.Event | None = None, poll_s: float = 0.5) -> float | None:
        """Block until every peer has announced ``version`` (or its final version).

        Args:
            version: the caller's current version ``v``; it is about to train ``v + 1``.
            stop: returns early (None) once set.
            poll_s: seconds per poll of the ``weights`` topic.

        Returns:
            Seconds waited, or None if ``stop`` was set first.

        Raises:
            topics.bus.BusError: the bus failed.
        """
        start = time.perf_counter()
        self.poll()
        while self.behind(version):
            if stop is not None and stop.is_set():
                return None
            self.poll(poll_s)
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop reading announcements."""
        self._announcements.close()
