"""Supervision of a run's processes, like Kubernetes' CrashLoopBackOff.

A component that stops while the run goes on (killed, or a non-zero exit) is reported with the tail of its log and
restarted after a back-off (1 s, doubling, at most 30 s; back to 1 s once a process of it ran ``HEALTHY_S``
seconds): RaaS workers, filter processors and acquisition are stateless group members, and a trainer resumes from
its checkpoint. A component that once got going (a process of it ran ``STARTED_S`` seconds) is restarted for as
long as the run goes, however often it is killed; so is one killed from outside by a signal. A component that
exits on its own ``MAX_START_FAILURES`` times before it ever got going (bad config, a port in use) cannot start:
the run fails, naming it; so does one that exits with ``EXIT_BAD_INPUT``, and a trainer that exits with
``EXIT_COLLAPSED`` (its reward collapsed and ``stop_on_collapse`` stopped it).

The liveness rule (:mod:`topics.liveness`): a component that makes no progress while records wait for it and the
cluster answers exits by itself, and is restarted here from what its group committed. A process that cannot run the
rule, because none of its threads runs (a C call that holds the interpreter lock, a stopped process), is found from
outside, like a liveness probe: its heartbeat file (:data:`astraflow.launched.HEARTBEAT_ENV`, touched every second
by a thread of its own; one per rank under ``torchrun``) has not changed for ``FROZEN_S`` seconds of the launcher's
monotonic clock; its process group gets SIGUSR1 (each writes its threads' stacks to its log: what held it) and then
SIGKILL, and it is restarted.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from rich.console import Console

from astraflow.config import RunConfig
from astraflow.launched import EXIT_BAD_INPUT, EXIT_COLLAPSED, HEARTBEAT_ENV, LAUNCHER_PID_ENV
from astraflow.launcher.outputs import write_components
from astraflow.launcher.plan import Component
from astraflow.placement import component_placement, placement_env

RESTART_BACKOFF_S = (1.0, 30.0)  # first back-off before a restart, doubling up to the second
HEALTHY_S = 60.0          # a process that ran this long before it stopped puts its component's back-off back to 1 s
STARTED_S = 30.0          # a component got going once one of its processes ran this long; it is restarted ever after
MAX_START_FAILURES = 5    # exits of its own before a component ever got going, after which the run fails, naming it
#: signals that stop a process from outside (an operator, a fault tool, the OOM killer): not a failure to start
EXTERNAL_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: kinds whose exit code 0 means their work is done (acquisition sent its prompts, a trainer reached its steps)
DONE_KINDS = ("acquire", "trainer")
SEARCH_STARTUP_S = 120.0  # seconds the search server may take to answer /health (it indexes its corpus first)
FROZEN_S = 120.0          # seconds a component's heartbeat file may go untouched before it is killed as frozen
STACKS_WAIT_S = 3.0       # seconds a frozen component's log is given to grow with its stacks before SIGKILL


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of an exited component's process group (each component leads its own session,
    so its group id is its pid): children that outlived it, e.g. the ranks of a killed ``torchrun``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group


def heartbeat_file(c: Component) -> Path:
    """The file that component ``c``'s process touches while its Python runs (next to its log); each rank of a
    ``torchrun`` component touches its own, this name with ``.<rank>`` added (:func:`heartbeat_files`)."""
    return c.log.with_suffix(".alive")


def heartbeat_files(c: Component) -> list[Path]:
    """Every heartbeat file of component ``c`` there is: its process's and its ranks'."""
    base = heartbeat_file(c)
    return [p for p in base.parent.glob(base.name + "*") if p.name == base.name or p.suffix[1:].isdigit()]


#: Lines a Python process writes as its interpreter exits that say nothing of why it stopped: nanobind's report
#: of objects leaked at exit (printed by extensions such as triton's), which would push the cause off the tail.
EXIT_NOISE = re.compile(r"^(nanobind: leaked |nanobind: this is likely|See https://nanobind| - leaked | - \.\.\. skipped)")


def log_tail(path: Path, n: int = 15) -> str:
    """The last ``n`` lines of log ``path`` that are not interpreter-exit noise (:data:`EXIT_NOISE`), or
    ``(no log)`` when it cannot be read."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join([line for line in lines if not EXIT_NOISE.match(line)][-n:])


