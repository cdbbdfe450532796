"""``mix``: weighted sampling of groups across sources (DESIGN.md, step 9).

Groups are routed to per-source FIFO queues by a field of the group
(``source`` by default, or ``task_type``, ``policy``, ``workflow``); each
draw of :meth:`Mix.sample` picks a non-empty source with probability
proportional to its weight, then serves that source's oldest group.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Mapping

import numpy as np

from policies.base import PolicyConfigError, ServingPolicy
from policies.registry import register_policy
from topics.codec import decode, encode
from topics.schemas import TrajectoryGroup

_FIELDS = ("source", "task_type", "policy", "workflow")


@register_policy("mix")
class Mix(ServingPolicy):
    """Weighted sampling across sources.

    Args:
        weights: source name -> non-negative weight (at least one positive);
            the key ``"*"`` catches sources not named. Groups of an unnamed
            source with no ``"*"`` are not held (counted in ``unrouted``).
        by: the group field that names the source: source, task_type, policy or workflow.
        capacity: the most groups held per source; the oldest is dropped first.
        seed: seed of the source draws.

    Raises:
        PolicyConfigError: no weights, a negative weight, all weights zero, or an unknown ``by``.
    """

    def __init__(self, weights: Mapping[str, float], by: str = "source", capacity: int = 10000, seed: int = 0):
        if not isinstance(weights, Mapping) or not weights:
            raise PolicyConfigError("mix", "must map source names to weights", param="weights")
        if any(float(w) < 0 for w in weights.values()) or not any(float(w) > 0 for w in weights.values()):
            raise PolicyConfigError("mix", f"must be >= 0 with one > 0, got {dict(weights)}", param="weights")
        if by not in _FIELDS:
            raise PolicyConfigError("mix", f"must be one of {', '.join(_FIELDS)}, got {by!r}", param="by")
        self.weights = {str(k): float(v) for k, v in weights.items()}
        self.by, self.capacity = by, int(capacity)
        self.rng = np.random.default_rng(seed)
        self.queues: dict[str, deque[TrajectoryGroup]] = {k: deque() for k in self.weights}
        self.unrouted = 0

    def add(self, groups: Iterable[TrajectoryGroup], version: int) -> None:
        for g in groups:
            key = getattr(g, self.by)
            key = key if key in self.queues else "*" if "*" in self.queues else None
            if key is None:
                self.unrouted += 1
                continue
            q = self.queues[key]
            q.append(g)
            if len(q) > self.capacity:
                q.popleft()

    def sample(self, n: int, version: int) -> list[TrajectoryGroup]:
        """Up to ``n`` groups; each draw picks a non-empty source with probability ∝ its weight."""
        out: list[TrajectoryGroup] = []
        while len(out) < n:
            live = [k for k, q in self.queues.items() if q and self.weights[k] > 0]
            if not live:
                break
            w = np.array([self.weights[k] for k in live])
            out.append(self.queues[live[int(self.rng.choice(len(live), p=w / w.sum()))]].popleft())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"queues": {k: [encode(g) for g in q] for k, q in self.queues.items()},
                "unrouted": self.unrouted, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.queues = {k: deque(decode(b, expect=TrajectoryGroup, topic="mix.state") for b in q)
                       for k, q in state["queues"].items()}
        self.unrouted = int(state["unrouted"])
        self.rng.bit_generator.state = state["rng"]
