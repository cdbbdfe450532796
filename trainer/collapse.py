"""Collapse detection: a policy whose training reward fell far below its best window while its entropy moved.

A policy-gradient run can learn and then break: one update too large for a sharp policy, and it stops producing
what the reward needs (the format of a tool call, the end of an answer). Once every sample of every group gets
the same reward, GRPO's advantages are all 0 and nothing can pull the policy back, so the reward stays where it
fell. :class:`CollapseWatch` says so within a few steps, from the figures every trainer step already has:

* the reward's trailing window (the mean ``reward_mean`` of the last :data:`WINDOW` steps) is under
  :data:`REWARD_FRACTION` of the best such window so far, and
* the trailing window's mean token entropy differs from the best window's by more than a factor
  :data:`ENTROPY_FACTOR`, either way: the policy itself changed (sharper or more random), which a batch of harder
  prompts alone does not do.

The rule assumes rewards >= 0 (a best window <= 0 is never a collapse). It fires once per fall, and again only
after the reward has come back above the fraction.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

#: steps per window
WINDOW = 10
#: a collapse: the trailing reward window under this fraction of the best window
REWARD_FRACTION = 0.5
#: ... while the trailing entropy window is over this factor above, or under its inverse below, the best window's
ENTROPY_FACTOR = 1.25


@dataclass(frozen=True)
class Collapse:
    """One detected collapse (rewards in the reward's units, entropies in nats per generated token).

    Attributes:
        step: the step that completed the trailing window.
        reward_window: the trailing window's mean reward.
        best_window: the best window's mean reward, which ended at ``best_step``.
        entropy_window: the trailing window's mean entropy.
        best_entropy: the best window's mean entropy.
    """

    step: int
    reward_window: float
    best_window: float
    best_step: int
    entropy_window: float
    best_entropy: float

    @property
    def entropy_ratio(self) -> float:
        """The trailing window's entropy over the best window's (inf when the best window's was 0)."""
        return self.entropy_window / self.best_entropy if self.best_entropy > 0 else math.inf

    def describe(self) -> str:
        """One line for a log or a console: what fell, from where, and how the entropy moved."""
        return (f"reward collapsed at step {self.step}: the last {WINDOW} steps' mean reward "
                f"{self.reward_window:.3f} is under {REWARD_FRACTION:g} x the best window's {self.best_window:.3f} "
                f"(steps {self.best_step - WINDOW + 1}-{self.best_step}), and the entropy moved "
                f"{self.best_entropy:.4f} -> {self.entropy_window:.4f} nats/token (x{self.entropy_ratio:.2f})")

    def values(self) -> dict[str, float]:
        """The alert's figures for the ``metrics`` topic: ``collapse`` 1 and the fields above."""
        return {"collapse": 1.0, "collapse_step": float(self.step), "reward_window": self.reward_window,
                "reward_best_window": self.best_window, "best_step": float(self.best_step),
                "entropy_window": self.entropy_window, "entropy_best_window": self.best_entropy}

    @classmethod
    def from_values(cls, values: dict[str, float]) -> "Collapse":
        """The alert :meth:`values` published (a ``metrics`` record's values).

        Raises:
            KeyError: a field of :meth:`values` is missing.
        """
        return cls(step=int(values["collapse_step"]), reward_window=values["reward_window"],
                   best_window=values["reward_best_window"], best_step=int(values["best_step"]),
                   entropy_window=values["entropy_window"], best_entropy=values["entropy_best_window"])


class CollapseWatch:
    """Watches one policy's per-step reward and entropy for a collapse (module docstring).

    Args:
        window: steps per window (>= 1).
        reward_fraction: in (0, 1).
        entropy_factor: > 1.

    Attributes:
        best_window, best_step: the best trailing reward window so far and the step it ended at (None before
            ``window`` steps).
        trailing_window: the newest trailing reward window (None before ``window`` steps).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, window: int = WINDOW, reward_fraction: float = REWARD_FRACTION,
                 entropy_factor: float = ENTROPY_FACTOR):
        if window < 1 or not 0 < reward_fraction < 1 or entropy_factor <= 1:
            raise ValueError(f"collapse watch: window {window} must be >= 1, reward_fraction {reward_fraction} in "
                             f"(0, 1), entropy_factor {entropy_factor} > 1")
        self.window, self.reward_fraction, self.entropy_factor = window, reward_fraction, entropy_factor
        self._rewards: deque[float] = deque(maxlen=window)
        self._entropies: deque[float] = deque(maxlen=window)
        self.best_window: float | None = None
        self.best_step: int | None = None
        self.trailing_window: float | None = None
        self._best_entropy = 0.0
        self._fallen = False

    def observe(self, step: int, reward: float, entropy: float) -> Collapse | None:
        """Add step ``step``'s mean reward and mean token entropy (nats); returns the :class:`Collapse` when this
        step completes a trailing window that collapsed and no collapse was reported since the reward was last
        above the fraction, else None."""
        self._rewards.append(float(reward))
        self._entropies.append(float(entropy))
        if len(self._rewards) < self.window:
            return None
        r = self.trailing_window = sum(self._rewards) / self.window
        e = sum(self._entropies) / self.window
        if self.best_window is None or r > self.best_window:
            self.best_window, self.best_step, self._best_entropy = r, step, e
        if self.best_window <= 0 or r >= self.reward_fraction * self.best_window:
            self._fallen = False
            return None
        moved = e > self.entropy_factor * self._best_entropy or e * self.entropy_factor < self._best_entropy
        if self._fallen or not moved:
            return None
        self._fallen = True
        return Collapse(step=step, reward_window=r, best_window=self.best_window, best_step=self.best_step,
                        entropy_window=e, best_entropy=self._best_entropy)
