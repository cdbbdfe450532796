"""Operator commands to a run's RaaS workers (``astraflow control``): ``pause``, ``resume`` or ``throttle``, for
every worker of the run's workflow or for one, written to the run's ``control`` topic. The topic is compacted, so a
command is kept: a worker started or restarted later obeys it too."""
from __future__ import annotations

import re
from dataclasses import dataclass

from astraflow.config import RunConfig
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Control

ACTIONS = ("pause", "resume", "throttle")
#: what a RaaS worker's --worker-id may be (it names the worker raas-<id>)
WORKER_ID = r"[A-Za-z0-9._-]{1,64}"


class CommandRefused(ValueError):
    """A command the options cannot make; the message names the option and what it takes."""


def check_options(action: str, worker: str | None, per_minute: int | None) -> None:
    """Check ``astraflow control``'s options before anything is read: ``action`` one of :data:`ACTIONS`,
    ``per_minute`` only for a throttle, ``worker`` (None: every worker) a :data:`WORKER_ID`.

    Raises:
        CommandRefused: the first option that is wrong.
    """
    if action not in ACTIONS:
        raise CommandRefused(f"action {action!r}: one of {', '.join(ACTIONS)}")
    if per_minute is not None and action != "throttle":
        raise CommandRefused(f"--per-minute is for throttle, not {action}")
    if worker is not None and not re.fullmatch(WORKER_ID, worker):
        raise CommandRefused(f"--worker {worker!r}: a worker's --worker-id, 1-64 letters, digits, '.', '_' or '-'")


@dataclass(frozen=True)
class Sent:
    """A command sent (:func:`send_command`) and what the bus showed of its run then.

    Attributes:
        message: the command.
        run: the run's name; ``bus``: its bus URL.
        worker: the one worker it is for (its ``--worker-id``), or None: every worker of the workflow.
        run_started: whether the run had its topics before the command created them.
        members: the ids of the members of the run's RaaS group (only for one worker of a started run).
    """

    message: Control
    run: str
    bus: str
    worker: str | None
    run_started: bool
    members: list[str]

    def warnings(self) -> list[str]:
        """Why the command may wait for a run or worker that never comes (a mistyped ``run=`` or ``--worker``):
        the run has no topics yet, or no member of its RaaS group is the worker. A kept command is still right for
        one that starts later, so these are warnings, not errors; none when all is as expected."""
        if not self.run_started:
            return [f"warning: run {self.run!r} has no topics on bus {self.bus} yet (no such run, or not started): "
                    f"the command is kept for when it starts"]
        if self.worker is None:
            return []
        # member ids: "<instance id> <member id>" on Kafka, "<client id>-<host>-<pid>-<hex>" on the embedded bus
        ids = sorted(m.split(" ")[0] if " " in m else m for m in self.members)
        if any(i == f"raas-{self.worker}" or i.startswith(f"raas-{self.worker}-") for i in ids):
            return []
        hint = (f" (--worker takes the --worker-id: {self.worker[5:]} for {self.worker})"
                if self.worker.startswith("raas-") else "")
        return [f"warning: --worker {self.worker}: no worker raas-{self.worker} is in the run's RaaS group now "
                f"(members: {', '.join(ids) or 'none'}){hint}: the command is kept for when it starts"]


def worker_command(workflow: str, action: str, worker: str | None, per_minute: int | None,
                   reason: str | None) -> Control:
    """The command ``action`` (one of :data:`ACTIONS`) for every RaaS worker of ``workflow``
    (``raas.<workflow>``) or for worker ``worker`` (``raas.<workflow>/raas-<worker>``); a throttle's
    ``per_minute`` prompts a minute per worker (None: lift the throttle).

    Raises:
        pydantic.ValidationError: a value the action does not take, or one too large to encode.
    """
    component = f"raas.{workflow}" + (f"/raas-{worker}" if worker is not None else "")
    return Control(component=component, action=action, value=per_minute, reason=reason or "astraflow control")


def send_command(cfg: RunConfig, message: Control, worker: str | None) -> Sent:
    """Write ``message`` (for one ``worker``, or None: the workflow's) to the ``control`` topic of ``cfg``'s run,
    creating the run's topics if missing, and look whether the run and the worker are there.

    Raises:
        topics.bus.BusError: the bus does not answer.
    """
    names = TopicNames(cfg.run)
    bus = connect(cfg.bus, cfg.kafka)
    admin = bus.admin()
    started = names.control in admin.list_topics()
    members = admin.group_members(names.raas_group(cfg.workflow.name)) if started and worker is not None else {}
    ensure_run_topics(admin, names, list(cfg.policies))
    producer = bus.producer()
    producer.send(names.control, encode(message), key=message.key(), headers=headers_for(message))
    producer.flush()
    producer.close()
    return Sent(message, cfg.run, cfg.bus, worker, started, list(members))
