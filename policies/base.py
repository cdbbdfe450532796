"""The data-policy plug-in API: curators, filters and serving policies (DESIGN.md, steps 2, 4, 8, 9).

Three kinds of policy, each a class named in the run's config:

- :class:`Curator` decides before rollout whether a prompt is worth a rollout
  now (``should_submit``) and learns from the stream of rollout outcomes
  (``update``) and weight versions (``on_version``).
- :class:`Filter` decides after rollout whether a trajectory group reaches the
  trainer (``keep`` returns a :class:`Decision` with a reason).
- :class:`ServingPolicy` holds groups for the serving stage (``add``) and hands
  a fraction ``ratio`` of each batch back when it is assembled (``sample``): replay.

Every policy can checkpoint itself with ``state_dict`` / ``load_state_dict``;
the state is plain msgpack-able data (dicts, lists, numbers, strings, bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

from topics.schemas import Prompt, RolloutOutcome, TrajectoryGroup


class PolicyConfigError(ValueError):
    """A policy config that cannot be used: unknown name, bad parameter, wrong kind.

    Attributes:
        policy: the policy name as written in the config.
        param: the offending parameter, or None when the whole entry is at fault.
    """

    def __init__(self, policy: str, reason: str, param: str | None = None):
        self.policy, self.param, self.reason = policy, param, reason
        where = f"policy {policy!r}" + (f", parameter {param!r}" if param else "")
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class Decision:
    """A filter's verdict on one group: ``keep`` and a short machine-readable ``reason``
    (a metrics name part, e.g. ``"zero_adv"``, ``"too_long"``; ``"kept"`` when kept)."""

    keep: bool
    reason: str = "kept"


KEEP = Decision(True, "kept")


class Policy:
    """Base of every data policy. ``name`` is set by :func:`policies.registry.register_policy`.

    The default state is empty; stateful policies override :meth:`state_dict`
    and :meth:`load_state_dict`.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "policy"

    def state_dict(self) -> dict[str, Any]:
        """The policy's state as plain msgpack-able data."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state written by :meth:`state_dict`.

        Raises:
            PolicyConfigError: ``state`` is not this policy's state.
        """
        if state:
            raise PolicyConfigError(self.name or type(self).__name__, f"has no state, got keys {sorted(state)}")


class Curator(Policy):
    """Pre-rollout selection: sits between acquisition and ``prompts``.

    A curator learns the weight version from :meth:`on_version` (ints, the trainer's step count).
    """

    kind: ClassVar[str] = "curator"

    def should_submit(self, prompt: Prompt) -> bool:
        """Whether ``prompt`` should be rolled out now (at the newest version :meth:`on_version` gave)."""
        raise NotImplementedError

    def update(self, outcome: RolloutOutcome) -> None:
        """Learn from one rollout outcome (the rewards of a group). Default: ignore it."""

    def on_version(self, version: int) -> None:
        """A new weight ``version`` was announced. Default: nothing."""


class Filter(Policy):
    """Post-rollout filtering: a step of the stream processor ``trajectories.<policy>`` -> ``samples.<policy>``."""

    kind: ClassVar[str] = "filter"

    def keep(self, group: TrajectoryGroup) -> Decision:
        """Whether ``group`` goes on to the trainer, with the reason."""
        raise NotImplementedError


class ServingPolicy(Policy):
    """A serving-stage policy: holds groups and serves a fraction of each batch from them (replay).

    Attributes:
        ratio: r in [0, 1), the fraction of each batch of ``n`` groups that :meth:`sample` supplies
            (``round(r * n)`` groups; :class:`consumers.serving.ServingStage` takes the rest fresh).
        max_staleness: the most versions old a group it serves may be: at most the trained policy's
            ``max_staleness``; None until :class:`consumers.serving.ServingStage` sets it to that bound.
    """

    kind: ClassVar[str] = "serving"
    ratio: float = 0.0
    max_staleness: int | None = None

    def add(self, groups: Iterable[TrajectoryGroup], version: int) -> None:
        """Offer ``groups`` (already served to the trainer at weight ``version``) to the policy."""
        raise NotImplementedError

    def sample(self, n: int, version: int) -> list[TrajectoryGroup]:
        """Up to ``n`` groups for a batch trained at weight ``version`` (fewer when the policy holds fewer)."""
        raise NotImplementedError
