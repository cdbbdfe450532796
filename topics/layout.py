"""A run's topic layout (DESIGN.md, "Topics"): each topic's name, partitions, compaction and retention, defined once.

Plain topics (``prompts``, ``outcomes``, ``metrics``, ``deadletter``, ``trajectories.<policy>``,
``samples.<policy>``) have :data:`PARTITIONS` partitions; the changelogs (``weights``, ``control``, ``state``,
``trained``) have one, compacted, so that the newest record of each key is kept. Every component creates what it
uses with these specs (creating is idempotent), so components start in any order on any machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from topics.bus import Admin
from topics.names import TopicNames
from topics.schemas import Control, Message, PolicyState, TrainedBatch, TrainerProgress, WeightAnnouncement

#: partitions of each plain topic of a run
PARTITIONS = 4


@dataclass(frozen=True)
class TopicSpec:
    """One topic as it is created: ``name``, ``partitions``, ``compacted`` (keep the newest record of each key)
    and ``retention_ms`` (None: the bus's default); ``schemas``: the message classes its records hold, where the
    layout fixes them (the changelogs; empty for the others)."""

    name: str
    partitions: int
    compacted: bool = False
    retention_ms: int | None = None
    schemas: tuple[type[Message], ...] = ()

    def create(self, admin: Admin) -> None:
        """Create the topic through ``admin`` unless it exists (an existing topic is left as is).

        Raises:
            topics.bus.BusError: the bus refused or could not be reached.
        """
        admin.create_topic(self.name, partitions=self.partitions, compacted=self.compacted,
                           retention_ms=self.retention_ms)


@dataclass(frozen=True)
class RunTopics:
    """The topic specs of the run ``names`` names, its plain topics with ``partitions`` partitions."""

    names: TopicNames
    partitions: int = PARTITIONS

    def _plain(self, name: str) -> TopicSpec:
        return TopicSpec(name, self.partitions)

    @property
    def prompts(self) -> TopicSpec:
        return self._plain(self.names.prompts)

    @property
    def outcomes(self) -> TopicSpec:
        return self._plain(self.names.outcomes)

    @property
    def metrics(self) -> TopicSpec:
        return self._plain(self.names.metrics)

    @property
    def deadletter(self) -> TopicSpec:
        return self._plain(self.names.deadletter)

    def trajectories(self, policy: str) -> TopicSpec:
        return self._plain(self.names.trajectories(policy))

    def samples(self, policy: str) -> TopicSpec:
        return self._plain(self.names.samples(policy))

    @property
    def weights(self) -> TopicSpec:
        return TopicSpec(self.names.weights, 1, compacted=True, schemas=(WeightAnnouncement,))

    @property
    def control(self) -> TopicSpec:
        return TopicSpec(self.names.control, 1, compacted=True, schemas=(Control, TrainerProgress))

    @property
    def state(self) -> TopicSpec:
        return TopicSpec(self.names.state, 1, compacted=True, schemas=(PolicyState,))

    @property
    def trained(self) -> TopicSpec:
        return TopicSpec(self.names.trained, 1, compacted=True, schemas=(TrainedBatch,))

    def changelogs(self) -> list[TopicSpec]:
        """The compacted changelogs, read whole by every component with no consumer group."""
        return [self.weights, self.control, self.state, self.trained]

    def all(self, policies: Iterable[str]) -> list[TopicSpec]:
        """Every topic of the run with ``policies``."""
        per_policy = [spec for p in policies for spec in (self.trajectories(p), self.samples(p))]
        return [self.prompts, self.outcomes, self.metrics, self.deadletter, *per_policy, *self.changelogs()]


def ensure_run_topics(admin: Admin, names: TopicNames, policies: Iterable[str], partitions: int = PARTITIONS) -> None:
    """Create every topic of the run ``names`` names with ``policies`` (:meth:`RunTopics.all`) that does not exist.

    Raises:
        topics.bus.BusError: the bus refused or could not be reached.
    """
    for spec in RunTopics(names, partitions).all(policies):
        spec.create(admin)
