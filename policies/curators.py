"""Built-in curators: pre-rollout prompt selection learned from rollout outcomes (DESIGN.md, step 2).

- ``filter_solved``: skips a prompt once the EWMA of its success rate reaches a threshold.
- ``greso``: GRESO's probabilistic pre-rollout filtering of prompts predicted
  to be zero-variance (all rewards of the group equal, hence zero GRPO advantage).
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from policies.base import Curator, PolicyConfigError
from policies.registry import register_policy
from topics.schemas import Prompt, RolloutOutcome


def _check_unit(policy: str, param: str, value: float, low_open: bool = False) -> float:
    value = float(value)
    if not (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0):
        raise PolicyConfigError(policy, f"must be in {'(0' if low_open else '[0'}, 1], got {value}", param=param)
    return value


@register_policy("filter_solved")
class FilterSolved(Curator):
    """Skip prompts the policy already solves.

    Per prompt, an exponentially weighted moving average of the success rate:
    ``ewma <- (1 - alpha) * ewma + alpha * s`` where ``s`` is the fraction of
    the group's rewards ``>= success_reward``; the first outcome sets
    ``ewma = s``. A prompt is submitted while ``ewma < threshold``; unseen
    prompts are always submitted.

    Args:
        alpha: EWMA weight of the newest outcome, in (0, 1].
        threshold: success-rate EWMA at or above which the prompt is skipped, in [0, 1].
        success_reward: a sample with reward at least this counts as a success.

    Raises:
        PolicyConfigError: ``alpha`` or ``threshold`` out of range.
    """

    def __init__(self, alpha: float = 0.5, threshold: float = 0.9, success_reward: float = 1.0):
        self.alpha = _check_unit("filter_solved", "alpha", alpha, low_open=True)
        self.threshold = _check_unit("filter_solved", "threshold", threshold)
        self.success_reward = float(success_reward)
        self.ewma: dict[str, float] = {}

    def should_submit(self, prompt: Prompt) -> bool:
        ewma = self.ewma.get(prompt.prompt_id)
        return ewma is None or ewma < self.threshold

    def update(self, outcome: RolloutOutcome) -> None:
        s = float(np.mean(np.asarray(outcome.rewards) >= self.success_reward))
        old = self.ewma.get(outcome.prompt_id)
        self.ewma[outcome.prompt_id] = s if old is None else (1 - self.alpha) * old + self.alpha * s

    def state_dict(self) -> dict[str, Any]:
        return {"ewma": dict(self.ewma)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ewma = {str(k): float(v) for k, v in state["ewma"].items()}


@register_policy("greso")
class Greso(Curator):
    """GRESO: GRPO with Efficient Selective Rollout.

    Source: H. Zheng, Y. Zhou, B. R. Bartoldson, B. Kailkhura, F. Lai, J. Zhao,
    B. Chen, "Act Only When It Pays: Efficient Reinforcement Learning for LLM
    Reasoning via Selective Rollouts", arXiv:2506.02177 (2025), Sec. 4 and
    Algorithm 1; defaults follow the authors' released scripts
    (p_easy = p_hard = 0.5, target zero-variance ratio 0.25 split 1/3 easy and
    2/3 hard, step 0.01).

    What is implemented:

    - Per prompt, the streak ``z`` of consecutive zero-variance outcomes
      (all rewards of the group equal). The streak is *easy* when the latest
      zero-variance group was all solved (rewards ``>= solved_reward``) and
      *hard* otherwise. Any outcome with reward variance resets ``z`` to 0.
    - A prompt is submitted with probability ``max(p ** z, floor)``, ``p``
      being ``p_easy`` or ``p_hard`` by the streak's kind; unseen prompts and
      ``z = 0`` give probability 1. ``floor`` keeps every prompt explorable.
    - At each new weight version (``on_version``), with the outcomes seen since
      the previous version: the observed easy zero-variance ratio
      ``n_easy_zero / n_outcomes`` is compared with ``target_easy``; if it is
      below, ``p_easy += step``, otherwise ``p_easy -= step``; the same for
      ``p_hard`` with ``target_hard``. Both are clipped to ``[p_min, 1]``.
      Versions with no outcomes leave ``p`` unchanged.

    Args:
        p_easy, p_hard: initial exploration probabilities, in (0, 1].
        floor: the least submit probability, in [0, 1].
        target_easy, target_hard: target zero-variance ratios per version, in [0, 1].
        step: the adaptation step of p per version (Delta p).
        p_min: the least value p adapts down to, in (0, 1].
        solved_reward: a zero-variance group with this reward or more is *easy*.
        seed: seed of the submit draws.

    Raises:
        PolicyConfigError: a probability or ratio out of range, or ``step < 0``.
    """

    def __init__(self, p_easy: float = 0.5, p_hard: float = 0.5, floor: float = 0.05,
                 target_easy: float = 0.25 / 3, target_hard: float = 0.25 * 2 / 3, step: float = 0.01,
                 p_min: float = 0.05, solved_reward: float = 1.0, seed: int = 0):
        self.p_easy = _check_unit("greso", "p_easy", p_easy, low_open=True)
        self.p_hard = _check_unit("greso", "p_hard", p_hard, low_open=True)
        self.floor = _check_unit("greso", "floor", floor)
        self.target_easy = _check_unit("greso", "target_easy", target_easy)
        self.target_hard = _check_unit("greso", "target_hard", target_hard)
        self.p_min = _check_unit("greso", "p_min", p_min, low_open=True)
        if step < 0:
            raise PolicyConfigError("greso", f"must be >= 0, got {step}", param="step")
        self.step = float(step)
        self.solved_reward = float(solved_reward)
        self.rng = np.random.default_rng(seed)
        self.streaks: dict[str, tuple[int, bool]] = {}  # prompt_id -> (z, easy)
        self.version = -1
        self.window = {"outcomes": 0, "easy_zero": 0, "hard_zero": 0}

    def submit_probability(self, prompt_id: str) -> float:
        """``max(p ** z, floor)`` for ``prompt_id`` (1.0 for an unseen prompt or ``z = 0``)."""
        z, easy = self.streaks.get(prompt_id, (0, False))
        if z == 0:
            return 1.0
        return max((self.p_easy if easy else self.p_hard) ** z, self.floor)

    def should_submit(self, prompt: Prompt) -> bool:
        p = self.submit_probability(prompt.prompt_id)
        return p >= 1.0 or bool(self.rng.random() < p)

    def update(self, outcome: RolloutOutcome) -> None:
        self.window["outcomes"] += 1
        if outcome.zero_adv:
            easy = outcome.rewards[0] >= self.solved_reward
            z, _ = self.streaks.get(outcome.prompt_id, (0, easy))
            self.streaks[outcome.prompt_id] = (z + 1, easy)
            self.window["easy_zero" if easy else "hard_zero"] += 1
        else:
            self.streaks.pop(outcome.prompt_id, None)

    def on_version(self, version: int) -> None:
        if version <= self.version:
            return
        self.version = version
        n = self.window["outcomes"]
        if n:
            self.p_easy = self._adapt(self.p_easy, self.window["easy_zero"] / n, self.target_easy)
            self.p_hard = self._adapt(self.p_hard, self.window["hard_zero"] / n, self.target_hard)
        self.window = {"outcomes": 0, "easy_zero": 0, "hard_zero": 0}

    def _adapt(self, p: float, observed: float, target: float) -> float:
        p = p + self.step if observed < target else p - self.step
        return float(min(1.0, max(self.p_min, p)))

    def state_dict(self) -> dict[str, Any]:
        return {"p_easy": self.p_easy, "p_hard": self.p_hard, "version": self.version,
                "window": dict(self.window), "streaks": {k: [z, e] for k, (z, e) in self.streaks.items()},
                "rng": json.dumps(self.rng.bit_generator.state)}  # JSON: PCG64's state is a 128-bit int

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.p_easy, self.p_hard = float(state["p_easy"]), float(state["p_hard"])
        self.version = int(state["version"])
        self.window = {k: int(v) for k, v in state["window"].items()}
        self.streaks = {k: (int(z), bool(e)) for k, (z, e) in state["streaks"].items()}
        self.rng.bit_generator.state = json.loads(state["rng"])
