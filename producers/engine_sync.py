"""One weight-sync contract for every engine: :class:`EngineSync`, used by RaaS workers, ``astraflow eval`` and
live evaluation alike.

A weight version reaches an engine in one of two ways, whichever the engine uses best:

- **from a host copy** (:class:`~producers.hf_engine.HFEngine`, :class:`~producers.sglang_engine.SGLangEngine`):
  a :class:`~weights.puller.Puller` keeps a verified copy in this process (deltas applied in place), and the
  engine is handed only the tensors that changed since its last load (``Puller.changed``; all of them the first
  time and after a full snapshot) through :meth:`~producers.engines.Engine.load_weights`;
- **by a server-side pull** (:class:`~producers.vllm_engine.VLLMEngine`, ``Engine.pulls_from_store``): the server
  reads the store itself (the same planner and checks, in its worker), told only the version and, when an
  announcement gave it, the checksum the result must have; this process keeps no copy.

The two halves are separate so that a caller can overlap them with rollout: :meth:`EngineSync.fetch` (the
download; slow over a slow link, run it in a thread) and :meth:`EngineSync.load` (the hand-over; run it on the
engine's thread, between two engine calls). :meth:`EngineSync.update` does both, for callers that can wait.
"""
from __future__ import annotations

import logging

from producers.engines import Engine
from weights.puller import Puller

log = logging.getLogger(__name__)


class EngineSync:
    """Brings one policy's engine to newer weight versions from the run's store.

    Args:
        engine: the policy's engine; its :attr:`~producers.engines.Engine.version` is the version loaded.
        puller: the policy's puller (announcements from the bus, or none: then targets come from the store
            listing); it keeps the host copy for engines that take tensors, and only follows versions for an
            engine that pulls from the store itself.
    """

    def __init__(self, engine: Engine, puller: Puller):
        self.engine, self.puller = engine, puller

    @property
    def pulls_itself(self) -> bool:
        """True when the engine's server reads the store itself (no host copy is kept here)."""
        return self.engine.pulls_from_store

    def newest(self) -> int | None:
        """The newest version the engine could move to: with a bus, the newest announced version that is in the
        store (:meth:`~weights.puller.Puller.newest_durable`, which never waits on the store more than a
        second); without one, the newest version in the store listing (None: nothing published).

        Raises:
            weights.store.StoreError: without a bus, the store cannot be listed.
        """
        if self.puller.follows_announcements:
            return self.puller.newest_durable()
        return max(self.puller.store.versions(self.puller.policy), default=None)

    def loadable(self) -> int | None:
        """The version the engine can be handed now without the store (the host copy is ahead of the engine),
        else None (always None for an engine that pulls itself)."""
        v = self.puller.version
        return v if not self.pulls_itself and v is not None and v > self.engine.version else None

    def fetch(self, version: int) -> None:
        """Bring the host copy to ``version`` (blocking: downloads, decodes and verifies); nothing for an engine
        that pulls itself. The engine keeps its weights until :meth:`load`.

        Raises:
            weights.puller.WeightsUnavailable: the version cannot be reached now; the host copy is unchanged.
        """
        if not self.pulls_itself:
            self.puller.sync(version)

    def load(self, version: int) -> None:
        """Hand ``version`` to the engine: the tensors of the host copy that changed since the last load (the
        host copy must be at ``version``: :meth:`fetch` first), or, for an engine that pulls itself, the version
        and its announced checksum (None without an announcement: the server's own checks of every object stand).
        Call it on the engine's thread. On success the changed set starts again, empty; on failure it is kept,
        so the next load sends those tensors again.

        Raises:
            producers.engines.EngineUpdateError: the engine could not load the version; it keeps its old one.
            ValueError: the host copy is not at ``version``.
        """
        if self.pulls_itself:
            ann = self.puller.announced.get(version)
            self.engine.pull(self.puller.store.uri, self.puller.store.run, self.puller.policy, version,
                             ann.sha256 if ann is not None else None)
            return
        puller = self.puller
        if puller.version != version:
            raise ValueError(f"policy {puller.policy!r}: the host copy is at version {puller.version}, not {version}")
        changed = puller.changed
        state = puller.state if changed is None else {name: puller.state[name] for name in sorted(changed)}
        self.engine.load_weights(state, version)
        puller.changed = set()
        log.debug("policy %s: version %d loaded (%s tensors handed over)", puller.policy, version,
                  "all" if changed is None else len(state))

    def update(self, version: int | None = None) -> int:
        """Fetch and load ``version`` (default: :meth:`newest`) if it is newer than the engine's; blocking.

        Returns:
            The engine's version afterwards.

        Raises:
            weights.puller.WeightsUnavailable: the version cannot be reached now.
            weights.store.StoreError: without a bus, the store cannot be listed.
            producers.engines.EngineUpdateError: the engine could not load it.
        """
        version = self.newest() if version is None else version
        if version is not None and version > self.engine.version:
            self.fetch(version)
            self.load(version)
        return self.engine.version
