"""Replay: retrain a policy from its recorded ``samples.<policy>`` topic, to rerun an experiment.

A run's training data stays on the bus, so an experiment can be rerun without
rolling out again. The replay reads ``samples.<policy>`` from the beginning as a
new consumer group ``replay.<policy>.<id>`` (the original trainer's offsets are
never touched) and trains a fresh :class:`~trainer.loop.Trainer` from the same
initial model and seed.

Two modes:

- **exact** (the run's ``trained`` topic holds the policy's batches): the serving stage's batch
  composition depends on timing (what had arrived when a batch was cut), so the
  replay does not re-serve. It trains version ``v`` on exactly the groups the
  original trainer recorded for ``v`` (:func:`trainer.service.trained_batches`:
  fresh groups, then replay-pool groups, in the recorded order). With the same
  trainer config, seed and CPU thread count, every version's weights are then
  bit-identical to the original's: :func:`weights.codec.state_sha256` of the
  published CPU copy (:meth:`~trainer.loop.Trainer.publish_state`) equals the sha256
  the original announced on the ``weights`` topic.
- **reserve** (no recorded batches, e.g. a run from before they were recorded): the groups are re-served by a
  :class:`~consumers.serving.ServingStage` with the config's batch size and
  staleness bound. This reruns the experiment on the same data, but the batches
  differ from the original's, so the checksums are not expected to match.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from topics.bus import Bus, BusError, TopicPartition, connect
from topics.follow import Follower
from topics.layout import RunTopics
from topics.names import TopicNames
from topics.schemas import TrainedBatch, TrajectoryGroup, WeightAnnouncement
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.service import trained_batches
from weights.codec import read_header, state_sha256
from weights.store import StoreError, WeightStore

if TYPE_CHECKING:
    from astraflow.config import ReplaySection

log = logging.getLogger(__name__)

#: ``on_version(version, sha256)``, called after each replayed step.
OnVersion = Callable[[int, str], None]


class ReplayError(RuntimeError):
    """The replay cannot run: recorded groups are missing from the topic, or recorded versions have gaps."""


@dataclass
class VersionCheck:
    """One replayed version: its ``sha256`` and the original run's (``recorded``; None if not announced or stored)."""

    version: int
    groups: int
    sha256: str
    recorded: str | None

    @property
    def status(self) -> str:
        """``match``, ``mismatch`` or ``unrecorded``."""
        if self.recorded is None:
            return "unrecorded"
        return "match" if self.recorded == self.sha256 else "mismatch"


@dataclass
class ReplayResult:
    """The outcome of a replay: its ``mode`` (``exact`` or ``reserve``) and one check per trained version."""

    mode: str
    group: str
    checks: list[VersionCheck] = field(default_factory=list)

    @property
    def matched(self) -> int:
        return sum(c.status == "match" for c in self.checks)

    @property
    def mismatched(self) -> list[int]:
        return [c.version for c in self.checks if c.status == "mismatch"]

    @property
    def ok(self) -> bool:
        """An exact replay reproduced every announced version (a re-served one is never expected to)."""
        return bool(self.checks) and not self.mismatched

    def summary(self) -> dict:
        """``{"metric": "replay", "versions", "matched", "mismatched", "unrecorded", "mode", "group"}``."""
        return {"metric": "replay", "versions": len(self.checks), "matched": self.matched,
                "mismatched": self.mismatched,
                "unrecorded": [c.version for c in self.checks if c.status == "unrecorded"],
                "mode": self.mode, "group": self.group}


def replay_group(policy: str) -> str:
    """A fresh consumer group name ``replay.<policy>.<8 hex digits>``."""
    return f"replay.{policy}.{uuid.uuid4().hex[:8]}"


def read_groups(bus: Bus, topic: str, group: str, wanted: set[str], timeout_s: float = 300.0
                ) -> dict[str, TrajectoryGroup]:
    """Read ``topic`` to its end (a :class:`~topics.follow.Follower`: from the beginning, every partition) and
    keep the groups whose ids are in ``wanted``.

    Records that do not decode as a :class:`TrajectoryGroup` are skipped (the
    original trainer dead-lettered them); a repeated ``group_id`` keeps its first
    record, as the serving stage's de-duplication does. The offsets read are then
    committed as consumer group ``group`` (the original trainer's are never touched),
    so ``astraflow status`` shows what the replay read.

    Returns:
        ``{group_id: group}`` for the ids in ``wanted``.

    Raises:
        ReplayError: some wanted ids are not on the topic (its retention deleted them, or the log belongs
            to another run).
        topics.bus.BusError: the topic does not exist, the bus failed, or the topic was not read within
            ``timeout_s`` seconds.
    """
    follower = Follower(bus, topic, TrajectoryGroup, client_id=group)
    try:
        found: dict[str, TrajectoryGroup] = {}
        for _, g in follower.read_to_end(timeout_s):
            if g.group_id in wanted and g.group_id not in found:
                found[g.group_id] = g
        read = {TopicPartition(topic, p): o for p, o in follower.positions.items()}
    finally:
        follower.close()
    committer = bus.consumer(group, client_id=group)
    try:
        committer.commit(read)
    finally:
        committer.close()
    missing = wanted - found.keys()
    if missing:
        raise ReplayError(f"{len(missing)} of {len(wanted)} logged groups are not on {topic} "
                          f"(deleted by retention, or the log is from another run), e.g. {sorted(missing)[:3]}")
    return found


