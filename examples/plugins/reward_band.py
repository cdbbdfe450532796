"""Two data-policy plugins, each one class that a run config names as ``module:Class`` with its options
(``examples/plugins/arith-tiny-plugins.yaml``; docs/guides/plugins.md).

- :class:`RewardBand`, a filter: keep a group only while its mean reward lies in a band, so the trainer
  sees neither prompts it already solves nor ones it never solves.
- :class:`RolloutBudget`, a curator: roll a prompt out at most ``max_rollouts`` times over the run.

An option the class does not take is refused, with its name, when the config is read (the options are bound to
the class's signature); a bad value is refused by the class itself (a :class:`~policies.base.PolicyConfigError`
naming the parameter) when ``astraflow run`` checks the config and when the component starts.
"""
from __future__ import annotations

from typing import Any

from policies.base import KEEP, Curator, Decision, Filter, PolicyConfigError
from topics.schemas import Prompt, RolloutOutcome, TrajectoryGroup


class RewardBand(Filter):
    """Drop a group whose mean reward is below ``min_mean`` (reason ``too_hard``) or above ``max_mean``
    (reason ``too_easy``); the reasons are counted as ``dropped.<reason>`` in the filter's metrics.

    Args:
        min_mean: the least mean reward a kept group has.
        max_mean: the most mean reward a kept group has (>= ``min_mean``).
    """

    def __init__(self, min_mean: float = 0.0, max_mean: float = 1.0):
        if max_mean < min_mean:
            raise PolicyConfigError("RewardBand", f"must be >= min_mean ({min_mean}), got {max_mean}",
                                    param="max_mean")
        self.min_mean, self.max_mean = float(min_mean), float(max_mean)

    def keep(self, group: TrajectoryGroup) -> Decision:
        mean = sum(s.reward for s in group.samples) / len(group.samples)
        if mean < self.min_mean:
            return Decision(False, "too_hard")
        if mean > self.max_mean:
            return Decision(False, "too_easy")
        return KEEP


class RolloutBudget(Curator):
    """Submit a prompt until ``max_rollouts`` of its groups have come back from rollout (the ``outcomes``
    topic); its counts are its state, saved on the run's ``state`` topic and restored after a restart.

    Args:
        max_rollouts: the most rollouts of one prompt (>= 1).
    """

    def __init__(self, max_rollouts: int = 4):
        if max_rollouts < 1:
            raise PolicyConfigError("RolloutBudget", f"must be >= 1, got {max_rollouts}", param="max_rollouts")
        self.max_rollouts = int(max_rollouts)
        self.rollouts: dict[str, int] = {}

    def should_submit(self, prompt: Prompt) -> bool:
        return self.rollouts.get(prompt.prompt_id, 0) < self.max_rollouts

    def update(self, outcome: RolloutOutcome) -> None:
        self.rollouts[outcome.prompt_id] = self.rollouts.get(outcome.prompt_id, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": dict(self.rollouts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollouts = {str(k): int(v) for k, v in state["rollouts"].items()}
