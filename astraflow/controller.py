"""Scaling rollout to the trainers: how many RaaS workers a workflow should run, decided by feedback control.

:class:`ScalingController` turns what the run reports (each trainer's ``wait_frac``: the share of its time spent
waiting for data; each RaaS worker's ``paused``: 1 while backpressure holds it back) into a target number of
workers, as a controller with

* **hysteresis**: it scales up only when every trainer of the workflow starved (``wait_frac`` above
  ``starved_above``) while the workers were not held back by backpressure (then another worker could not
  help) in each of the last ``window`` observations, and down only when the trainers were busy
  (``wait_frac`` below ``busy_below``) and the workers paused by backpressure in each of them: the band
  between the thresholds is a dead zone where nothing changes;
* a **cooldown**: no decision within ``cooldown_s`` of the last one, in either direction (so it never scales
  up and down within a cooldown), and the window restarts after each decision (a decision is judged on what
  follows it, not on what caused it);
* a **rate limit**: one worker per decision; and **bounds**: ``min_workers`` .. ``max_workers``;
* a **grace** for slow workers: a worker that reported within ``grace_s`` counts as alive even if it is
  slow, so a slow-but-alive worker is never replaced by a new one.

On a steady load the observations stay on one side of the band or inside it, so the target moves at most
monotonically towards a bound and then stays: it cannot oscillate (tested on synthetic loads).

``astraflow controller`` (:func:`run_controller`) feeds it from the ``metrics`` topic as its own consumer group
and writes each decision, with its reason, to the compacted ``control`` topic as a
:class:`~topics.schemas.Control` ``target_replicas`` record keyed ``raas.<workflow>``; an actuator carries it
out (``controller.actuator``, :mod:`astraflow.actuators`): the local launcher, which reads ``control``, or docker
compose or Kubernetes, called by the controller once the decision is on ``control``.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astraflow.config import ControllerSection
    from topics.bus import Bus


@dataclass
class Observation:
    """What the controller sees at one tick.

    Attributes:
        now: seconds (monotonic or wall, the same clock for every observation).
        wait_frac: per trainer of the workflow, its newest ``wait_frac`` (0..1).
        paused: per RaaS worker that reported within the grace period, the share of its time held back by
            backpressure (its newest ``paused_frac``, 0..1; ``paused``, 0 or 1, from a worker without it).
        paused_by_control: per such worker, its newest ``paused_by_control`` (0 or 1): an operator's
            ``pause`` on ``control`` holds it. While any is, the controller decides nothing (the trainers starve
            because rollout was paused on purpose; a new worker would be paused too).
    """

    now: float
    wait_frac: dict[str, float]
    paused: dict[str, float]
    paused_by_control: dict[str, float] = field(default_factory=dict)


@dataclass
class Decision:
    """A new target: ``workers`` RaaS workers, and why."""

    workers: int
    reason: str


@dataclass
class ScalingController:
    """Target RaaS workers for one workflow (see the module docstring for the rules).

    Args:
        workers: the number running now (the initial target).
        min_workers, max_workers: bounds of the target.
        starved_above: a trainer ``wait_frac`` above this is starved (rollout is the bottleneck).
        busy_below: a trainer ``wait_frac`` below this is busy (the trainer is the bottleneck).
        paused_above: the mean ``paused`` of the workers above this: backpressure holds them back.
        window: consecutive observations that must agree before a decision.
        cooldown_s: seconds after a decision before the next one.

    Raises:
        ValueError: inconsistent bounds or thresholds.
    """

    workers: int
    min_workers: int = 1
    max_workers: int = 4
    starved_above: float = 0.3
    busy_below: float = 0.05
    paused_above: float = 0.5
    window: int = 3
    cooldown_s: float = 60.0
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    _recent: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers ({self.min_workers}) <= max_workers ({self.max_workers})")
        if not 0 <= self.busy_below < self.starved_above <= 1:
            raise ValueError(f"need 0 <= busy_below ({self.busy_below}) < starved_above ({self.starved_above}) <= 1")
        if self.window < 1 or self.cooldown_s < 0:
            raise ValueError(f"window ({self.window}) must be >= 1 and cooldown_s ({self.cooldown_s}) >= 0")
        self.workers = min(max(self.workers, self.min_workers), self.max_workers)
        self._recent = deque(maxlen=self.window)

    def _side(self, obs: Observation) -> str:
        """'up', 'down' or '' for one observation."""
        if not obs.wait_frac or any(obs.paused_by_control.values()):
            return ""  # no trainer has reported, or an operator paused rollout: nothing to judge
        paused = sum(obs.paused.values()) / len(obs.paused) if obs.paused else 0.0
        if min(obs.wait_frac.values()) > self.starved_above and paused <= self.paused_above:
            return "up"  # starved, and not because backpressure holds the workers back (one more would not help)
        if max(obs.wait_frac.values()) < self.busy_below and paused > self.paused_above:
            return "down"
        return ""

    def observe(self, obs: Observation) -> Decision | None:
        """Take one observation; a :class:`Decision` when the target changes, else None."""
        self._recent.append(self._side(obs))
        if self.decisions and obs.now - self.decisions[-1][0] < self.cooldown_s:
            return None
        if len(self._recent) < self.window or len(set(self._recent)) != 1 or not self._recent[0]:
            return None
        waits = ", ".join(f"{k} {v:.2f}" for k, v in sorted(obs.wait_frac.items()))
        if self._recent[0] == "up" and self.workers < self.max_workers:
            decision = Decision(self.workers + 1, f"trainers starved (wait_frac {waits} > {self.starved_above} in "
                                                  f"{self.window} observations): {self.workers} -> {self.workers + 1}")
        elif self._recent[0] == "down" and self.workers > self.min_workers:
            paused = sum(obs.paused.values()) / max(len(obs.paused), 1)
            decision = Decision(self.workers - 1, f"trainers busy (wait_frac {waits} < {self.busy_below}) and workers "
                                                  f"held back ({paused:.0%} paused) in {self.window} observations: "
                                                  f"{self.workers} -> {self.workers - 1}")
        else:
            return None
        self.workers = decision.workers
        self.decisions.append((obs.now, decision))
        self._recent.clear()
        return decision


def run_controller(cfg: ControllerSection, bus: Bus, stop: threading.Event) -> None:
    """``astraflow controller`` (its section of the run config, ``cfg``): follow the run's ``metrics`` as the consumer group ``<run>.controller``, observe
    every ``controller.interval_s`` and write each decision to ``control`` (a ``target_replicas``
    :class:`~topics.schemas.Control` keyed ``raas.<workflow>``, its reason included), until ``stop`` is set.

    It starts from the newest decision already on ``control`` (a restarted controller resumes its target),
    else from ``raas.workers``.

    With ``controller.actuator`` compose or kubernetes it carries each decision out itself once the decision is
    on ``control``, and a restarted controller applies the newest target it finds there again (idempotent). A
    failed try is logged and retried every ``interval_s`` (:class:`~astraflow.actuators.Actuation`); each try is
    reported on ``metrics`` (component ``controller``: ``target_workers``, ``applied_workers``,
    ``actuator_errors``, ``actuator_failing``).

    Raises:
        topics.bus.BusError: the bus failed for longer than the patience of a write.
        ValueError: the compose file does not exist.
        astraflow.actuators.ActuatorError: no Kubernetes credentials.
    """
    import logging
    import time

    from astraflow.actuators import Actuation, build_actuator
    from astraflow.monitor import RunMonitor
    from topics.codec import encode, headers_for
    from topics.follow import LatestByKey
    from topics.names import TopicNames
    from topics.patience import patiently
    from topics.schemas import Control, Metric

    log = logging.getLogger("astraflow.controller")
    c, names = cfg.controller, TopicNames(cfg.run)
    key = f"raas.{cfg.workflow}"
    resume = LatestByKey(bus, names.control, Control, client_id=f"{cfg.run}.controller-resume")
    try:
        last = resume.read_to_end().get(key)
    finally:
        resume.close()
    resumed = last is not None and last.action == "target_replicas" and last.value
    workers = last.value if resumed else cfg.workers
    actuator = build_actuator(c)
    actuation = Actuation(actuator, retry_s=c.interval_s) if actuator is not None else None
    if actuation is not None and resumed:
        actuation.want(last.value, f"resumed from control: {last.reason}")
    ctl = ScalingController(workers=workers, min_workers=c.min_workers, max_workers=c.max_workers,
                            starved_above=c.starved_above, busy_below=c.busy_below, paused_above=c.paused_above,
                            window=c.window, cooldown_s=c.cooldown_s)
    monitor = RunMonitor(bus, names, cfg.policies, cfg.workflow, group=f"{cfg.run}.controller",
                         keep=False)
    producer = bus.producer()
    wait: dict[str, float] = {}  # policy -> newest wait_frac
    paused: dict[str, tuple[float, float, float]] = {}  # worker -> (newest paused, paused_by_control, its ts)
    log.info("controller for %s: %d workers (%d..%d), observing every %.0f s", key, ctl.workers, c.min_workers,
             c.max_workers, c.interval_s)
    next_at = time.monotonic() + c.interval_s
    try:
        while not stop.is_set():
            if actuation is not None and actuation.step(time.monotonic()) is not None:
                report = Metric(component="controller", kind="controller", values=actuation.values())
                producer.send(names.metrics, encode(report), key=report.component, headers=headers_for(report))
                patiently("controller: actuator metrics", producer.flush, log=log)
            for m in monitor.poll(0.5):
                if m.kind == "trainer" and m.policy in cfg.policies and "wait_frac" in m.values:
                    wait[m.policy] = m.values["wait_frac"]
                elif m.kind == "raas" and "paused" in m.values:
                    # the share of its time held back by backpressure (paused_frac), not the instant's paused
                    held = m.values.get("paused_frac", m.values["paused"])
                    paused[m.component] = (held, m.values.get("paused_by_control", 0.0), m.ts)
            if time.monotonic() < next_at:
                continue
            next_at = time.monotonic() + c.interval_s
            alive = {w: v for w, v in paused.items() if time.time() - v[2] <= c.grace_s}
            decision = ctl.observe(Observation(time.monotonic(), dict(wait), {w: v[0] for w, v in alive.items()},
                                               {w: v[1] for w, v in alive.items()}))
            if decision is None:
                continue
            msg = Control(component=key, action="target_replicas", value=decision.workers, reason=decision.reason)
            producer.send(names.control, encode(msg), key=key, headers=headers_for(msg))
            patiently(f"controller: decision for {key}", producer.flush, log=log)
            log.info("controller: %s -> %d workers: %s", key, decision.workers, decision.reason)
            if actuation is not None:
                actuation.want(decision.workers, decision.reason)  # tried at the top of the loop, right away
    finally:
        monitor.close()
        producer.close()