def restart_delay(c: Component, code: int, ran_s: float) -> float | None:
    """The back-off before restarting ``c``, whose process stopped with status ``code`` (negative: killed by
    that signal; 0: stopped by a SIGTERM from outside) after ``ran_s`` seconds: ``RESTART_BACKOFF_S[0]``
    doubling with each restart up to ``RESTART_BACKOFF_S[1]``, from the first again after a process that ran
    ``HEALTHY_S`` s. None when ``c`` cannot start: it exited on its own ``MAX_START_FAILURES`` times and no
    process of it ever ran ``STARTED_S`` s. Updates ``c``'s back-off and start-failure counts."""
    c.got_going |= ran_s >= STARTED_S
    if ran_s >= HEALTHY_S:
        c.backoff_step = 0
    from_outside = code == 0 or (code < 0 and -code in EXTERNAL_SIGNALS)
    if not c.got_going and not from_outside:
        c.start_failures += 1
        if c.start_failures >= MAX_START_FAILURES:
            return None
    delay = min(RESTART_BACKOFF_S[0] * 2 ** min(c.backoff_step, 16), RESTART_BACKOFF_S[1])
    c.backoff_step += 1
    return delay


class Supervisor:
    """Starts, restarts and stops the processes of ``components`` (the list is shared: what is added to it is
    supervised too), keeping ``<run_dir>/components.json`` current.

    Args:
        cfg: the run config (its ``placement`` and ``run_dir``).
        components: the run's components, in start order.
        console: where reports go.
    """

    def __init__(self, cfg: RunConfig, components: list[Component], console: Console):
        self.cfg, self.components, self.console = cfg, components, console
        #: set once the run stops: an exit is then no longer reported nor restarted
        self.stopping = False
        #: component -> {heartbeat file: (its last mtime seen, ``time.monotonic()`` when that was first seen)}
        self._beats: dict[str, dict[Path, tuple[float, float]]] = {}

    def start(self, comp: Component) -> None:
        """Start a process of ``comp``, in a session of its own, its output appended to its log, its placement's
        CPUs and threads in its environment, this process's pid in ``$ASTRAFLOW_LAUNCHER_PID`` and its heartbeat
        file (:func:`heartbeat_file`, removed first: an earlier process's does not count) in
        ``$ASTRAFLOW_HEARTBEAT_FILE``."""
        comp.log.parent.mkdir(parents=True, exist_ok=True)
        for beat in heartbeat_files(comp):
            beat.unlink(missing_ok=True)
        self._beats.pop(comp.name, None)
        env = dict(comp.env or os.environ, PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   **{LAUNCHER_PID_ENV: str(os.getpid()), HEARTBEAT_ENV: str(heartbeat_file(comp))})
        placement = component_placement(self.cfg, comp.name, comp.kind)
        if placement is not None:  # vLLM servers are placed by their own options
            env.update(placement_env(placement))
        with open(comp.log, "ab") as log:
            comp.proc = subprocess.Popen(comp.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        comp.started_at = time.monotonic()
        write_components(self.components, self.cfg.run_dir)

    def add(self, comp: Component) -> None:
        """Add ``comp`` to the supervised components and start it."""
        self.components.append(comp)
        self.start(comp)

    def wait_ready(self, comp: Component, timeout_s: float = SEARCH_STARTUP_S) -> None:
        """Wait until started server ``comp`` answers ``GET <ready_url>/health``.

        Raises:
            RuntimeError: it exited first, or did not answer within ``timeout_s`` (then it is killed); the
                message names the component and carries its log's tail.
        """
        from producers.vllm_server import wait_healthy

        try:
            waited = wait_healthy(comp.ready_url, timeout_s, alive=lambda: comp.proc.poll() is None,
                                  what=f"component {comp.name}", log=self.console.print)
        except RuntimeError as e:
            comp.proc.kill()
            comp.proc.wait()
            kill_group(comp.proc)
            write_components(self.components, self.cfg.run_dir)
            raise RuntimeError(f"{e}; last lines of {comp.log}:\n{log_tail(comp.log)}") from None
        self.console.print(f"{comp.name} answers at {comp.ready_url} (after {waited:.1f} s)")

    def stop_all(self, grace_s: float = 60.0) -> None:
        """SIGTERM every live component, the servers (vLLM, search, OpenEnv) last (their clients stop first, so no
        request in flight loses its server); each tier has ``grace_s`` seconds before it is killed."""
        live = [c for c in self.components if c.proc and c.proc.poll() is None]
        servers = ("vllm", "search", "openenv")
        for tier in ([c for c in live if c.kind not in servers], [c for c in live if c.kind in servers]):
            for c in tier:
                c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for c in tier:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.console.print(f"[yellow]{c.name} did not stop in {grace_s:.0f} s; killing it[/]")
                    c.proc.kill()
                    c.proc.wait()
                kill_group(c.proc)

    def _kill_if_frozen(self, c: Component) -> None:
        """SIGUSR1 then SIGKILL the process group of live component ``c`` if one of its heartbeat files has not
        changed for ``FROZEN_S`` seconds of this process's monotonic clock (a step of the wall clock, or a skewed
        file server, moves no deadline; a component that never touched one, such as a vLLM server, is not looked
        at); the next :meth:`supervise` reports the kill and restarts it."""
        now = time.monotonic()
        beats = self._beats.setdefault(c.name, {})
        stale_s = 0.0
        for path in heartbeat_files(c):
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            seen, since = beats.get(path, (None, now))
            if mtime != seen:
                beats[path] = (mtime, now)
            else:
                stale_s = max(stale_s, now - since)
        if stale_s < FROZEN_S:
            return
        self.console.print(f"[bold red]watchdog: {c.name} has run no Python for {stale_s:.0f} s (frozen: a call that "
                           f"holds the interpreter lock, or a stopped process); killing it (its threads' stacks are "
                           f"in {c.log}); it restarts[/]")
        self._beats.pop(c.name, None)
        try:
            size = c.log.stat().st_size
            os.killpg(c.proc.pid, signal.SIGUSR1)
            # the stacks are written from the signal handler, without the interpreter lock: wait for them
            deadline = time.monotonic() + STACKS_WAIT_S
            while c.log.stat().st_size == size and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            os.killpg(c.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            pass  # it is gone already: supervision reports it

    def supervise(self) -> list[Component]:
        """Report components that stopped while the run goes on and restart them after their back-off (module
        docstring); returns those that cannot be restarted: stopped on bad input, or unable to start."""
        failed = []
        now = time.monotonic()
        for c in self.components:
            if c.restart_at is not None and now >= c.restart_at:
                c.restart_at, c.reported = None, False
                self.start(c)
                self.console.print(f"[yellow]restarted {c.name}[/] (restart {c.restarts})")
                continue
            code = c.proc.poll() if c.proc else None
            if code is None and not self.stopping:
                self._kill_if_frozen(c)
            if code is None or c.reported:
                continue
            c.reported = True
            kill_group(c.proc)  # what it left running: torchrun's ranks, a vLLM server's engine core
            write_components(self.components, self.cfg.run_dir)  # its exit code, for operators and fault tools
            if self.stopping or c.retired or (code == 0 and c.kind in DONE_KINDS):
                continue
            # The others run until the launcher stops them: exit 0 means a SIGTERM from elsewhere, and the run
            # would wait on them forever.
            ran_s = now - c.started_at
            how = ("stopped (exit code 0) while the run goes on" if code == 0 else
                   f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                   else f"died with exit code {code}")
            self.console.print(f"[bold red]component {c.name} {how}[/] after {ran_s:.1f} s; last lines of "
                               f"{c.log}:\n{log_tail(c.log)}")
            if code == EXIT_BAD_INPUT:
                self.console.print(f"[bold red]{c.name} stopped on bad input; a restart would stop there again[/]")
                failed.append(c)
                continue
            if code == EXIT_COLLAPSED and c.kind == "trainer":
                self.console.print(f"[bold red]{c.name} stopped: its reward collapsed (stop_on_collapse); the best "
                                   f"window's checkpoint is kept beside its checkpoints[/]")
                failed.append(c)
                continue
            delay = restart_delay(c, code, ran_s)
            if delay is None:
                self.console.print(f"[bold red]{c.name} cannot start: it exited on its own {c.start_failures} times "
                                   f"before any process of it ran {STARTED_S:.0f} s (exit code {code}; see {c.log})[/]")
                failed.append(c)
                continue
            c.restarts += 1
            c.restart_at = now + delay
            self.console.print(f"[yellow]restarting {c.name} in {delay:.0f} s[/]")
        return failed
