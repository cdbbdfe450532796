"""TensorBoard and W&B: every figure on a run's ``metrics`` topic, written by a component of its own.

:class:`MetricsTracker` reads ``metrics`` as its own consumer group ``<run>.tracker`` (through a
:class:`~astraflow.monitor.RunMonitor` that keeps nothing, as the Prometheus exporter does), so no trainer ever
waits for a tracking sink, and writes every value of every component's records:

* TensorBoard (``tracking.tensorboard_dir``): a TensorBoard run per component, ``<tensorboard_dir>/<run>/
  <component>/`` (``trainer.<policy>``, ``filter.<policy>.<i>``, ``curator.<policy>``, ``raas-<n>``,
  ``eval.<policy>``), a scalar per value name (``reward_mean``, ``kl``, ``staleness_hist/2``,
  ``version.<policy>``, ...);
* W&B (``tracking.wandb_project``): one W&B run per AstraFlow run, named after it, a key
  ``<component>/<name>`` per value, each component on its own x axis ``<component>/step``. The W&B run id is kept
  in ``<run_dir>/tracker/wandb_run_id``, so a restarted tracker resumes the same W&B run.

The step of a record (:func:`record_step`) is its ``step`` (a trainer's or an evaluation's version); a record
without one is placed at its ``version`` value when it has one (a trainer's publish alerts), else at its
timestamp in whole seconds since the epoch (RaaS workers, filter processors: read them on TensorBoard's
wall-time axis). Every event also carries the record's own timestamp as its wall time.

Delivery: records are held in memory and written at each flush (every ``tracking.flush_every_s`` seconds, or
once :data:`MAX_PENDING` records wait): the TensorBoard files are written and fsynced, the records handed to W&B,
and only then the group's offsets committed. A tracker that dies before a commit re-reads, after its restart,
exactly what it had not committed, and had written none of it: nothing is lost, nothing written twice, save for
a death in the instant between a flush and its commit (TensorBoard's event files are append-only, so those
records would appear twice). W&B writes its own log and uploads it from its own service process; the tracker
does not wait for the upload.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from astraflow.monitor import RunMonitor
from topics.atomic_write import atomic_write
from topics.bus import Bus, BusError, FatalBusError, connect
from topics.names import TopicNames
from topics.schemas import Metric

if TYPE_CHECKING:
    from astraflow.config import MetricsSection, TrackingConfig

log = logging.getLogger(__name__)

#: records waiting to be written that trigger a flush before ``flush_every_s`` is up (bounds the memory held)
MAX_PENDING = 5000
#: the most seconds :meth:`MetricsTracker.close` waits for W&B's ``finish`` (its upload goes on in W&B's service)
WANDB_FINISH_S = 30.0
_INSTALL = "install the tracking profile: scripts/install.sh tracking (or pip install 'astraflow[tracking]')"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_serial = itertools.count()


class TrackingRefused(ValueError):
    """The tracking section cannot be used: it sets no sink, or its TensorBoard directory cannot be made; the
    message says which."""


class TrackingUnavailable(ImportError):
    """A tracking sink is configured, and the package it needs is not installed here."""


def require_sinks(tracking: "TrackingConfig") -> None:
    """Check that a sink is configured and that its packages import (:func:`require_packages`).

    Raises:
        TrackingRefused: no sink is configured.
        TrackingUnavailable: as :func:`require_packages`.
    """
    if not tracking.enabled:
        raise TrackingRefused("nothing to track: set tracking.tensorboard_dir or tracking.wandb_project")
    require_packages(tracking)


def require_packages(tracking: "TrackingConfig") -> None:
    """Check that the packages of the configured sinks import: ``tensorboard`` for ``tracking.tensorboard_dir``,
    ``wandb`` for ``tracking.wandb_project``.

    Raises:
        TrackingUnavailable: one is missing (the message names the field and how to install it).
    """
    needs = [(field, package) for field, package, value in
             (("tensorboard_dir", "tensorboard", tracking.tensorboard_dir),
              ("wandb_project", "wandb", tracking.wandb_project)) if value is not None]
    for field, package in needs:
        try:
            __import__(package)
        except ImportError as e:
            raise TrackingUnavailable(f"tracking.{field} needs the {package!r} package, which does not import "
                                      f"here ({e}): {_INSTALL}") from None


def record_step(m: Metric) -> int:
    """The x-axis position of record ``m``: its ``step``; else its ``version`` value; else its timestamp in
    whole seconds since the epoch."""
    if m.step is not None:
        return m.step
    if "version" in m.values:
        return int(m.values["version"])
    return int(m.ts)


class _EventFile:
    """One TensorBoard event file (TFRecord framing of ``Event`` protobufs), written synchronously: what
    :meth:`sync` returned from is on disk."""

    def __init__(self, logdir: Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_serial)}"
        self._file = open(logdir / name, "xb")
        self._records = RecordWriter(self._file)
        self._records.write(self._event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())

    def write(self, m: Metric) -> None:
        """Write every value of ``m`` as a scalar at :func:`record_step`, wall time ``m.ts`` (not yet synced)."""
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in m.values.items()]
        event = self._event(wall_time=m.ts, step=record_step(m), summary=self._summary(value=values))
        self._records.write(event.SerializeToString())

    def sync(self) -> None:
        """Flush and fsync the file.

        Raises:
            OSError: the disk refused.
        """
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class MetricsTracker:
    """Follows a run's ``metrics`` and writes them to TensorBoard and W&B (see the module's docstring).

    Args:
        bus: the run's bus.
        names: the run's topic names.
        policies: the run's policies; workflow: its workflow name (what :class:`RunMonitor` needs).
        tracking: the sinks (``tensorboard_dir``, ``wandb_project``, ``wandb_mode``) and ``flush_every_s``.
        run_dir: the run directory (the W&B run id, and W&B's own files under ``<run_dir>/wandb``).
        group: the consumer group (default ``<run>.tracker``).

    Raises:
        TrackingUnavailable: a configured sink's package is not installed.
        ValueError: no sink is configured.
        OSError: ``tensorboard_dir`` cannot be made.
    """

    def __init__(self, bus: Bus, names: TopicNames, policies: list[str], workflow: str, tracking: "TrackingConfig",
                 run_dir: Path, group: str | None = None):
        if not tracking.enabled:
            raise ValueError("the tracker has nothing to write: set tracking.tensorboard_dir or "
                             "tracking.wandb_project")
        require_packages(tracking)
        self.names, self.tracking, self.run_dir = names, tracking, Path(run_dir)
        self.tb_root = Path(tracking.tensorboard_dir) / names.run if tracking.tensorboard_dir is not None else None
        if self.tb_root is not None:
            self.tb_root.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, _EventFile] = {}
        self._wandb = self._start_wandb() if tracking.wandb_project is not None else None
        self._wandb_axes: set[str] = set()
        self.monitor = RunMonitor(bus, names, policies, workflow, group=group or f"{names.run}.tracker", keep=False)
        self._pending: list[Metric] = []
        self._flushed_at = time.monotonic()
        self.written = 0  # records written (and handed to W&B) so far

    def _start_wandb(self):
        """Start (or, after a restart, resume) this run's W&B run; its id is kept in the run directory."""
        import wandb

        id_file = self.run_dir / "tracker" / "wandb_run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:16]
            atomic_write(id_file, run_id)
        return wandb.init(project=self.tracking.wandb_project, name=self.names.run, id=run_id, resume="allow",
                          dir=str(self.run_dir), mode=self.tracking.wandb_mode,
                          settings=wandb.Settings(init_timeout=60, silent=True))

    def poll(self, timeout_s: float = 0.5) -> int:
        """Read new records (waiting at most ``timeout_s`` seconds for the first) and flush when due; returns how
        many metrics records were read.

        Raises:
            OSError: a TensorBoard file could not be written (nothing was committed).
            topics.bus.FatalBusError: the consumer is unusable (a restart resumes from the last commit).
        """
        records = self.monitor.poll(timeout_s)
        self._pending += records
        if len(self._pending) >= MAX_PENDING or time.monotonic() - self._flushed_at >= self.tracking.flush_every_s:
            self.flush()
        return len(records)

    def flush(self) -> None:
        """Write the records read since the last flush (TensorBoard: written and fsynced; W&B: handed to its
        service), then commit the group's offsets past them. A refused commit is logged and made at the next
        flush.

        Raises:
            OSError: a TensorBoard file could not be written (nothing was committed).
            topics.bus.FatalBusError: the consumer is unusable.
        """
        if self.tb_root is not None:
            touched = set()
            for m in self._pending:
                self._event_file(m.component).write(m)
                touched.add(m.component)
            for component in touched:
                self._files[component].sync()
        if self._wandb is not None:
            for m in self._pending:
                self._log_wandb(m)
        self.written += len(self._pending)
        self._pending = []
        self._flushed_at = time.monotonic()
        try:
            self.monitor.commit()
        except FatalBusError:
            raise
        except BusError as e:
            log.warning("tracker: offsets not committed (%s); committed at the next flush", e)

    def _event_file(self, component: str) -> _EventFile:
        if component not in self._files:
            name = _UNSAFE.sub("_", component)
            self._files[component] = _EventFile(self.tb_root / ("_" + name if name.startswith(".") else name))
        return self._files[component]

    def _log_wandb(self, m: Metric) -> None:
        axis = f"{m.component}/step"
        if m.component not in self._wandb_axes:
            self._wandb.define_metric(axis, hidden=True)
            self._wandb.define_metric(f"{m.component}/*", step_metric=axis, step_sync=False)
            self._wandb_axes.add(m.component)
        self._wandb.log({**{f"{m.component}/{k}": v for k, v in m.values.items()}, axis: record_step(m)})

    def drain(self, max_s: float = 10.0) -> None:
        """Read until a poll finds nothing new (or ``max_s`` seconds pass), then flush: a stopping tracker writes
        what the run's components sent last.

        Raises:
            OSError, topics.bus.FatalBusError: as :meth:`flush`.
        """
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline and self.poll(0.5):
            pass
        self.flush()

    def run(self, stop: threading.Event) -> None:
        """Follow ``metrics`` until ``stop`` is set, then drain, flush and close.

        Raises:
            OSError, topics.bus.FatalBusError: as :meth:`flush` (the launcher restarts the component).
        """
        try:
            while not stop.is_set():
                self.poll(0.5)
            self.drain()
        finally:
            self.close()

    def close(self) -> None:
        """Close the TensorBoard files, finish the W&B run (waiting at most :data:`WANDB_FINISH_S` seconds) and
        leave the consumer group. What was not flushed is neither written nor committed: a restart reads it
        again."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._wandb is not None:
            finisher = threading.Thread(target=self._wandb.finish, name="wandb-finish", daemon=True)
            finisher.start()
            finisher.join(WANDB_FINISH_S)
            if finisher.is_alive():
                log.warning("tracker: W&B's finish did not return in %.0f s; its service process goes on uploading "
                            "(an offline run is under %s/wandb for `wandb sync`)", WANDB_FINISH_S, self.run_dir)
            self._wandb = None
        self.monitor.close()


def main(section: MetricsSection, stop: threading.Event) -> None:
    """Write the run's metrics to the configured sinks until ``stop`` is set (``astraflow tracker``).

    Raises:
        TrackingRefused: ``tracking.tensorboard_dir`` cannot be made.
        ValueError, TrackingUnavailable: as :class:`MetricsTracker`.
        OSError, topics.bus.FatalBusError: as :meth:`MetricsTracker.run`.
    """
    try:
        tracking = MetricsTracker(connect(section.bus, section.kafka), TopicNames(section.run), section.policies,
                                  section.workflow, section.tracking, section.run_dir)
    except OSError as e:
        raise TrackingRefused(f"tracking.tensorboard_dir={section.tracking.tensorboard_dir}: cannot write there: {e}") from e
    tracking.run(stop)
