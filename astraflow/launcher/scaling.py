"""RaaS scaling on this machine (the scaling controller's ``actuator: local``): the launcher follows the
controller's newest ``target_replicas`` by starting or retiring its own RaaS workers. Another actuator scales
RaaS elsewhere (:mod:`astraflow.actuators`: compose, Kubernetes), not the launcher's workers."""
from __future__ import annotations

import signal

from rich.console import Console

from astraflow.config import RunConfig
from astraflow.launcher.plan import Component
from astraflow.launcher.supervision import Supervisor
from topics.bus import Bus
from topics.follow import LatestByKey
from topics.names import TopicNames
from topics.schemas import Control


class RaasScaler:
    """Scales the RaaS workers of ``supervisor``'s components to :attr:`target`.

    Args:
        cfg: the run config (``raas.workers``, ``controller``, the workflow's name).
        names: the run's topic names.
        supervisor: starts the added workers; its components hold the RaaS workers (``raas-N``).
        console: where its lines go.
    """

    def __init__(self, cfg: RunConfig, names: TopicNames, supervisor: Supervisor, console: Console):
        self.cfg, self.names, self.supervisor, self.console = cfg, names, supervisor, console
        #: RaaS workers to run: raas.workers, then the controller's newest target_replicas (read by the view thread)
        self.target = cfg.raas.workers
        self._control: LatestByKey | None = None

    def read_target(self, bus: Bus) -> None:
        """With ``controller.enabled`` and ``actuator: local``: the controller's newest ``target_replicas`` for this
        run's RaaS workers (from ``control``) becomes :attr:`target` (the view thread: it may wait on the bus).

        Raises:
            topics.bus.BusError: the bus does not answer.
        """
        if not self.cfg.controller.enabled or self.cfg.controller.actuator != "local":
            return
        if self._control is None:
            self._control = LatestByKey(bus, self.names.control, Control, client_id=f"{self.cfg.run}.launcher-control")
        msg = self._control.poll(0.0).get(f"raas.{self.cfg.workflow.name}")
        if msg is not None and msg.action == "target_replicas" and msg.value and msg.value != self.target:
            self.console.print(f"[cyan]controller: {msg.value} RaaS workers[/] ({msg.reason})")
            self.target = msg.value

    def scale(self) -> None:
        """Start one RaaS worker (``raas-N``, the next free N) or SIGTERM the newest one when fewer or more than
        :attr:`target` run; a worker stopped so is retired (not restarted, not a failure)."""
        components = self.supervisor.components
        active = [c for c in components if c.kind == "raas" and not c.retired]
        if len(active) < self.target:
            template = next(c for c in components if c.kind == "raas")
            n = max(int(c.name.split("-", 1)[1]) for c in components if c.kind == "raas") + 1
            argv = list(template.argv)
            argv[argv.index("--worker-id") + 1] = str(n)
            comp = Component(f"raas-{n}", argv, template.log.with_name(f"raas-{n}.log"))
            self.supervisor.add(comp)
            self.console.print(f"[cyan]started {comp.name}[/] ({len(active) + 1} RaaS workers)")
        elif len(active) > self.target:
            newest = max(active, key=lambda c: int(c.name.split("-", 1)[1]))
            newest.retired = True
            if newest.proc is not None and newest.proc.poll() is None:
                newest.proc.send_signal(signal.SIGTERM)
            self.console.print(f"[cyan]stopping {newest.name}[/] ({len(active) - 1} RaaS workers)")

    def close(self) -> None:
        """Close its reader of ``control``, if it opened one.

        Raises:
            topics.bus.BusError: the bus does not answer.
        """
        if self._control is not None:
            self._control.close()
