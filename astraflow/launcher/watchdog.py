"""The data watchdog: a line per ``watchdog_s`` for each trainer whose version has not moved, naming what it waits
for, and the verdict that ends a run whose data ran out (acquisition is done and everything was rolled out and
filtered, yet a trainer reports it is starving: its wait for a batch found nothing)."""
from __future__ import annotations

import time

from rich.console import Console

from astraflow.config import RunConfig
from astraflow.launcher.plan import Component
from astraflow.monitor import RunMonitor
from topics.bus import BusError
from topics.follow import LatestByKey
from topics.names import TopicNames
from topics.schemas import TrainerProgress

PROGRESS_READ_S = 10.0    # seconds the starvation check may take to read the trainers' progress to the end of control


class DataWatchdog:
    """Watches the trainers of a run from the live view's thread (it may wait on the bus).

    Args:
        cfg: the run config (``watchdog_s``, each policy's ``steps`` and ``batch_groups``).
        names: the run's topic names.
        components: the run's components (its trainers and acquisition are looked at), shared with supervision.
        console: where its lines go.
    """

    def __init__(self, cfg: RunConfig, names: TopicNames, components: list[Component], console: Console):
        self.cfg, self.names, self.components, self.console = cfg, names, components, console
        self._stall: dict[str, tuple[int | None, float, float]] = {}  # policy -> (version, since, last told)
        self._progress: LatestByKey | None = None  # the trainers' TrainerProgress on control, once needed
        self._trained: dict[str, int] = {}  # policy -> the version its TrainerProgress last said it trained
        #: set when a trainer can get no more data (:meth:`look`); the run then fails with it
        self.data_exhausted: str | None = None

    def look(self, monitor: RunMonitor) -> None:
        """Print one line per ``watchdog_s`` for each unfinished trainer whose version has not moved,
        naming what it waits for: its backlog, its filter's, and RaaS workers paused by backpressure or held by
        an operator's pause or throttle (`astraflow control`). When no more data can come (:meth:`_starved`),
        :attr:`data_exhausted` says so.

        Raises:
            topics.bus.BusError: the bus does not answer (the live view reports it).
        """
        now = time.monotonic()
        for p, view in monitor.views.items():
            trainer = next(c for c in self.components if c.name == f"trainer.{p}")
            if trainer.proc is not None and trainer.proc.poll() == 0:
                continue
            version, since, told = self._stall.get(p, (None, now, now))
            # the trainer's metrics can reach the live view after its progress: the newer of the two counts
            current = max(view.version, self._trained.get(p, 0))
            if current != version:
                self._stall[p] = (current, now, now)
                continue
            if now - told < self.cfg.watchdog_s:
                continue
            self._stall[p] = (version, since, now)
            lags = monitor.lags()
            samples = lags.get((self.names.trainer_group(p), self.names.samples(p)))
            filtered = lags.get((self.names.filter_group(p), self.names.trajectories(p)))
            paused, controlled = monitor.paused_workers(), monitor.controlled_workers()
            held = "; ".join(([f"paused: {', '.join(paused)} (reason in their logs)"] if paused else [])
                             + ([f"held by astraflow control: "
                                 f"{', '.join(f'{w} ({how})' for w, how in controlled.items())}"] if controlled else []))
            if self._starved(monitor, p, lags, version, now - since, view.step_s):
                self.data_exhausted = (
                    f"the data ran out: trainer.{p} has been at version {version} of {self.cfg.policies[p].steps} "
                    f"for {now - since:.0f} s, acquisition has sent every prompt and all were rolled out and "
                    f"filtered (samples.{p} lag {samples} committed); raise data.epochs or lower "
                    f"policies.{p}.steps" + (f". {monitor.dead_letters} records went to deadletter instead of "
                                             f"training (each with its reason there and in the components' logs): if "
                                             f"that is most of the data, mend their cause first"
                                             if monitor.dead_letters else ""))
                self.console.print(f"[bold red]watchdog: {self.data_exhausted}[/]")
                return
            if self._trained.get(p, 0) > version:  # its progress is at a newer version: the stall starts there
                self._stall[p] = (self._trained[p], now, now)
                continue
            self.console.print(f"[bold yellow]watchdog: trainer.{p} has been at version {version} for "
                               f"{now - since:.0f} s;[/] samples.{p} lag {samples} (committed), trajectories.{p} lag "
                               f"{filtered}; " + (held or "no RaaS worker reports a pause"))

    def _starved(self, monitor: RunMonitor, policy: str, lags: dict, version: int, stalled_s: float,
                 step_s: float | None) -> bool:
        """Whether trainer ``policy``, stalled at ``version`` for ``stalled_s`` seconds, can get no more data:
        acquisition has finished, every prompt has been rolled out and filtered (committed lags 0), the trainer says
        it is starving (its :class:`TrainerProgress`: its last wait for a batch ran out with nothing to train, the
        trainer's own judgement, which RaaS's backpressure obeys too, rather than a second count of its backlog from
        end offsets that include transaction markers), and it has been stalled for over 3 of its newest step times
        (a step can outlast ``watchdog_s``). The trainer's progress is read to the end of ``control`` at each look,
        so a starved trainer is told at the first look after the stall. A progress at a newer version than the live
        view's (whose trainer metrics came late) is recorded and is not starvation: :meth:`look` starts the stall
        again at that version, so the verdict names the version the trainer is at. Unknowns (a bus that does not
        answer, no progress yet) are not starvation."""
        acquire = next((c for c in self.components if c.kind == "acquire"), None)
        if acquire is None or acquire.proc is None or acquire.proc.poll() != 0 or stalled_s < 3 * (step_s or 0.0):
            return False
        if (lags.get((self.names.raas_group(self.cfg.workflow.name), self.names.prompts)) != 0
                or lags.get((self.names.filter_group(policy), self.names.trajectories(policy))) != 0):
            return False
        if self._progress is None:
            self._progress = LatestByKey(monitor.bus, self.names.control, TrainerProgress,
                                         client_id=f"{self.cfg.run}.launcher-progress")
        try:
            # to the end of control, not what one poll returned: a new reader's first polls return nothing
            progress = self._progress.read_to_end(timeout_s=PROGRESS_READ_S).get(f"trainer.{policy}")
        except BusError:
            return False
        if progress is not None and progress.version > version:
            self._trained[policy] = progress.version
            return False
        return progress is not None and not progress.at_barrier and progress.starving

    def close(self) -> None:
        """Close its reader of ``control``, if it opened one.

        Raises:
            topics.bus.BusError: the bus does not answer.
        """
        if self._progress is not None:
            self._progress.close()
