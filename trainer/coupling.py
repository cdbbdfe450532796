"""Version coupling across co-trained policies (DESIGN.md, "Multi-policy").

With ``coupling: independent`` each trainer advances as fast as its data
allows. With ``coupling: barrier`` the trainers move in lockstep: a trainer at
version ``v`` does not start step ``v + 1`` until every other policy has
announced version ``v`` on the ``weights`` topic. A peer that stops early (its
``steps`` is smaller) holds nobody back past its final version.

The barrier reads announcements only (``WeightAnnouncement``, partition 0 of the
compacted ``weights`` topic, from the beginning, no consumer group), so it works
across machines and survives restarts: a restarted trainer re-reads the newest
version of each peer.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Mapping

from topics.bus import Bus, TopicPartition
from topics.codec import MessageError, decode
from topics.names import TopicNames
from topics.schemas import WeightAnnouncement

log = logging.getLogger(__name__)


class VersionBarrier:
    """Waits until every peer policy has announced a version.

    Args:
        bus: the run's bus.
        names: the run's topic names.
        peers: peer policy -> the last version it will produce (its ``steps``);
            the policy this barrier belongs to is not a peer.

    Raises:
        ValueError: ``peers`` is empty or a final version is < 1.
    """

    def __init__(self, bus: Bus, names: TopicNames, peers: Mapping[str, int]):
        if not peers:
            raise ValueError("a version barrier needs at least one peer policy")
        bad = {p: s for p, s in peers.items() if s < 1}
        if bad:
            raise ValueError(f"version barrier: final versions must be >= 1, got {bad}")
        self.finals = dict(peers)
        self.newest = {p: 0 for p in peers}  # version 0 (the base model) needs no announcement
        bus.admin().create_topic(names.weights, partitions=1, compacted=True)
        self._consumer = bus.consumer(None, client_id=f"barrier-{'-'.join(sorted(peers))}")
        tp = TopicPartition(names.weights, 0)
        self._consumer.assign([tp])
        self._consumer.seek_to_beginning([tp])

    def poll(self, timeout_s: float = 0.0) -> dict[str, int]:
        """Read new announcements; returns peer -> newest announced version. Malformed ones are skipped."""
        for rec in self._consumer.poll(timeout_s=timeout_s):
            try:
                ann = decode(rec.value, WeightAnnouncement, topic=rec.topic, partition=rec.partition,
                             offset=rec.offset)
            except MessageError as e:
                log.warning("version barrier: skipping bad announcement: %s", e)
                continue
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
        self._consumer.close()
