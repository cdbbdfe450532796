"""The live view of a run: its own thread reads the metrics, redraws the table (on a console that is not a terminal,
prints a progress line every :data:`PROGRESS_EVERY_S` instead), prints a line when a trainer's
weight publishes start or stop failing, and gives the watchers their look. It waits on the bus (admin requests block
up to 30 s when the bus is down), so supervision, which must not, keeps the main thread."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.live import Live

from astraflow.monitor import RunMonitor
from topics.bus import BusError

#: seconds a round of the live view takes at least (the table redraws once a second; the watchdogs' bounds are tens
#: of seconds): metrics arrive several times a second, and a round for each cost the launcher 3-4% of a core
ROUND_S = 1.0
#: seconds between two progress lines (:meth:`LiveView.progress_line`) on a console that is not a terminal (a log, CI),
#: where the table is drawn only once, as the run ends
PROGRESS_EVERY_S = 30.0
VIEW_JOIN_S = 150.0       # > one live-view round with the bus down: lags (10 s metadata + 30 s offsets), members (30 s), watchdog lags (40 s)


class LiveView:
    """The live view's thread (:meth:`start` until :meth:`stop`).

    Args:
        monitor: the run's monitor; only this thread uses it while the view runs.
        run: the run's name, in the table's title.
        console: where its lines go.
        looks: called with ``monitor`` after each read (the watchdogs, the scaling target); each may raise
            :class:`~topics.bus.BusError`.
    """

    def __init__(self, monitor: RunMonitor, run: str, console: Console,
                 looks: Sequence[Callable[[RunMonitor], None]]):
        self.monitor, self.run, self.console, self.looks = monitor, run, console, list(looks)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._publish_seen: dict[str, tuple[int, bool]] = {}  # policy -> (publish errors, failing) last told
        self._collapse_seen: dict[str, str | None] = {}  # policy -> the collapse alert last told

    def start(self, live: Live, t0: float) -> None:
        """Start the thread, which redraws ``live`` with the time since ``t0`` (monotonic) in the title."""
        self._thread = threading.Thread(target=self._loop, args=(live, t0), name="live-view", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Tell the thread to end after its current round."""
        self._done.set()

    def join(self, timeout_s: float = VIEW_JOIN_S) -> bool:
        """Wait up to ``timeout_s`` for the thread to end; whether it has (or never started), so that the monitor
        may be used again."""
        if self._thread is None:
            return True
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def _loop(self, live: Live, t0: float) -> None:
        """Until :meth:`stop`, a round at most every :data:`ROUND_S`: metrics, the table, the alerts, the looks. An
        unreachable bus is reported once per condition; the components ride it out by restarts."""
        trouble, last, told = "", 0.0, time.monotonic()
        while not self._done.is_set():
            started = time.monotonic()
            try:
                self.monitor.poll(0.5)
                if time.monotonic() - last > 1.0:
                    live.update(self.monitor.table(f"run {self.run}  {time.monotonic() - t0:.0f} s"))
                    last = time.monotonic()
                if not self.console.is_terminal and time.monotonic() - told >= PROGRESS_EVERY_S:
                    self.console.print(self.progress_line(time.monotonic() - t0), markup=False, soft_wrap=True)
                    told = time.monotonic()
                self._publish_alerts()
                self._collapse_alerts()
                for look in self.looks:
                    look(self.monitor)
                if trouble:
                    self.console.print("[green]the bus answers again[/]")
                    trouble = ""
            except BusError as e:
                if not trouble:
                    self.console.print(f"[bold yellow]bus trouble (components ride it out by restarts): {e}[/]")
                trouble = str(e)
            self._done.wait(max(0.0, ROUND_S - (time.monotonic() - started)))

    def progress_line(self, elapsed_s: float) -> str:
        """One line of the run's progress, for a console that is not a terminal: per policy its step, version,
        reward, KL, trainer tokens/s and staleness (``-`` for a figure not reported yet)."""
        fmt = lambda x, f: "-" if x is None else f.format(x)  # noqa: E731
        return f"run {self.run} {elapsed_s:.0f} s: " + "; ".join(
            f"{p} step {v.step} version {v.version} reward {fmt(v.reward, '{:.3f}')} KL {fmt(v.kl, '{:.4f}')} "
            f"train {fmt(v.tokens_per_s, '{:.0f}')} tok/s staleness {fmt(v.staleness, '{:.2f}')}"
            for p, v in self.monitor.views.items())

    def _collapse_alerts(self) -> None:
        """One console line per collapse alert of a trainer (:mod:`trainer.collapse`)."""
        for p, view in self.monitor.views.items():
            if view.collapse and view.collapse != self._collapse_seen.get(p):
                self._collapse_seen[p] = view.collapse
                self.console.print(f"[bold red]trainer.{p}: {view.collapse} (logs/trainer.{p}.log)[/]")

    def _publish_alerts(self) -> None:
        """One console line when a trainer's weight publishes start failing (or fail again), and one when
        they are durable again (from the trainers' ``publish_errors`` alerts on ``metrics``)."""
        for p, view in self.monitor.views.items():
            seen = self._publish_seen.get(p, (0, False))
            if (view.publish_errors, view.publish_failing) == seen:
                continue
            self._publish_seen[p] = (view.publish_errors, view.publish_failing)
            if view.publish_failing:
                self.console.print(f"[bold yellow]trainer.{p}: {view.publish_errors} failed weight publish(es); the "
                                   f"newest durable version is {view.durable_version} (reason in "
                                   f"logs/trainer.{p}.log)[/]")
            else:
                self.console.print(f"[green]trainer.{p}: weights are durable again (version {view.durable_version})[/]")
