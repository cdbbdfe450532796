"""``staleness``: what the serving stage does with off-policy groups (DESIGN.md, "Staleness").

A group's staleness is ``trainer_version - min_version``. The policy holds
groups, serves them earliest-version-first, and for groups staler than
``max_staleness`` either drops them (``mode="drop"``) or serves them, with
:meth:`Staleness.importance_weights` giving the truncated importance weights
that correct the loss for the behaviour/current policy mismatch
(``mode="importance_weight"``).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Iterable

import numpy as np

from policies.base import PolicyConfigError, ServingPolicy, group_staleness
from policies.registry import register_policy
from topics.codec import decode, encode
from topics.schemas import TrajectoryGroup

_MODES = ("drop", "importance_weight")


@register_policy("staleness")
class Staleness(ServingPolicy):
    """Serve groups earliest-version-first; drop or importance-weight those past ``max_staleness``.

    Args:
        max_staleness: the largest staleness served as is (versions; default 8).
        mode: ``"drop"`` discards staler groups (counted in ``dropped``);
            ``"importance_weight"`` serves them and the loss applies
            :meth:`importance_weights`.
        is_cap: the truncation C of the importance ratio (> 0).

    Raises:
        PolicyConfigError: unknown ``mode``, ``max_staleness < 0`` or ``is_cap <= 0``.
    """

    def __init__(self, max_staleness: int = 8, mode: str = "drop", is_cap: float = 2.0):
        if mode not in _MODES:
            raise PolicyConfigError("staleness", f"must be one of {', '.join(_MODES)}, got {mode!r}", param="mode")
        if int(max_staleness) < 0:
            raise PolicyConfigError("staleness", f"must be >= 0 versions, got {max_staleness}", param="max_staleness")
        if float(is_cap) <= 0:
            raise PolicyConfigError("staleness", f"must be > 0, got {is_cap}", param="is_cap")
        self.max_staleness, self.mode, self.is_cap = int(max_staleness), mode, float(is_cap)
        self.heap: list[tuple[int, int, TrajectoryGroup]] = []
        self.seq = itertools.count()
        self.dropped = 0

    def add(self, groups: Iterable[TrajectoryGroup], version: int) -> None:
        for g in groups:
            heapq.heappush(self.heap, (g.min_version, next(self.seq), g))

    def sample(self, n: int, version: int) -> list[TrajectoryGroup]:
        """Up to ``n`` groups, lowest ``min_version`` first (ties in arrival order)."""
        out: list[TrajectoryGroup] = []
        while self.heap and len(out) < n:
            _, _, g = heapq.heappop(self.heap)
            if self.mode == "drop" and group_staleness(g, version) > self.max_staleness:
                self.dropped += 1
                continue
            out.append(g)
        return out

    def importance_weights(self, behavior_logprobs: np.ndarray, current_logprobs: np.ndarray,
                           loss_mask: np.ndarray) -> np.ndarray:
        """Per-token truncated importance weights ``min(exp(current - behaviour), C) * loss_mask``.

        Truncated importance sampling (IMPALA's truncated ratio, Espeholt et
        al. 2018, Eq. 1 with rho-bar = C; applied to LLM RL by Yao et al. 2025,
        "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").

        Args:
            behavior_logprobs: float32[L], log-probs under the weights that sampled each token.
            current_logprobs: float32[L], log-probs under the trainer's current weights.
            loss_mask: uint8[L], 1 on tokens this policy generated.

        Returns:
            float32[L] weights, 0 where ``loss_mask`` is 0.

        Raises:
            ValueError: the arrays differ in shape.
        """
        b, c, m = (np.asarray(x) for x in (behavior_logprobs, current_logprobs, loss_mask))
        if not b.shape == c.shape == m.shape:
            raise ValueError(f"shapes differ: behaviour {b.shape}, current {c.shape}, loss_mask {m.shape}")
        ratio = np.exp(np.clip(c.astype(np.float64) - b, None, 50.0))
        return (np.minimum(ratio, self.is_cap) * (m != 0)).astype(np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [encode(g) for _, _, g in sorted(self.heap)], "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.heap, self.seq = [], itertools.count()
        self.add((decode(b, expect=TrajectoryGroup, topic="staleness.state") for b in state["groups"]), 0)
        self.dropped = int(state["dropped"])
