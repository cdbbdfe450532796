"""The trainer process of one policy: serve batches, train, publish, checkpoint, commit.

Per step: the serving stage assembles a batch from ``samples.<policy>``, the
:class:`~trainer.loop.Trainer` trains on it, this service publishes the new version, and
metrics go out. Every ``checkpoint_every`` steps (and at the end):

1. the group ids of each step since the last checkpoint go to the compacted
   ``trained`` topic (:class:`~topics.schemas.TrainedBatch`, key ``<policy>/<version>``)
   and are acknowledged;
2. the checkpoint (model, optimizer, version, offsets, serving and replay state)
   is written atomically;
3. the consumed offsets are committed on the bus, without waiting for the broker (the checkpoint holds them).

Between checkpoints the group's position is committed after every step too (:meth:`TrainerService._commit_progress`),
so that the group's committed lag on ``samples.<policy>`` is what waits for this trainer: the one measure RaaS's
in-flight count and the run's watchdog read. A restart does not resume from those commits: it loads the latest
checkpoint and seeks to the offsets the checkpoint holds (to the beginning without one), so steps after the
checkpoint are redone. A version number is never reused for other weights: when
versions above the checkpoint's were already published (in the store) or recorded
(on ``trained``) by the steps lost, the checkpoint's weights become the next free
version ``u + 1`` and are published at once (:meth:`Trainer.renumber`), the redone
steps follow from ``u + 2``, and versions ``c + 1 .. u`` stay as they were, off the
lineage: their groups are dropped as stale by the serving stage and their records
left out by :func:`trained_batches`, so in the history every group is trained exactly
once. ``steps`` counts the steps of the lineage, so the final version is ``steps``
plus the versions such resumes skipped.

With ``trainer.ranks`` N > 1 (under torchrun) this class runs on rank 0 only: it alone reads the bus,
and it sends each rank-wide action (restore, train on a batch, checkpoint, stop) to the other ranks,
which run :func:`run_follower` and join the collectives (FSDP's, the weight gather, DCP's).
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from consumers.serving import ServingStage
from policies.base import ServingPolicy
from policies.staleness import too_stale
from topics.bus import Bus, BusError, FatalBusError, connect
from topics.codec import encode, headers_for
from topics.follow import LatestByKey
from topics.kafka_security import KafkaSecurity
from topics.layout import RunTopics
from topics.names import TopicNames
from topics.patience import patiently
from topics.liveness import ProgressWatch
from topics.schemas import TrainedBatch, TrainerProgress
from trainer.collapse import Collapse, CollapseWatch
from trainer.checkpoint import (load_checkpoint, load_latest, prepare_save, save_checkpoint,
                                save_distributed_checkpoint)
from trainer.config import TrainerConfig
from trainer.coupling import VersionBarrier
from trainer.loop import Trainer
from trainer.metrics import MetricsSink

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
#: seconds after which a trainer sends its unchanged progress commit again (one that did not land is then made)
PROGRESS_RESEND_S = 5.0
#: the copy of the checkpoint taken at the best reward window (``stop_on_collapse``), beside ``checkpoints``
BEST_CHECKPOINT = "best-checkpoint"


def recorded_batches(bus: Bus, names: TopicNames, policy: str, timeout_s: float = 30.0) -> dict[int, TrainedBatch]:
    """Every version of ``policy`` recorded on ``names.trained`` -> its newest :class:`TrainedBatch`, off the
    lineage or not.

    Raises:
        topics.bus.BusError: the topic does not exist, or was not read within ``timeout_s`` seconds.
    """
    follower = LatestByKey(bus, names.trained, TrainedBatch, client_id=f"trained-{policy}")
    try:
        latest = follower.read_to_end(timeout_s)
    finally:
        follower.close()
    return {b.version: b for b in latest.values() if b.policy == policy}


def trained_batches(bus: Bus, names: TopicNames, policy: str, timeout_s: float = 30.0) -> list[TrainedBatch]:
    """What ``policy``'s trainer trained, step by step, on the lineage of its newest weights: the newest
    :class:`TrainedBatch` per version on ``names.trained``, sorted by version, leaving out versions
    ``c + 1 .. r - 1`` of each renumbering record (``base_version`` ``c``, version ``r``: steps lost with
    a killed trainer and redone; see the module docstring). A renumbering record (no groups) is kept.

    Raises:
        topics.bus.BusError: the topic does not exist, or was not read within ``timeout_s`` seconds.
    """
    recorded = recorded_batches(bus, names, policy, timeout_s)
    off = [(b.base_version, b.version) for b in recorded.values() if b.base_version is not None]
    return [recorded[v] for v in sorted(recorded) if not any(c < v < r for c, r in off)]


class WeightPublisher(Protocol):
    """Anything with ``publish(state_dict, version, samples_consumed)``, ``durable_version`` (the
    newest version stored and announced, None before any), ``newest_stored_version()`` (the newest
    version in the store, by any process, None before any), ``wait(timeout_s)`` (until what was handed is
    published or failed; False on timeout), ``errors`` (failed publishes) and ``last_publish`` (figures of the
    newest version published, reported with each step), e.g. ``weights.publisher.Publisher``."""

    def publish(self, state_dict: dict[str, torch.Tensor], version: int,
                samples_consumed: int | None = None) -> Any: ...

    def newest_stored_version(self) -> int | None: ...

    def wait(self, timeout_s: float | None = None) -> bool: ...

    @property
    def durable_version(self) -> int | None: ...

    errors: list[BaseException]
    last_publish: dict[str, float]


@dataclass
class ServiceConfig:
    """How the trainer process runs (sizes in groups, times in seconds).

    ``steps``: stop after this many steps on the lineage (:attr:`TrainerService.steps_done`). ``idle_exit_s``: also
    stop after this long without data (None: wait forever). ``barrier_peers``:
    lockstep coupling with these policies (peer -> its ``steps``; see
    :class:`trainer.coupling.VersionBarrier`); None: independent. ``checkpoint_every``:
    steps between checkpoints. ``keep_checkpoints``: complete checkpoints kept. ``kafka``: the
    bus's security settings (None: from the ``ASTRAFLOW_KAFKA_*`` environment). ``stop_on_collapse``: stop when
    the reward collapses (:mod:`trainer.collapse`), and keep the checkpoint of the best reward window in
    ``<run_dir>/best-checkpoint``; either way a collapse is alerted on ``metrics`` and logged.
    """

    bus: str
    run: str
    model_dir: Path
    run_dir: Path
    trainer: TrainerConfig
    steps: int = 100
    barrier_peers: dict[str, int] | None = None
    batch_groups: int = 16
    max_staleness: int = 8
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    idle_exit_s: float | None = None
    poll_timeout_s: float = 5.0
    console: bool = True
    kafka: KafkaSecurity | None = None
    stop_on_collapse: bool = False


class TrainerService:
    """One policy's trainer process. Build it, then :meth:`run`.

    Args:
        config: the :class:`ServiceConfig`.
        publisher: what each version's weights are handed to, ``publish(state_dict, version, samples_consumed)``
            after every step (the Weight Manager's ``weights.publisher.Publisher``), or None.
        replay: the serving policy (:func:`policies.registry.build_serving`) whose ``ratio`` is the
            fraction of each batch it supplies, or None.
    """

    def __init__(self, config: ServiceConfig, *, publisher: WeightPublisher | None = None,
                 replay: ServingPolicy | None = None):
        self.config = cfg = config
        policy = cfg.trainer.policy
        self.names = TopicNames(cfg.run)
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.bus = connect(cfg.bus, cfg.kafka)
        admin = self.bus.admin()
        topics = RunTopics(self.names)
        for spec in (topics.samples(policy), topics.metrics, topics.deadletter, topics.control, topics.trained):
            spec.create(admin)
        self.producer = self.bus.producer()
        # A dynamic member: after a broker outage librdkafka rejoins it by itself, where a static member can be fenced
        # (FENCED_INSTANCE_ID, fatal), and a restart of the trainer, which redoes the steps after its checkpoint, is
        # the costliest of the run; a restarted trainer waits out the old member's session once (session_timeout_s).
        self.consumer = self.bus.consumer(self.names.trainer_group(policy), client_id=f"trainer.{policy}.{os.getpid()}")
        self.replay = replay
        #: the liveness rule: names the positions when no batch comes, and stops a trainer whose reads are stalled
        self.liveness = ProgressWatch(self.consumer, admin, self.names.samples(policy),
                                      self.names.trainer_group(policy), f"trainer {policy}", log)
        self.serving = ServingStage(
            self.consumer, self.producer, self.names.samples(policy), self.names.deadletter,
            max_staleness=cfg.max_staleness, batch_groups=cfg.batch_groups, replay=replay)
        self.trainer = Trainer(cfg.trainer, cfg.model_dir)
        self.publisher = publisher
        self._ranks = cfg.trainer.ranks
        self.metrics = MetricsSink(f"trainer.{policy}", policy, producer=self.producer, topic=self.names.metrics,
                                   console=cfg.console, jsonl_path=self.run_dir / "metrics.jsonl")
        self.barrier = VersionBarrier(self.bus, self.names, cfg.barrier_peers) if cfg.barrier_peers else None
        self._pending: list[TrainedBatch] = []  # steps since the last checkpoint
        self._renumbered: list[tuple[int, int]] = []  # (checkpoint version, its new number), oldest first
        self._committed: dict = {}  # the offsets of the latest checkpoint
        self._progress_committed: dict = {}  # the offsets last committed after a step (_commit_progress)
        self._progress_commit_at = 0.0  # time.monotonic() of that commit
        self._store_logged = 0.0
        self._publish_alerted: tuple[int, int | None] = (0, None)  # (publish errors, version while failing)
        self._progress_sent: tuple[int, int, bool, bool, bool] | None = None
        self._progress_ts = 0.0
        self._starving = False  # the last wait for a batch ran out with nothing to train
        self.collapse_watch = CollapseWatch()
        #: the collapse that stopped this trainer (``stop_on_collapse``), else None
        self.collapsed: Collapse | None = None
        self._best_kept: float | None = None  # the trailing reward window of the checkpoint in best-checkpoint
        self._resume()
        if self.trainer.backend.CHECKPOINT_DIR is None:  # checkpoints go through save_pretrained
            prepare_save(self.trainer.model)

    def _resume(self) -> None:
        ckpt = load_latest(self.run_dir / CHECKPOINTS)
        self._command("restore", None if ckpt is None else str(ckpt.path))
        # Nothing after the checkpoint is durable: each partition is read from the checkpoint's offset (a seek, which
        # wins over this default), every other one from its start, never from the group's commits of lost steps
        self.consumer.seek_to_beginning()
        if ckpt is not None:
            self.trainer.restore(ckpt)
            self.serving.load_state_dict(ckpt.serving, ckpt.offsets)
            self._committed = self.serving.offsets_to_commit()
            if self.replay is not None and "replay" in ckpt.policies:
                self.replay.load_state_dict(ckpt.policies["replay"])
            self._renumbered = list(ckpt.renumbered)
        base, newest = self.trainer.version, self._newest_used_version()
        if newest > base:
            version = newest + 1
            self._command("renumber", version, self.publisher is not None)
            self.trainer.renumber(version)
            if self.publisher is not None:
                self.publisher.publish(self.trainer.publish_state(), version, self.serving.consumed())
            self._renumbered.append((base, version))
            self._pending.append(TrainedBatch(policy=self.config.trainer.policy, version=version, base_version=base,
                                              group_ids=[]))
            log.warning("trainer %s: resumed at version %d, and versions %d..%d were already published or recorded "
                        "by steps lost since: they keep their weights, off the lineage (groups rolled out on them "
                        "are dropped as stale); the checkpoint's weights are version %d, the redone steps follow",
                        self.config.trainer.policy, base, base + 1, newest, version)
        self.serving.off_lineage = [(c + 1, r - 1) for c, r in self._renumbered]

    def _newest_used_version(self) -> int:
        """The newest version of this policy in the weight store or on ``trained`` (0: none): every version up to
        it may have been seen, so none of them is used again.

        Raises:
            weights.store.StoreError: the store could not be listed for 180 s (the publisher retries).
            topics.bus.BusError: ``trained`` was not read within the bus patience.
        """
        policy = self.config.trainer.policy
        stored = self.publisher.newest_stored_version() if self.publisher is not None else None
        recorded = patiently(f"trainer.{policy}: read {self.names.trained}",
                             lambda: recorded_batches(self.bus, self.names, policy), log=log)
        return max([stored or 0, *recorded])

    @property
    def steps_done(self) -> int:
        """Steps on the lineage of the current weights: :attr:`Trainer.version` less the versions skipped."""
        return self.trainer.version - sum(r - c for c, r in self._renumbered)

    def checkpoint(self) -> Path:
        """Send the trained batches to ``trained`` (acknowledged), write the checkpoint atomically, then
        commit the offsets.

        Raises:
            topics.bus.BusError: the bus failed for longer than the patience (nothing was committed).
        """
        for batch in self._pending:
            self.producer.send(self.names.trained, encode(batch), key=f"{batch.policy}/{batch.version}",
                               headers=headers_for(batch))
        patiently(f"trainer.{self.config.trainer.policy}: trained batches", self.producer.flush, log=log)
        offsets = self.serving.offsets_to_commit()
        policies = {"replay": self.replay.state_dict()} if self.replay is not None else {}
        if self.trainer.backend.CHECKPOINT_DIR is not None:  # FSDP2 on several ranks, or DeepSpeed
            self._command("checkpoint")
            path = save_distributed_checkpoint(
                self.run_dir / CHECKPOINTS, version=self.trainer.version, backend=self.trainer.backend,
                model=self.trainer.model, offsets=offsets, serving=self.serving.state_dict(), policies=policies,
                renumbered=self._renumbered, keep=self.config.keep_checkpoints)
        else:
            path = save_checkpoint(
                self.run_dir / CHECKPOINTS, version=self.trainer.version, model=self.trainer.model,
                optimizer=self.trainer.optimizer, offsets=offsets, serving=self.serving.state_dict(),
                policies=policies, renumbered=self._renumbered, keep=self.config.keep_checkpoints)
        self._pending.clear()
        if self.config.stop_on_collapse:
            self._keep_if_best(path)
        # the checkpoint is durable and holds the offsets a restart resumes from: the group's commit only signals
        # progress (lag, RaaS's credit), so it does not wait for the broker; one refused before it left is retried
        patiently(f"trainer.{self.config.trainer.policy}: commit", lambda: self.serving.commit(offsets, wait=False),
                  log=log)
        self._committed = self._progress_committed = offsets
        self._commit_progress()  # on past the transaction markers after them
        return path

    def _while_waiting(self) -> None:
        """After each poll while the trainer waits for a batch: report its progress, and commit its position (the
        first commit after a (re)start is the resume point, so a consumer re-created or rebalanced later in this
        process resumes there, not at an earlier process's commits; stale drops release their credit at once)."""
        self.report_progress(starving=self._starving)
        self._commit_progress()

    def _commit_progress(self) -> None:
        """Commit the group's position after a step (the records trained or dropped, the buffered ones not, and the
        transaction markers after them: :meth:`~consumers.serving.ServingStage.progress_offsets`), so the committed
        lag on ``samples.<policy>`` is what waits for this trainer (module docstring); a restart resumes from its
        checkpoint's offsets, not these. The commit does not wait for the broker (one that does not land is superseded
        by the next, and the same offsets are sent again every :data:`PROGRESS_RESEND_S` seconds); one the bus refuses
        is logged at debug level and made again after the next step.

        Raises:
            topics.bus.FatalBusError: the consumer is unusable (a restart resumes from the checkpoint).
        """
        try:
            offsets = self.serving.progress_offsets()
            if not offsets or (offsets == self._progress_committed
                               and time.monotonic() - self._progress_commit_at < PROGRESS_RESEND_S):
                return
            self.serving.commit(offsets, wait=False)
        except FatalBusError:
            raise
        except BusError as e:
            log.debug("trainer %s: progress commit after version %d refused (%s); the next step commits it",
                      self.config.trainer.policy, self.trainer.version, e)
            return
        self._progress_committed, self._progress_commit_at = offsets, time.monotonic()

    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        """Train until ``steps`` steps on the lineage (:attr:`steps_done`), ``idle_exit_s`` without data, or
        ``stop`` is set (then the step in hand finishes and a checkpoint commits it); returns a summary.

        With ``stop_on_collapse``, a collapse (:meth:`_alert_collapse`) also stops it, after a checkpoint of the
        steps trained: :attr:`collapsed` then names it.

        Returns:
            {"version", "steps_run" (steps this process ran), "dropped_stale", "duplicates", "wall_s"}, and
            "collapsed" (the collapse's one-line description) when a collapse stopped it.
        """
        cfg = self.config
        start = time.perf_counter()
        steps_run, last_data = 0, time.monotonic()
        idle_from = last_data  # since when idle with partitions held, for trainer.idle_exit_s
        try:
            while self.steps_done < cfg.steps and not (stop is not None and stop.is_set()):
                self._report_publish_errors()
                if self._store_behind():
                    self.report_progress()
                    (stop or threading.Event()).wait(1.0)
                    continue
                barrier_s = 0.0
                if self.barrier is not None:
                    self.barrier.poll()
                    if self.barrier.behind(self.trainer.version):
                        self.report_progress(at_barrier=True)
                    barrier_s = self.barrier.wait(self.trainer.version, stop)
                if barrier_s is None:
                    break
                # RaaS throttles on this trainer's position: report it while waiting too (stale drops move it)
                batch = self.serving.next_batch(self.trainer.version, timeout_s=cfg.poll_timeout_s,
                                                on_poll=self._while_waiting)
                # it says so until it holds a batch again; a trainer without partitions (a rebalance) is not starving
                self._starving = batch is None and bool(self.consumer.assignment())
                if batch is None:
                    self.report_progress(starving=self._starving)
                    if self.serving.offsets_to_commit() != self._committed:
                        # Starved: checkpoint now, so the committed offsets (the lag `status`
                        # shows, and RaaS backpressure before this trainer's first announcement)
                        # cover what was trained or dropped as stale. A commit refused during a
                        # rebalance is retried at the next idle poll (the checkpoint holds the
                        # offsets either way).
                        try:
                            self.checkpoint()
                        except FatalBusError:
                            raise  # the consumer is unusable: a restart resumes from the checkpoint
                        except BusError as e:
                            log.warning("idle checkpoint: offsets not committed yet (%s)", e)
                    self.liveness.check(last_data)
                    if not self.consumer.assignment():
                        # Waiting for the group to hand over partitions is not idleness: a restarted
                        # member may wait out a rebalance before it can see any data.
                        idle_from = time.monotonic()
                    elif cfg.idle_exit_s is not None and time.monotonic() - idle_from > cfg.idle_exit_s:
                        break
                    continue
                last_data = idle_from = time.monotonic()
                fresh = batch.groups[: len(batch.groups) - batch.replayed]
                self._command("train", batch.groups, self.trainer.version, self.publisher is not None)
                step = self.trainer.train_step(batch.groups, wait_s=batch.wait_s,
                                               with_weights=self.publisher is not None)
                metrics = step.metrics
                metrics.update(barrier_wait_s=barrier_s, replayed=batch.replayed, dropped_stale=batch.dropped_stale,
                               duplicates=batch.duplicates, rejected=batch.rejected,
                               dropped_stale_total=self.serving.total_dropped_stale, steps_done=self.steps_done)
                if self.publisher is not None:
                    metrics.update(self._publish(step.weights, step.version))
                self.metrics.emit(self.trainer.version, metrics)
                collapse = self.collapse_watch.observe(self.steps_done, metrics["reward_mean"], metrics["entropy"])
                if collapse is not None:
                    self._alert_collapse(collapse)
                self._pending.append(TrainedBatch(policy=self.config.trainer.policy, version=self.trainer.version,
                                                  group_ids=[g.group_id for g in fresh],
                                                  replayed_ids=[g.group_id for g in batch.groups[len(fresh):]]))
                steps_run += 1
                if self.trainer.version % cfg.checkpoint_every == 0:
                    self.checkpoint()
                else:
                    self._commit_progress()
                if self.collapsed is not None:
                    break
            if self._pending:
                self.checkpoint()
            self._report_durable()
            self._command("stop")
            if self.collapsed is None:
                self.report_progress(finished=True)
        finally:
            self.metrics.close()
        summary = {"version": self.trainer.version, "steps_run": steps_run,
                   "dropped_stale": self.serving.total_dropped_stale, "duplicates": self.serving.total_duplicates,
                   "wall_s": time.perf_counter() - start}
        if self.collapsed is not None:
            summary["collapsed"] = self.collapsed.describe()
        return summary

    def _report_durable(self, timeout_s: float = 120.0) -> None:
        """Wait up to ``timeout_s`` for the publisher to store and announce what it was handed (it runs behind the
        steps), then tell ``metrics`` the newest durable version, so that ``status`` after the run reads the final
        version, not the one the last step's metrics saw. Logged, not raised, when the wait runs out."""
        if self.publisher is None:
            return
        if not self.publisher.wait(timeout_s):
            log.warning("trainer %s: the publisher had not stored version %d after %.0f s (see its warnings)",
                        self.config.trainer.policy, self.trainer.version, timeout_s)
        if self.publisher.durable_version is not None:
            self.metrics.alert({"durable_version": self.publisher.durable_version, "version": self.trainer.version,
                                "steps_done": self.steps_done})

    def _alert_collapse(self, collapse: Collapse) -> None:
        """Log ``collapse`` and alert it on ``metrics`` (the live view, ``status`` and the exporter show it); with
        ``stop_on_collapse`` mark the trainer to stop after this step (:attr:`collapsed`)."""
        stop = self.config.stop_on_collapse
        best = self.run_dir / BEST_CHECKPOINT
        then = (f"stopping (stop_on_collapse); the best window's checkpoint is {best}" if stop else
                "training on (policies.<policy>.stop_on_collapse: true stops here and keeps the best checkpoint)")
        log.error("trainer %s: %s; %s", self.config.trainer.policy, collapse.describe(), then)
        self.metrics.alert({**collapse.values(), "version": float(self.trainer.version)})
        if stop:
            self.collapsed = collapse

    def _keep_if_best(self, path: Path) -> None:
        """Make checkpoint ``path`` (just written) the best checkpoint when the reward's trailing window
        (:class:`CollapseWatch`) is the best of any checkpoint so far: hard links to its files (written once, never
        changed) under ``best-checkpoint``, replaced atomically (a rename)."""
        window = self.collapse_watch.trailing_window
        if window is None or (self._best_kept is not None and window <= self._best_kept):
            return
        best, tmp = self.run_dir / BEST_CHECKPOINT, self.run_dir / f".{BEST_CHECKPOINT}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(path, tmp, copy_function=os.link)
        old = self.run_dir / f".{BEST_CHECKPOINT}.old"
        shutil.rmtree(old, ignore_errors=True)
        if best.exists():
            os.rename(best, old)
        os.rename(tmp, best)
        shutil.rmtree(old, ignore_errors=True)
        self._best_kept = window
        log.info("trainer %s: %s holds version %d (reward window %.3f, the best so far)",
                 self.config.trainer.policy, best, self.trainer.version, window)

    def _publish(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Hand ``weights`` to the publisher as ``version``, with this trainer's position on ``samples.<policy>``;
        returns the step's publish figures: ``publish_wait_s`` (seconds waited for the publisher: its one copy
        of the weights to host memory; encoding and upload run in its background thread), the publisher's
        ``last_publish`` (publish_bytes, publish_s, published_version of the newest version published,
        store_lost_total) and
        ``durable_version`` (the newest version stored and announced, once there is one)."""
        start = time.perf_counter()
        self.publisher.publish(weights, version, self.serving.consumed())
        figures = {"publish_wait_s": time.perf_counter() - start, **self.publisher.last_publish}
        if self.publisher.durable_version is not None:  # publishes run behind the steps
            figures["durable_version"] = self.publisher.durable_version
        return figures

    def _command(self, *command: Any) -> None:
        """Send ``command`` to the other ranks' :func:`run_follower` (a collective; nothing on one rank)."""
        if self._ranks > 1:
            from trainer.distributed import broadcast_object

            broadcast_object(command)

    def report_progress(self, finished: bool = False, at_barrier: bool = False, starving: bool = False,
                        every_s: float = 5.0) -> None:
        """Send a :class:`TrainerProgress` heartbeat on ``control`` when the position, version,
        ``finished``, ``at_barrier`` or ``starving`` (its last wait for a batch ran out with nothing to train)
        changed, and at least every ``every_s`` seconds: RaaS throttles this policy by it (DESIGN.md,
        "Backpressure, per policy, on progress"). A change of state is flushed at once (a flush the broker does not
        answer is logged, and the heartbeat stays queued); the periodic ones are queued."""
        now = (self.serving.consumed(), self.trainer.version, finished, at_barrier, starving)
        if now == self._progress_sent and time.monotonic() - self._progress_ts < every_s:
            return
        msg = TrainerProgress(policy=self.config.trainer.policy, consumed=now[0], version=now[1], finished=finished,
                              at_barrier=at_barrier, starving=starving)
        self.producer.send(self.names.control, encode(msg), key=f"trainer.{msg.policy}", headers=headers_for(msg))
        if finished:
            self.producer.flush()
        elif self._progress_sent is None or now[2:] != self._progress_sent[2:]:
            try:
                self.producer.flush()
            except FatalBusError:
                raise
            except BusError as e:  # the broker is away: the heartbeat stays queued and goes with a later flush
                log.warning("trainer %s: heartbeat not acknowledged yet (%s); it stays queued",
                            self.config.trainer.policy, e)
        self._progress_sent, self._progress_ts = now, time.monotonic()

    def _report_publish_errors(self) -> None:
        """Alert on ``metrics`` (so the live view shows it within seconds) when a publish failed:
        ``publish_errors`` (failed publishes so far), ``durable_version``, ``version`` and
        ``publish_failing`` 1; and once more with ``publish_failing`` 0 when a version at least as new
        as the trainer's at the last failure is durable again."""
        publisher = self.publisher
        if publisher is None or not publisher.errors:
            return
        errors, durable = len(publisher.errors), publisher.durable_version or 0
        alerted, failing_at = self._publish_alerted
        if errors != alerted:
            self._publish_alerted = (errors, self.trainer.version)
        elif failing_at is not None and durable >= failing_at:
            self._publish_alerted = (errors, None)
        else:
            return
        self.metrics.alert({"publish_errors": errors, "durable_version": durable, "version": self.trainer.version,
                            "publish_failing": float(self._publish_alerted[1] is not None)})

    def _store_behind(self) -> bool:
        """True while publishes have failed and the newest durable version is too stale for the trainer
        (:func:`policies.staleness.too_stale`) by ``max(max_staleness, 4)`` (the store is failing): RaaS cannot
        get newer weights, so what it rolls out now would only be dropped as stale. The bound is at least 4 so
        that publishes running a few versions behind the steps do not hold a trainer at ``max_staleness`` 0. A
        trainer that has not published yet (e.g. just restarted from a checkpoint) is not held. Logged at most
        every 30 s."""
        publisher = self.publisher
        if publisher is None or not publisher.errors:
            return False
        durable = publisher.durable_version or 0  # version 0, the base model, is always there
        behind = too_stale(durable, self.trainer.version, max(self.config.max_staleness, 4))
        if behind and time.monotonic() - self._store_logged >= 30.0:
            self._store_logged = time.monotonic()
            log.warning("trainer %s: holding at version %d: the newest durable version is %d (publishes are "
                        "failing; see the publisher's warnings)", self.config.trainer.policy, self.trainer.version,
                        durable)
        return behind

    def close(self) -> None:
        """Leave the consumer group, stop reading announcements and flush the producer."""
        if self.barrier is not None:
            self.barrier.close()
        self.consumer.close()
        self.producer.close()


def run_follower(config: ServiceConfig) -> dict[str, Any]:
    """The loop of a rank other than 0 of a multi-rank trainer (``trainer.ranks > 1``, under torchrun).

    It never touches the bus: it loads the model, then does what rank 0's :class:`TrainerService` sends
    (``restore`` a checkpoint path or None, ``renumber`` the weights, ``train`` a batch, ``checkpoint``,
    ``stop``), joining each collective (with the gather of the weights after ``renumber`` and ``train`` when
    rank 0 publishes). Every rank trains on the same groups, so all versions and shuffles agree.

    Returns:
        {"version", "steps_run", "rank"} once rank 0 sends ``stop``.

    Raises:
        ValueError: an unknown command (rank 0 and this rank run different code).
        RuntimeError: rank 0 trains a version this rank is not at, or a collective failed (e.g. rank 0 died;
            torchrun then stops every rank).
    """
    from trainer.distributed import broadcast_object, rank

    trainer = Trainer(config.trainer, config.model_dir)
    steps_run = 0
    while True:
        command, *args = broadcast_object(None)
        if command == "restore":
            if args[0] is not None:
                trainer.restore(load_checkpoint(Path(args[0])))
        elif command == "renumber":
            version, publishing = args
            trainer.renumber(version)
            if publishing:
                trainer.publish_state()
        elif command == "train":
            groups, version, publishing = args
            if version != trainer.version:
                raise RuntimeError(f"rank {rank()}: at version {trainer.version}, rank 0 trains version {version}")
            trainer.train_step(groups, with_weights=publishing)
            steps_run += 1
        elif command == "checkpoint":
            save_distributed_checkpoint(Path(config.run_dir) / CHECKPOINTS, version=trainer.version,
                                        backend=trainer.backend, model=trainer.model, offsets={},
                                        keep=config.keep_checkpoints)
        elif command == "stop":
            return {"version": trainer.version, "steps_run": steps_run, "rank": rank()}
        else:
            raise ValueError(f"unknown trainer command {command!r} from rank 0")
