"""Built-in filters: post-rollout decisions on trajectory groups (DESIGN.md, step 4).

- ``accept_all``: keeps every group (and, as a curator, submits every prompt).
- ``filter_zero_adv``: DAPO's dynamic sampling, drops groups whose rewards are all equal.
- ``filter_length``: drops groups with over-long or truncated samples.
- ``filter_format``: drops groups where too many samples ended badly (format errors, aborts).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from policies.base import KEEP, Curator, Decision, Filter, PolicyConfigError
from policies.registry import register_policy
from topics.schemas import Prompt, TrajectoryGroup


@register_policy("accept_all")
class AcceptAll(Curator, Filter):
    """Keep every group and submit every prompt (the identity policy)."""

    def should_submit(self, prompt: Prompt) -> bool:
        return True

    def keep(self, group: TrajectoryGroup) -> Decision:
        return KEEP


@register_policy("filter_zero_adv")
class FilterZeroAdv(Filter):
    """Dynamic sampling: drop groups whose rewards are all equal (zero group-relative advantage).

    Source: Q. Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning
    System at Scale", arXiv:2503.14476 (2025), Sec. 3.2 "Dynamic Sampling"
    (keep a group only if 0 < #correct < G, i.e. its rewards differ).
    Rewards are compared exactly, not through the group's ``zero_adv`` flag,
    so a wrong flag cannot drop a useful group. ``dropped`` counts the drops.
    """

    def __init__(self) -> None:
        self.dropped = 0

    def keep(self, group: TrajectoryGroup) -> Decision:
        rewards = np.fromiter((s.reward for s in group.samples), dtype=np.float64, count=len(group.samples))
        if np.all(rewards == rewards[0]):
            self.dropped += 1
            return Decision(False, "zero_adv")
        return KEEP

    def state_dict(self) -> dict[str, Any]:
        return {"dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dropped = int(state["dropped"])


def _fraction(policy: str, param: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise PolicyConfigError(policy, f"must be a fraction in [0, 1], got {value}", param=param)
    return value


@register_policy("filter_length")
class FilterLength(Filter):
    """Drop groups with over-long or truncated samples.

    A group is dropped (reason ``too_long``) when any sample has more than
    ``max_tokens`` generated tokens (``loss_mask`` sum), and (reason
    ``truncated``) when more than ``max_truncated_fraction`` of its samples
    ended with ``finish_reason == "length"``.

    Args:
        max_tokens: the most generated tokens a sample may have (tokens); None: no limit.
        max_truncated_fraction: the largest tolerated fraction of truncated samples, in [0, 1].

    Raises:
        PolicyConfigError: ``max_tokens < 1`` or a fraction out of range.
    """

    def __init__(self, max_tokens: int | None = None, max_truncated_fraction: float = 0.5):
        if max_tokens is not None and int(max_tokens) < 1:
            raise PolicyConfigError("filter_length", f"must be >= 1 tokens, got {max_tokens}", param="max_tokens")
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.max_truncated_fraction = _fraction("filter_length", "max_truncated_fraction", max_truncated_fraction)

    def keep(self, group: TrajectoryGroup) -> Decision:
        if self.max_tokens is not None and any(int(s.loss_mask.sum()) > self.max_tokens for s in group.samples):
            return Decision(False, "too_long")
        truncated = sum(s.finish_reason == "length" for s in group.samples) / len(group.samples)
        if truncated > self.max_truncated_fraction:
            return Decision(False, "truncated")
        return KEEP


@register_policy("filter_format")
class FilterFormat(Filter):
    """Drop groups where more than ``max_bad_fraction`` of samples ended with a bad ``finish_reason``.

    Args:
        bad_finish_reasons: finish reasons that mark a malformed sample
            (default: ``format_error``, ``abort``, ``error``).
        max_bad_fraction: the largest tolerated fraction of bad samples, in [0, 1].

    Raises:
        PolicyConfigError: the fraction is out of range or the reasons are not a list of strings.
    """

    def __init__(self, bad_finish_reasons: list[str] | None = None, max_bad_fraction: float = 0.0):
        reasons = ["format_error", "abort", "error"] if bad_finish_reasons is None else bad_finish_reasons
        if isinstance(reasons, str) or not all(isinstance(r, str) for r in reasons):
            raise PolicyConfigError("filter_format", "must be a list of strings", param="bad_finish_reasons")
        self.bad = frozenset(reasons)
        self.max_bad_fraction = _fraction("filter_format", "max_bad_fraction", max_bad_fraction)

    def keep(self, group: TrajectoryGroup) -> Decision:
        bad = sum(s.finish_reason in self.bad for s in group.samples) / len(group.samples)
        return Decision(False, "bad_format") if bad > self.max_bad_fraction else KEEP
