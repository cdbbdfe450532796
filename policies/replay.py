"""``replay``: a bounded pool of served groups mixed back into batches (DESIGN.md, step 8).

The serving stage (:class:`consumers.serving.ServingStage`) assembles a batch of
``n`` groups at trainer version ``v`` from ``n - round(ratio * n)`` fresh groups
and the pool::

    batch = fresh_groups + replay.sample(round(ratio * n), v)
    replay.add(fresh_groups, v)

Unlike the original replay buffers, the pool enforces ``max_staleness``: a
group whose staleness ``v - min_version`` exceeds it is evicted and never served.
Left out, it is the trained policy's ``policies.<p>.max_staleness`` (the serving
stage sets it); a value above that bound is refused.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable

import numpy as np

from policies.base import PolicyConfigError, ServingPolicy
from policies.staleness import too_stale
from policies.registry import register_policy
from topics.codec import decode, encode
from topics.schemas import TrajectoryGroup


@register_policy("replay")
class Replay(ServingPolicy):
    """A FIFO pool of at most ``capacity`` groups; a fraction ``ratio`` of each batch comes from it.

    Args:
        capacity: the most groups the pool holds; the oldest added is evicted first.
        ratio: r, the fraction of each batch served from the pool, in [0, 1).
        max_staleness: groups more than this many versions old are evicted (versions); None: the bound the
            serving stage gives (the policy's ``max_staleness``), and until then none.
        seed: seed of the uniform draws from the pool.

    Raises:
        PolicyConfigError: ``capacity < 1``, ``ratio`` outside [0, 1) or ``max_staleness < 0``.
    """

    def __init__(self, capacity: int = 10000, ratio: float = 0.25, max_staleness: int | None = None, seed: int = 0):
        if int(capacity) < 1:
            raise PolicyConfigError("replay", f"must be >= 1 groups, got {capacity}", param="capacity")
        if not 0.0 <= float(ratio) < 1.0:
            raise PolicyConfigError("replay", f"must be in [0, 1), got {ratio}", param="ratio")
        if max_staleness is not None and int(max_staleness) < 0:
            raise PolicyConfigError("replay", f"must be >= 0 versions, got {max_staleness}", param="max_staleness")
        self.capacity, self.ratio = int(capacity), float(ratio)
        self.max_staleness = None if max_staleness is None else int(max_staleness)
        self.rng = np.random.default_rng(seed)
        self.pool: deque[TrajectoryGroup] = deque()
        self.evicted_stale = 0

    def __len__(self) -> int:
        return len(self.pool)

    def _fresh(self, group: TrajectoryGroup, version: int) -> bool:
        return self.max_staleness is None or not too_stale(group.min_version, version, self.max_staleness)

    def _evict_stale(self, version: int) -> None:
        fresh = [g for g in self.pool if self._fresh(g, version)]
        self.evicted_stale += len(self.pool) - len(fresh)
        self.pool = deque(fresh)

    def add(self, groups: Iterable[TrajectoryGroup], version: int) -> None:
        self._evict_stale(version)
        for g in groups:
            if self._fresh(g, version):
                self.pool.append(g)
        while len(self.pool) > self.capacity:
            self.pool.popleft()

    def sample(self, n: int, version: int) -> list[TrajectoryGroup]:
        """Up to ``n`` distinct pool groups, uniformly at random, none staler than ``max_staleness``."""
        self._evict_stale(version)
        k = min(n, len(self.pool))
        if k <= 0:
            return []
        idx = self.rng.choice(len(self.pool), size=k, replace=False)
        return [self.pool[i] for i in idx]

    def state_dict(self) -> dict[str, Any]:
        return {"pool": [encode(g) for g in self.pool], "evicted_stale": self.evicted_stale,
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool = deque(decode(b, expect=TrajectoryGroup, topic="replay.state") for b in state["pool"])
        self.evicted_stale = int(state["evicted_stale"])
        self.rng.bit_generator.state = state["rng"]
