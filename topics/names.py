"""Run-prefixed topic and consumer-group names (DESIGN.md, "Topics")."""
from __future__ import annotations

import re
from dataclasses import dataclass

_VALID = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class TopicNames:
    """The topic and consumer-group names of one run: ``<run>.<topic>``, ``<run>.<group>``.

    Raises:
        ValueError: ``run`` or a policy name has characters Kafka does not allow.
    """

    run: str

    def __post_init__(self) -> None:
        if not _VALID.match(self.run):
            raise ValueError(f"run name {self.run!r} may only hold letters, digits, '.', '_' and '-'")

    def _name(self, *parts: str) -> str:
        for p in parts:
            if not _VALID.match(p):
                raise ValueError(f"topic name part {p!r} may only hold letters, digits, '.', '_' and '-'")
        return ".".join((self.run, *parts))

    @property
    def prompts(self) -> str:
        return self._name("prompts")

    @property
    def outcomes(self) -> str:
        return self._name("outcomes")

    @property
    def weights(self) -> str:
        return self._name("weights")

    @property
    def control(self) -> str:
        return self._name("control")

    @property
    def trained(self) -> str:
        """Compacted record of what each trainer step trained (:class:`topics.schemas.TrainedBatch`),
        keyed ``<policy>/<version>``."""
        return self._name("trained")

    @property
    def state(self) -> str:
        """Compacted changelog of stateful data policies (:class:`topics.schemas.PolicyState`), keyed by component."""
        return self._name("state")

    @property
    def metrics(self) -> str:
        return self._name("metrics")

    @property
    def deadletter(self) -> str:
        return self._name("deadletter")

    def trajectories(self, policy: str) -> str:
        return self._name("trajectories", policy)

    def samples(self, policy: str) -> str:
        return self._name("samples", policy)

    # Consumer groups are run-scoped like topics: runs that share a broker never share a group,
    # so one run's members never join, or rebalance, another's.
    def raas_group(self, workflow: str) -> str:
        """Consumer group of the RaaS workers on ``prompts``: ``<run>.raas.<workflow>``."""
        return self._name("raas", workflow)

    def filter_group(self, policy: str) -> str:
        """Consumer group of ``policy``'s filter processors on ``trajectories.<policy>``."""
        return self._name("filter", policy)

    def trainer_group(self, policy: str) -> str:
        """Consumer group of ``policy``'s trainer on ``samples.<policy>``."""
        return self._name("trainer", policy)

    def curator_group(self, policy: str) -> str:
        """Consumer group of ``policy``'s curator gate on ``outcomes``."""
        return self._name("curator", policy)

    @property
    def changelog_check_group(self) -> str:
        """Consumer group of the launcher's check of the changelogs (``weights``, ``control``, ``state``,
        ``trained``), which dead-letters their undecodable records once: ``<run>.changelog-check``."""
        return self._name("changelog-check")
