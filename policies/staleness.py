"""The staleness rule (DESIGN.md, "Staleness"): how far behind the weights that made some data are.

Data made by weights version ``made_at`` (a group's ``min_version``, an engine's loaded version, the newest
durable version a worker can load) is ``version - made_at`` versions stale for a trainer at ``version``, and
too stale to train once that is above ``max_staleness``. Data with no version (``made_at < 0``: a group
without generated tokens) is never stale. The serving stage drops groups by it
(:class:`consumers.serving.ServingStage`), RaaS holds rollouts that it would make too stale
(:meth:`producers.raas.RaasWorker.pause_reason`), and the trainer holds while the store is too far behind it
(:meth:`trainer.service.TrainerService.run`).
"""
from __future__ import annotations


def staleness(made_at: int, version: int) -> int:
    """Versions between the weights ``made_at`` and a trainer at ``version``: ``version - made_at``, at least 0;
    0 when ``made_at < 0`` (no version: e.g. a group without generated tokens)."""
    if made_at < 0:
        return 0
    return max(0, version - made_at)


def too_stale(made_at: int, version: int, max_staleness: int) -> bool:
    """The one staleness decision: True when data made by weights ``made_at`` is more than ``max_staleness``
    versions behind a trainer at ``version`` (:func:`staleness` > ``max_staleness``), so it is not trained (or,
    ahead of time, not made)."""
    return staleness(made_at, version) > max_staleness
