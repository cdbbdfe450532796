"""Wedged filter processors: a policy whose filter group leaves records of ``trajectories.<p>`` waiting at
committed offsets that do not move has its processors killed, so that supervision restarts them."""
from __future__ import annotations

import signal
import time

from rich.console import Console

from astraflow.config import RunConfig
from astraflow.launcher.plan import Component
from astraflow.monitor import RunMonitor
from topics.bus import BusError
from topics.names import TopicNames

#: seconds past its batch deadline (``policies.<p>.filter_processor.step_deadline_s``, which covers a wedge inside a
#: batch) that a filter processor may leave records of ``trajectories.<p>`` waiting at unmoved committed offsets
#: before the launcher kills it as wedged; this covers the rest (start-up, a client call between batches, a stopped
#: process)
FILTER_WEDGE_MARGIN_S = 40.0
FILTER_CHECK_S = 10.0     # seconds between two looks at the filter processors' committed offsets


class FilterWedgeWatch:
    """Looks at the filter groups' committed offsets from the live view's thread (it may wait on the bus).

    Args:
        cfg: the run config (its policies and their ``filter_processor.step_deadline_s``).
        names: the run's topic names.
        components: the run's components (its filter processors are killed), shared with supervision.
        console: where its lines go.
    """

    def __init__(self, cfg: RunConfig, names: TopicNames, components: list[Component], console: Console):
        self.cfg, self.names, self.components, self.console = cfg, names, components, console
        #: policy -> the filter group's committed offsets on trajectories.<p> and since when they have not moved
        self._seen: dict[str, tuple[dict[int, int | None], float]] = {}
        self._looked = 0.0

    def look(self, monitor: RunMonitor) -> None:
        """Every ``FILTER_CHECK_S``: a policy whose filter group has left records of ``trajectories.<p>`` waiting at
        the same committed offsets for its ``filter_processor.step_deadline_s`` + ``FILTER_WEDGE_MARGIN_S`` seconds,
        all of them with its processors running (a restarted one gets the whole bound), has a wedged filter
        processor (seen: a filter that read nothing for 10 min after a broker restart). Its live processors get
        SIGUSR1 (each writes its threads' stacks to its log: what was blocked) and then SIGKILL;
        supervision restarts them from the committed offsets (their transactional producers fence the killed
        ones). A bus that does not answer is not a wedge: the clocks start again."""
        now = time.monotonic()
        if now - self._looked < FILTER_CHECK_S:
            return
        self._looked = now
        for p in self.cfg.policies:
            group, topic = self.names.filter_group(p), self.names.trajectories(p)
            try:
                committed = monitor.admin.group_offsets(group, topic)
                lag = sum(monitor.admin.group_lag(group, topic, committed).values())
            except BusError:
                self._seen.clear()
                return
            seen, since = self._seen.get(p, (None, now))
            if lag <= 0 or committed != seen:
                self._seen[p] = (committed, now)
                continue
            live = [c for c in self.components if c.kind == "policy" and c.name.split(".")[1] == p
                    and c.proc is not None and c.proc.poll() is None]
            bound = self.cfg.policies[p].filter_processor.step_deadline_s + FILTER_WEDGE_MARGIN_S
            if not live or now - max(since, *(c.started_at for c in live)) < bound:
                continue
            self.console.print(f"[bold red]watchdog: {lag} records of {topic} have waited at the same committed "
                               f"offsets of {group} for {now - since:.0f} s: killing "
                               f"{', '.join(c.name for c in live)} as wedged (stacks in their logs); it restarts "
                               f"from those offsets[/]")
            for c in live:
                c.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            for c in live:
                c.proc.kill()
            self._seen[p] = (committed, now)