def _store_sha256(store: WeightStore, key: str, kind: str) -> str:
    """The sha256 recorded in a stored object, read with ranged GETs: a delta's header or a snapshot's metadata."""
    if kind == "delta":
        return read_header(store.get(key)).sha256
    head_len = int.from_bytes(store.get(key, 0, 8), "little")  # safetensors: u64 header length, then JSON
    return json.loads(store.get(key, 8, head_len))["__metadata__"]["sha256"]


def recorded_checksums(bus: Bus, names: TopicNames, policy: str, store: WeightStore | None = None,
                       timeout_s: float = 30.0) -> dict[int, str]:
    """The original run's sha256 (hex) per version of ``policy``.

    From the ``weights`` topic's announcements, read to its end (a :class:`~topics.follow.Follower`);
    versions missing there (the topic is compacted by policy, and a busy publisher coalesces versions)
    are read from the store's objects when ``store`` is given.

    Raises:
        topics.bus.BusError: the bus failed, or the ``weights`` topic was not read within ``timeout_s`` seconds.
    """
    follower = Follower(bus, names.weights, WeightAnnouncement, client_id=f"replay-check-{policy}")
    try:
        out = {ann.version: ann.sha256 for _, ann in follower.read_to_end(timeout_s) if ann.policy == policy}
    finally:
        follower.close()
    if store is not None:
        for version, objs in store.versions(policy).items():
            if version in out:
                continue
            for kind in ("delta", "full"):
                if kind in objs:
                    try:
                        out[version] = _store_sha256(store, objs[kind].key, kind)
                        break
                    except (StoreError, ValueError, KeyError):
                        continue
    return out


def _step(trainer: Trainer, groups: list[TrajectoryGroup], publisher, on_version: OnVersion | None
          ) -> tuple[int, int, str]:
    """Train one step, checksum the bf16 CPU weights, publish them (every version: nothing is coalesced)."""
    trainer.train_step(groups)
    return _checksum(trainer, len(groups), publisher, on_version)


def _checksum(trainer: Trainer, n_groups: int, publisher, on_version: OnVersion | None) -> tuple[int, int, str]:
    """Checksum the trainer's bf16 CPU weights as its current version and publish them."""
    state = trainer.publish_state()
    sha = state_sha256(state)
    if publisher is not None:
        publisher.publish(state, trainer.version)
        publisher.wait()
    if on_version is not None:
        on_version(trainer.version, sha)
    return trainer.version, n_groups, sha


def replay_exact(config: TrainerConfig, model_dir: str | Path, steps: list[TrainedBatch],
                 groups: dict[str, TrajectoryGroup], *, publisher=None, on_version: OnVersion | None = None
                 ) -> list[tuple[int, int, str]]:
    """Train a fresh trainer on the recorded steps, in order, and checksum each version: version ``v``
    on its fresh ``group_ids`` followed by its ``replayed_ids`` (the order of
    :class:`~consumers.serving.ServedBatch.groups`). A renumbering record (``base_version`` set: a resumed
    trainer gave its checkpoint's weights a new version) renumbers the weights without training.

    Args:
        config: the original trainer's config (same seed, dtypes, optimiser, batch splits).
        model_dir: the original initial model (version 0).
        steps: the lineage, each version trained from the one before or renumbered from its ``base_version``
            (:func:`trainer.service.trained_batches`).
        groups: ``{group_id: group}`` holding every recorded id (:func:`read_groups`).
        publisher: a ``weights.publisher.Publisher`` to publish each version through, or None.
        on_version: called as ``on_version(version, sha256)`` after each step.

    Returns:
        ``[(version, n_groups, sha256)]``: sha256 is :func:`weights.codec.state_sha256` of the
        published CPU weights (:meth:`~trainer.loop.Trainer.publish_state`), what the original trainer announced.

    Raises:
        ReplayError: a version's base is not the version before it in ``steps`` (the record has gaps), or a
            recorded id is not in ``groups``.
    """
    trainer = Trainer(config, model_dir)
    out = []
    for step in steps:
        base = step.version - 1 if step.base_version is None else step.base_version
        if base != trainer.version:
            raise ReplayError(f"version {step.version} was made from version {base}, and the record reaches version "
                              f"{trainer.version}: the record has gaps")
        if step.base_version is not None:
            trainer.renumber(step.version)
            out.append(_checksum(trainer, 0, publisher, on_version))
            continue
        ids = [*step.group_ids, *step.replayed_ids]
        missing = [i for i in ids if i not in groups]
        if missing:
            raise ReplayError(f"version {step.version}: groups {missing[:3]} were not read from the topic")
        out.append(_step(trainer, [groups[i] for i in ids], publisher, on_version))
    return out


