"""Replay: retrain a policy from its recorded ``samples.<policy>`` topic, to rerun an experiment.

A run's training data stays on the bus, so an experiment can be rerun without
rolling out again. The replay reads ``samples.<policy>`` from the beginning as a
new consumer group ``replay.<policy>.<id>`` (the original trainer's offsets are
never touched) and trains a fresh :class:`~trainer.loop.Trainer` from the same
initial model and seed.

Two modes:

- **exact** (the trained-groups log is available): the serving stage's batch
  composition depends on timing (what had arrived when a batch was cut), so the
  replay does not re-serve. It trains version ``v`` on exactly the groups the
  original trainer logged for ``v`` in ``<run_dir>/trainer.<policy>/trained_groups.jsonl``
  (fresh groups, then replay-pool groups, in the recorded order). With the same
  trainer config, seed and CPU thread count, every version's weights are then
  bit-identical to the original's: :func:`weights.codec.state_sha256` of the
  bf16 CPU copy (:meth:`~trainer.loop.Trainer.publish_state`) equals the sha256
  the original announced on the ``weights`` topic.
- **reserve** (no log, e.g. on another machine): the groups are re-served by a
  :class:`~consumers.serving.ServingStage` with the config's batch size and
  staleness bound. This reruns the experiment on the same data, but the batches
  differ from the original's, so the checksums are not expected to match.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from topics.bus import Bus, Consumer, TopicPartition, connect
from topics.codec import MessageError, decode
from topics.names import TopicNames
from topics.schemas import TrajectoryGroup, WeightAnnouncement
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from weights.codec import read_header, state_sha256
from weights.store import StoreError, WeightStore

if TYPE_CHECKING:
    from astraflow.config import RunConfig

log = logging.getLogger(__name__)

#: ``on_version(version, sha256)``, called after each replayed step.
OnVersion = Callable[[int, str], None]


class ReplayError(RuntimeError):
    """The replay cannot run: logged groups are missing from the topic."""


class TrainedLogError(ValueError):
    """The trained-groups log is malformed; the message names the file, the line and the reason."""


@dataclass(frozen=True)
class LoggedStep:
    """One line of the trained-groups log: the version a step produced and the group ids it trained on, in order."""

    version: int
    group_ids: tuple[str, ...]


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


def read_trained_log(path: str | Path) -> list[LoggedStep]:
    """Read a trainer's ``trained_groups.jsonl``: per line ``{"version", "group_ids", "replayed_ids"}``.

    A step's groups are its fresh ``group_ids`` followed by its ``replayed_ids``
    (the order of :class:`~consumers.serving.ServedBatch.groups`).

    Raises:
        FileNotFoundError: no log at ``path``.
        TrainedLogError: a line is not such a JSON object, or the versions are not 1, 2, 3, ...
    """
    steps: list[LoggedStep] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                ids = [str(i) for i in entry["group_ids"]] + [str(i) for i in entry.get("replayed_ids", [])]
                version = int(entry["version"])
            except (ValueError, KeyError, TypeError) as e:
                raise TrainedLogError(f"trained-groups log {path}, line {n}: not a "
                                  f'{{"version", "group_ids", "replayed_ids"}} object ({type(e).__name__}: {e})') from None
            if version != len(steps) + 1:
                raise TrainedLogError(f"trained-groups log {path}, line {n}: version {version}, expected {len(steps) + 1}")
            if not ids:
                raise TrainedLogError(f"trained-groups log {path}, line {n}: version {version} trained no groups")
            steps.append(LoggedStep(version, tuple(ids)))
    return steps


def _assign_all(consumer: Consumer, bus: Bus, topic: str) -> None:
    parts = [TopicPartition(topic, p) for p in range(bus.admin().describe_topic(topic).partitions)]
    consumer.assign(parts)
    consumer.seek_to_beginning(parts)


def read_groups(bus: Bus, topic: str, group: str, wanted: set[str], idle_s: float = 5.0) -> dict[str, TrajectoryGroup]:
    """Read ``topic`` from the beginning as consumer ``group`` until every id in ``wanted`` is found.

    Records that do not decode as a :class:`TrajectoryGroup` are skipped (the
    original trainer dead-lettered them); a repeated ``group_id`` keeps its first
    record, as the serving stage's de-duplication does. The group's offsets are
    committed at the end, so ``astraflow status`` shows what the replay read.

    Returns:
        ``{group_id: group}`` for the ids in ``wanted``.

    Raises:
        ReplayError: some wanted ids were not found before ``idle_s`` seconds passed with no new record
            (the topic's retention deleted them, or the log belongs to another run).
        topics.bus.BusError: the topic does not exist or the bus failed.
    """
    consumer = bus.consumer(group, client_id=group)
    try:
        _assign_all(consumer, bus, topic)
        found: dict[str, TrajectoryGroup] = {}
        ends: dict[TopicPartition, int] = {}
        last = time.monotonic()
        while len(found) < len(wanted) and time.monotonic() - last < idle_s:
            records = consumer.poll(max_records=500, timeout_s=0.5)
            if records:
                last = time.monotonic()
            for r in records:
                ends[r.tp] = max(ends.get(r.tp, 0), r.offset + 1)
                try:
                    g = decode(r.value, expect=TrajectoryGroup, topic=r.topic, partition=r.partition, offset=r.offset)
                except MessageError:
                    continue
                if g.group_id in wanted and g.group_id not in found:
                    found[g.group_id] = g
        if ends:
            consumer.commit(ends)
    finally:
        consumer.close()
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
                       versions: int | None = None, idle_s: float = 3.0) -> dict[int, str]:
    """The original run's sha256 per version of ``policy``.

    From the ``weights`` topic's announcements (read from the beginning without a
    consumer group), stopping once versions 1..``versions`` are all seen or after
    ``idle_s`` seconds without a record; versions missing there (the topic is
    compacted by policy, and a busy publisher coalesces versions) are read from
    the store's objects when ``store`` is given.

    Raises:
        topics.bus.BusError: the bus failed.
    """
    out: dict[int, str] = {}
    consumer = bus.consumer(None, client_id=f"replay-check-{policy}")
    try:
        _assign_all(consumer, bus, names.weights)
        last = time.monotonic()
        while time.monotonic() - last < idle_s and not (versions and all(v in out for v in range(1, versions + 1))):
            records = consumer.poll(max_records=500, timeout_s=0.5)
            if records:
                last = time.monotonic()
            for r in records:
                try:
                    ann = decode(r.value, expect=WeightAnnouncement, topic=r.topic, partition=r.partition,
                                 offset=r.offset)
                except MessageError:
                    continue
                if ann.policy == policy:
                    out[ann.version] = ann.sha256
    finally:
        consumer.close()
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
    state = trainer.publish_state()
    sha = state_sha256(state)
    if publisher is not None:
        publisher.publish(state, trainer.version)
        publisher.wait()
    if on_version is not None:
        on_version(trainer.version, sha)
    return trainer.version, len(groups), sha


def replay_exact(config: TrainerConfig, model_dir: str | Path, steps: list[LoggedStep],
                 groups: dict[str, TrajectoryGroup], *, publisher=None, on_version: OnVersion | None = None
                 ) -> list[tuple[int, int, str]]:
    """Train a fresh trainer on the logged steps, in order, and checksum each version.

    Args:
        config: the original trainer's config (same seed, dtypes, optimiser, batch splits).
        model_dir: the original initial model (version 0).
        steps: from :func:`read_trained_log`.
        groups: ``{group_id: group}`` holding every logged id (:func:`read_groups`).
        publisher: a ``weights.publisher.Publisher`` to publish each version through, or None.
        on_version: called as ``on_version(version, sha256)`` after each step.

    Returns:
        ``[(version, n_groups, sha256)]``: sha256 is :func:`weights.codec.state_sha256` of the
        bf16 CPU weights (:meth:`~trainer.loop.Trainer.publish_state`), what the original trainer announced.

    Raises:
        ReplayError: a logged id is not in ``groups``.
    """
    trainer = Trainer(config, model_dir)
    out = []
    for step in steps:
        missing = [i for i in step.group_ids if i not in groups]
        if missing:
            raise ReplayError(f"version {step.version}: groups {missing[:3]} were not read from the topic")
        out.append(_step(trainer, [groups[i] for i in step.group_ids], publisher, on_version))
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

    consumer = bus.consumer(group, client_id=group)
    producer = bus.producer()
    try:
        _assign_all(consumer, bus, names.samples(config.policy))
        serving = ServingStage(consumer, producer, names.samples(config.policy), names.deadletter,
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


def replay_run(cfg: RunConfig, policy: str, *, publish_as: str | None = None, trained_log: str | Path | None = None,
               on_version: OnVersion | None = None) -> ReplayResult:
    """Replay ``policy`` of the run ``cfg`` describes and check each version against the original's sha256.

    Exact when the trained-groups log exists (``trained_log``, default
    ``<run_dir>/trainer.<policy>/trained_groups.jsonl``), else re-served (module docstring).

    Args:
        cfg: the original run's config (bus, store, run name, the policy's model and trainer).
        publish_as: also publish every replayed version as run ``publish_as`` (its own ``weights``
            topic and store prefix), or None.
        on_version: called as ``on_version(version, sha256)`` after each step.

    Raises:
        KeyError: ``policy`` is not in ``cfg.policies``.
        ValueError: ``publish_as`` is the original run's name or not a valid run name.
        TrainedLogError: the log is malformed.
        ReplayError: logged groups are missing from the topic.
        topics.bus.BusError: the bus failed.
    """
    from astraflow.models import resolve_model
    from weights.publisher import Publisher

    pc = cfg.policies[policy]
    if publish_as == cfg.run:
        raise ValueError(f"--publish-as {publish_as!r} is the original run: give a new run name")
    log_path = Path(trained_log) if trained_log else cfg.run_dir / f"trainer.{policy}" / "trained_groups.jsonl"
    bus, names, group = connect(cfg.bus), TopicNames(cfg.run), replay_group(policy)
    publisher = None
    if publish_as is not None:
        new_names = TopicNames(publish_as)
        bus.admin().create_topic(new_names.weights, partitions=1, compacted=True)
        publisher = Publisher(WeightStore(cfg.store, publish_as), bus, new_names, policy,
                              producer_id=f"replay.{policy}")
    try:
        if log_path.is_file():
            mode, steps = "exact", read_trained_log(log_path)
            groups = read_groups(bus, names.samples(policy), group, {i for s in steps for i in s.group_ids})
            trained = replay_exact(cfg.trainer_config(policy), resolve_model(pc.model), steps, groups, publisher=publisher,
                                   on_version=on_version)
        else:
            log.warning("no trained-groups log at %s: re-serving %s through the serving stage (not bit-exact)",
                        log_path, names.samples(policy))
            mode = "reserve"
            trained = replay_reserve(bus, names, cfg.trainer_config(policy), resolve_model(pc.model), group, steps=pc.steps,
                                     batch_groups=pc.batch_groups, max_staleness=pc.max_staleness,
                                     publisher=publisher, on_version=on_version)
    finally:
        if publisher is not None:
            publisher.close()
    recorded = recorded_checksums(bus, names, policy, WeightStore(cfg.store, cfg.run), versions=len(trained))
    return ReplayResult(mode, group, [VersionCheck(v, n, sha, recorded.get(v)) for v, n, sha in trained])
