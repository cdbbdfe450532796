"""The run itself: start the planned components, show the live view while supervision keeps them running, stop
them cleanly at the end, and write the outputs (the package docstring tells the whole story)."""
from __future__ import annotations

import signal
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from astraflow.config import RunConfig
from astraflow.launched import EXIT_COLLAPSED
from astraflow.launcher.changelog_check import ChangelogCheck
from astraflow.launcher.outputs import resumption, trainer_versions, write_outputs
from astraflow.launcher.plan import plan_components
from astraflow.launcher.scaling import RaasScaler
from astraflow.launcher.supervision import Supervisor
from astraflow.launcher.view import VIEW_JOIN_S, LiveView
from astraflow.launcher.watchdog import DataWatchdog
from astraflow.monitor import RunMonitor
from topics.bus import BusError, connect
from topics.layout import ensure_run_topics
from topics.names import TopicNames


class RunFailed(RuntimeError):
    """A run that ended because a component failed (other than by a collapse) or its data ran out: the message says
    why, and :attr:`summary` is the run's summary (:func:`~astraflow.launcher.outputs.write_outputs`), whose
    ``failed`` says the same."""

    def __init__(self, reason: str, summary: dict):
        super().__init__(reason)
        self.summary = summary


class Launcher:
    """Runs every component of ``cfg`` on this machine and watches them.

    Args:
        cfg: the validated run config.
        config_path: the YAML file the components re-read.
        overrides: the ``key=value`` overrides, passed on to every component.
        console: where the live view and every report go (default: stderr).
    """

    def __init__(self, cfg: RunConfig, config_path: Path, overrides: list[str], console: Console | None = None):
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.names = TopicNames(cfg.run)
        self.components = plan_components(cfg, config_path, overrides)
        self.supervisor = Supervisor(cfg, self.components, self.console)
        self.scaler = RaasScaler(cfg, self.names, self.supervisor, self.console)
        self.watchdog = DataWatchdog(cfg, self.names, self.components, self.console)
        self.changelog_check = ChangelogCheck(self.names)

    def run(self) -> dict:
        """Start everything, show the live view, stop cleanly; returns the summary dict
        (:func:`~astraflow.launcher.outputs.write_outputs`), with ``interrupted`` after Ctrl-C or SIGTERM, and
        ``stopped_on_collapse`` (the trainers that stopped on a collapse, ``stop_on_collapse``; the run is then
        incomplete).

        Raises:
            RunFailed: a component failed other than by a collapse (why is printed first), or the data ran out.
            topics.bus.BusError: the bus does not answer at the start.
        """
        cfg, console, supervisor = self.cfg, self.console, self.supervisor
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        bus = connect(cfg.bus, cfg.kafka)
        ensure_run_topics(bus.admin(), self.names, list(cfg.policies))
        monitor = RunMonitor(bus, self.names, list(cfg.policies), cfg.workflow.name)
        resumed = resumption(cfg, trainer_versions(cfg, self.names, console))
        if resumed is not None:
            console.print(f"[yellow]{resumed}[/]")
        t0 = time.monotonic()
        for c in self.components:
            supervisor.start(c)
            if c.ready_url is not None:
                supervisor.wait_ready(c)
        console.print(f"run [bold]{cfg.run}[/] in {cfg.run_dir}: {len(self.components)} components "
                      f"(logs in {cfg.run_dir / 'logs'}); bus {cfg.bus}; store {cfg.store}")
        interrupted, failed = False, []
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops cleanly too
        view = LiveView(monitor, cfg.run, console, looks=(self.watchdog.look, self.changelog_check.look,
                                                           lambda m: self.scaler.read_target(m.bus)))
        try:
            with Live(monitor.table(), console=console, refresh_per_second=2, transient=False) as live:
                view.start(live, t0)
                while True:
                    self.scaler.scale()
                    failed = supervisor.supervise()
                    if failed or self.watchdog.data_exhausted:
                        break
                    trainers = [c for c in self.components if c.kind == "trainer"]
                    if all(c.proc.poll() == 0 and c.restart_at is None for c in trainers):
                        break
                    if cfg.max_wall_s and time.monotonic() - t0 > cfg.max_wall_s:
                        console.print(f"[yellow]max_wall_s={cfg.max_wall_s} reached; stopping[/]")
                        break
                    time.sleep(0.2)
        except KeyboardInterrupt:
            interrupted = True
            console.print("[yellow]interrupted: stopping every component cleanly (SIGTERM)...[/]")
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, previous_term)
            supervisor.stopping = True
            view.stop()
            supervisor.stop_all()
            # The view's requests are bounded (a down bus costs one timeout per kind of request), so this
            # ends; the monitor's clients must not be used by two threads or closed under the view.
            if not view.join(VIEW_JOIN_S):
                console.print(f"[yellow]the live view still waits on the bus after {VIEW_JOIN_S:.0f} s; "
                              f"the last metrics are not read[/]")
            else:
                try:
                    monitor.poll(1.0)
                    monitor.close()
                    self.scaler.close()
                    self.watchdog.close()
                    self.changelog_check.look(monitor, 1.0)  # what the components wrote last
                    self.changelog_check.close()
                except BusError as e:
                    console.print(f"[yellow]the last metrics could not be read: {e}[/]")
        wall = time.monotonic() - t0
        console.print()  # end the live view's line, so the JSON summary starts on its own line
        summary = write_outputs(cfg, self.names, self.components, monitor, wall, console)
        collapsed = [c.name for c in failed if c.kind == "trainer" and c.proc is not None
                     and c.proc.returncode == EXIT_COLLAPSED]
        if collapsed:
            summary["stopped_on_collapse"] = collapsed
        if len(failed) > len(collapsed):
            summary["failed"] = (f"components failed: {', '.join(c.name for c in failed)} (why above; see their "
                                 "logs)")
        elif self.watchdog.data_exhausted and not interrupted:
            summary["failed"] = self.watchdog.data_exhausted
        if "failed" in summary:
            raise RunFailed(summary["failed"], summary)
        if interrupted:
            summary["interrupted"] = True
        return summary