def replay_reserve(bus: Bus, names: TopicNames, config: TrainerConfig, model_dir: str | Path, group: str, *,
                   steps: int, batch_groups: int, max_staleness: int, publisher=None, idle_s: float = 5.0,
                   on_version: OnVersion | None = None) -> list[tuple[int, int, str]]:
    """Re-serve ``samples.<policy>`` from the beginning through a :class:`~consumers.serving.ServingStage`
    (consumer ``group``) and train up to ``steps`` versions; not bit-exact (module docstring).

    Stops early when no batch arrives within ``idle_s`` seconds. Returns ``[(version, n_groups, sha256)]``.

    Raises:
        topics.bus.BusError: the topic does not exist or the bus failed.
    """
    from consumers.serving import ServingStage

    topic = names.samples(config.policy)
    consumer = bus.consumer(group, client_id=group)
    producer = bus.producer()
    try:
        parts = [TopicPartition(topic, p) for p in range(bus.admin().describe_topic(topic).partitions)]
        consumer.assign(parts)
        consumer.seek_to_beginning(parts)
        serving = ServingStage(consumer, producer, topic, names.deadletter,
                               max_staleness=max_staleness, batch_groups=batch_groups)
        trainer = Trainer(config, model_dir)
        out = []
        while trainer.version < steps:
            batch = serving.next_batch(trainer.version, timeout_s=idle_s)
            if batch is None:
                break
            out.append(_step(trainer, batch.groups, publisher, on_version))
        serving.commit()
        return out
    finally:
        consumer.close()
        producer.close()


def replay_run(cfg: ReplaySection, *, publish_as: str | None = None, threads: int | None = None,
               on_version: OnVersion | None = None) -> ReplayResult:
    """Replay the policy ``cfg`` names and check each version against the original's sha256.

    Exact when the run's ``trained`` topic holds the policy's batches, else re-served (module docstring).

    Args:
        cfg: the original run's replay section (:meth:`astraflow.config.RunConfig.replay_section`: bus, store, run
            name, the policy's model and trainer).
        publish_as: also publish every replayed version as run ``publish_as`` (its own ``weights``
            topic and store prefix), or None.
        threads: torch's CPU threads (None: ``$OMP_NUM_THREADS``, else 1, as ``astraflow run`` gives its trainers).
        on_version: called as ``on_version(version, sha256)`` after each step.

    Raises:
        ValueError: ``threads`` is below 1; ``publish_as`` is the original run's name or not a valid run name; the
            bus has no ``samples`` topic of this run and policy (no such run: a mistyped run name or bus).
        ReplayError: recorded groups are missing from the topic, or the recorded versions have gaps.
        topics.bus.BusError: the bus failed.
    """
    from weights.models import resolve_model
    from weights.publisher import Publisher

    threads = threads if threads is not None else int(os.environ.get("OMP_NUM_THREADS") or 1)
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    policy = cfg.policy
    if publish_as == cfg.run:
        raise ValueError(f"--publish-as {publish_as!r} is the original run: give a new run name")
    bus, names, group = connect(cfg.bus, cfg.kafka), TopicNames(cfg.run), replay_group(policy)
    if names.samples(policy) not in bus.admin().list_topics():
        raise ValueError(f"no run {cfg.run!r} with policy {policy!r} on bus {cfg.bus}: it has no topic "
                         f"{names.samples(policy)} (a mistyped run name or bus?)")
    publisher = None
    if publish_as is not None:
        new_names = TopicNames(publish_as)
        RunTopics(new_names).weights.create(bus.admin())
        publisher = Publisher(WeightStore(cfg.store, publish_as), bus, new_names, policy,
                              producer_id=f"replay.{policy}")
    try:
        try:
            steps = trained_batches(bus, names, policy)
        except BusError as e:  # a run from before the trained topic: nothing recorded
            log.warning("cannot read %s (%s)", names.trained, e)
            steps = []
        if steps:
            mode = "exact"
            groups = read_groups(bus, names.samples(policy), group,
                                 {i for s in steps for i in (*s.group_ids, *s.replayed_ids)})
            trained = replay_exact(cfg.trainer, resolve_model(cfg.model), steps, groups, publisher=publisher,
                                   on_version=on_version)
        else:
            log.warning("no trained batches of %s on %s: re-serving %s through the serving stage (not bit-exact)",
                        policy, names.trained, names.samples(policy))
            mode = "reserve"
            trained = replay_reserve(bus, names, cfg.trainer, resolve_model(cfg.model), group, steps=cfg.steps,
                                     batch_groups=cfg.batch_groups, max_staleness=cfg.max_staleness,
                                     publisher=publisher, on_version=on_version)
    finally:
        if publisher is not None:
            publisher.close()
    recorded = recorded_checksums(bus, names, policy, WeightStore(cfg.store, cfg.run))
    return ReplayResult(mode, group, [VersionCheck(v, n, sha, recorded.get(v)) for v, n, sha in trained])
