"""The single-machine launcher behind ``astraflow run``.

It starts each component as its own process (acquisition, N RaaS workers, one
filter processor and one trainer per policy, a vLLM server per policy whose
``engine: vllm`` names no ``vllm.url``, and the search tool's server ``search`` when
``tools.search`` names no ``url``: the others start once it answers ``/health``), each
with a log file in ``<run_dir>/logs``. It never calls them: they meet on the bus and the store.
A live view shows step, version, reward, KL, throughput, lag and staleness.

The run ends when every trainer has produced its ``steps`` versions (or after
``max_wall_s``, or on Ctrl-C). Components are then stopped with SIGTERM, which
they handle by finishing their current unit of work and committing, so nothing
is lost.

Supervision, like Kubernetes' CrashLoopBackOff: a component that stops while the
run goes on (killed, or a non-zero exit) is reported with the tail of its log and
restarted after a back-off (1 s, doubling, at most 30 s; back to 1 s once a
process of it ran ``HEALTHY_S`` seconds): RaaS workers, filter processors and
acquisition are stateless group members, and a trainer resumes from its checkpoint.
A component that once got going (a process of it ran ``STARTED_S`` seconds) is
restarted for as long as the run goes, however often it is killed; so is one
killed from outside by a signal. A component that exits on its own
``MAX_START_FAILURES`` times before it ever got going (bad config, a port in use)
cannot start: the run fails, naming it. The live view survives an unreachable bus
(one line per condition). The summary's ``complete`` says whether
every trainer reached its steps; ``astraflow run`` exits non-zero when not.

Outputs in the run directory: ``metrics.jsonl`` (every Metric record),
``reward_curve.png``, ``components.json`` (each component's pid, exit code and restarts, kept
current while the run goes) and
``logs/<component>.log``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live

from astraflow.config import RunConfig
from astraflow.monitor import RunMonitor
from astraflow.placement import check_placement, placement_env
from topics.atomic_write import atomic_write
from topics.bus import BusError, connect
from topics.follow import LatestByKey
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Control, TrainerProgress

console = Console(stderr=True)

RESTART_BACKOFF_S = (1.0, 30.0)  # first back-off before a restart, doubling up to the second
HEALTHY_S = 60.0          # a process that ran this long before it stopped puts its component's back-off back to 1 s
STARTED_S = 30.0          # a component got going once one of its processes ran this long; it is restarted ever after
MAX_START_FAILURES = 5    # exits of its own before a component ever got going, after which the run fails, naming it
#: signals that stop a process from outside (an operator, a fault tool, the OOM killer): not a failure to start
EXTERNAL_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
VIEW_JOIN_S = 150.0       # > one live-view round with the bus down: lags (10 s metadata + 30 s offsets), members (30 s), watchdog lags (40 s)
#: seconds past its batch deadline (``policies.<p>.filter_processor.step_deadline_s``, which covers a wedge inside a
#: batch) that a filter processor may leave records of ``trajectories.<p>`` waiting at unmoved committed offsets
#: before the launcher kills it as wedged; this covers the rest (start-up, a client call between batches, a stopped
#: process)
FILTER_WEDGE_MARGIN_S = 40.0
FILTER_CHECK_S = 10.0     # seconds between two looks at the filter processors' committed offsets
SEARCH_STARTUP_S = 120.0  # seconds the search server may take to answer /health (it indexes its corpus first)
PROGRESS_READ_S = 10.0    # seconds the starvation check may take to read the trainers' progress to the end of control


@dataclass
class Component:
    """One launched process: its name, command line, log file and exit state."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    reported: bool = field(default=False)
    restarts: int = 0        # in all
    backoff_step: int = 0    # restarts since a process of it last ran HEALTHY_S seconds: its next delay doubles with it
    got_going: bool = False  # a process of it ran STARTED_S seconds
    start_failures: int = 0  # exits of its own (not a signal from outside) before it got going
    started_at: float = 0.0  # monotonic
    restart_at: float | None = None  # monotonic time of a scheduled restart
    retired: bool = False  # stopped on purpose (scaled down): not restarted, not a failure
    env: dict[str, str] | None = None  # its whole environment (None: the launcher's, see Launcher._start)
    #: a server's URL: the components after it start once ``GET <ready_url>/health`` answers (Launcher.run)
    ready_url: str | None = None

    @property
    def kind(self) -> str:
        return self.name.split(".")[0].split("-")[0]


#: kinds whose exit code 0 means their work is done (acquisition sent its prompts, a trainer reached its steps)
DONE_KINDS = ("acquire", "trainer")
#: a component's exit status when its input is bad and a restart would meet it again (acquisition with data.strict)
EXIT_BAD_INPUT = 3


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of an exited component's process group (each component leads its own session,
    so its group id is its pid): children that outlived it, e.g. the ranks of a killed ``torchrun``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group


def component_argv(command: str, config_path: Path, overrides: list[str], *extra: str) -> list[str]:
    """The command line of one component: ``python -m astraflow <command> CONFIG [overrides] [extra]``."""
    return [sys.executable, "-m", "astraflow", command, str(config_path), *overrides, *extra]


def trainer_argv(ranks: int, config_path: Path, overrides: list[str], policy: str) -> list[str]:
    """The command line of policy ``policy``'s trainer: ``python -m astraflow trainer CONFIG [overrides]
    --policy P`` on one rank; under ``python -m torch.distributed.run --standalone --nproc_per_node
    ranks`` (torchrun: one process per rank, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set) when
    ``ranks`` > 1."""
    argv = component_argv("trainer", config_path, overrides, "--policy", policy)
    if ranks <= 1:
        return argv
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            *argv[1:]]


#: The environment variable through which a launched component learns its launcher's pid.
LAUNCHER_PID_ENV = "ASTRAFLOW_LAUNCHER_PID"
#: Seconds a component whose launcher died has to stop cleanly before it exits hard.
ORPHAN_GRACE_S = 30.0


def process_start_time(pid: int) -> int | None:
    """The start time of live process ``pid`` (clock ticks since boot, field 22 of ``/proc/PID/stat``), which
    tells it from a later process given the same pid; None when there is no such process or it is a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def watch_launcher(name: str, stop: threading.Event, poll_s: float = 1.0) -> threading.Thread | None:
    """In a component started by ``astraflow run`` (``$ASTRAFLOW_LAUNCHER_PID`` set), watch the launcher: once
    that process is gone (killed, even by SIGKILL: components run in their own sessions, so nothing else
    reaches them; a rank under torchrun has torchrun as its parent, so it is the launcher itself that is
    watched), log it, set ``stop`` and, if the component has not exited ``ORPHAN_GRACE_S`` seconds later,
    exit with status 1. Returns the watching daemon thread, or None outside a launched run."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return None
    started = process_start_time(int(launcher))

    def watch() -> None:
        while started is not None and process_start_time(int(launcher)) == started:
            time.sleep(poll_s)
        print(f"{name}: the launcher (pid {launcher}) is gone: stopping, exiting in at most {ORPHAN_GRACE_S:.0f} s",
              file=sys.stderr, flush=True)
        stop.set()
        time.sleep(ORPHAN_GRACE_S)
        os._exit(1)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def policy_component(policy: str, instance: int) -> str:
    """The component name of filter processor ``instance`` of ``policy``: ``policy.<policy>`` for instance 0,
    ``policy.<policy>.<instance>`` for the others."""
    return f"policy.{policy}" + (f".{instance}" if instance else "")


def vllm_components(cfg: RunConfig, logs: Path) -> tuple[list[Component], list[str]]:
    """A vLLM server component per policy with ``engine: vllm`` and no ``vllm.url``, on ``vllm.port`` (None: a
    free port), in the dtype its trainer publishes; and the RaaS options that point the workers at them
    (``--vllm-url <p>=http://127.0.0.1:<port>``)."""
    from producers.vllm_server import free_port, server_argv, server_env
    from weights.models import resolve_model

    comps, urls = [], []
    for p, pc in cfg.policies.items():
        if pc.engine != "vllm" or pc.vllm.url is not None:
            continue
        port = pc.vllm.port or free_port()
        argv = [str(pc.vllm.python), "-m", "producers.vllm_server",
                *server_argv(pc.vllm.python, resolve_model(pc.model), port, pc.trainer.param_dtype,
                             pc.vllm.max_model_len, pc.vllm.args)]
        comps.append(Component(f"vllm.{p}", argv, logs / f"vllm.{p}.log",
                               env=server_env(dict(os.environ), pc.vllm.kv_cache_gib)))
        urls += ["--vllm-url", f"{p}=http://127.0.0.1:{port}"]
    return comps, urls


def search_components(cfg: RunConfig, logs: Path) -> tuple[list[Component], list[str]]:
    """The search tool's server, component ``search`` (``astraflow search-server``), when ``tools.search`` is set
    with no ``url``, on ``tools.search.port`` (None: a free port); and the RaaS options that point the workers at it
    (``--search-url http://127.0.0.1:<port>``)."""
    s = cfg.tools.search
    if s is None or s.url is not None:
        return [], []
    from producers.vllm_server import free_port

    port = s.port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "astraflow", "search-server", "--port", str(port),
            "--median-s", repr(s.latency.median_s), "--p99-s", repr(s.latency.p99_s),
            "--hang", repr(s.faults.hang), "--error", repr(s.faults.error), "--garbage", repr(s.faults.garbage),
            "--hang-s", repr(s.faults.hang_s), "--seed", str(s.seed),
            *(["--corpus", str(s.corpus)] if s.corpus is not None else [])]
    return [Component("search", argv, logs / "search.log", ready_url=url)], ["--search-url", url]


def plan_components(cfg: RunConfig, config_path: Path, overrides: list[str]) -> list[Component]:
    """The processes of a run, in start order: the search server when ``tools.search`` is set without a ``url``,
    vLLM servers, trainers and filters, then RaaS, then acquisition, then
    the scaling controller when ``controller.enabled``, then the Prometheus exporter when ``exporter.port`` is
    set, then the TensorBoard/W&B tracker when ``tracking.tensorboard_dir`` or ``tracking.wandb_project`` is
    set."""
    logs = cfg.run_dir / "logs"
    comps, server_urls = search_components(cfg, logs)
    vllm, vllm_urls = vllm_components(cfg, logs)
    comps += vllm
    server_urls += vllm_urls
    for p in cfg.policies:
        comps.append(Component(f"trainer.{p}", trainer_argv(cfg.policies[p].trainer.ranks, config_path, overrides, p),
                               logs / f"trainer.{p}.log"))
        for i in range(cfg.policies[p].filter_processor.instances):
            name = policy_component(p, i)
            comps.append(Component(name, component_argv("policy", config_path, overrides, "--policy", p,
                                                         "--instance", str(i)), logs / f"{name}.log"))
    for i in range(cfg.raas.workers):
        comps.append(Component(f"raas-{i}", component_argv("raas", config_path, overrides, "--worker-id", str(i),
                                                            *server_urls), logs / f"raas-{i}.log"))
    comps.append(Component("acquire", component_argv("acquire", config_path, overrides), logs / "acquire.log"))
    if cfg.controller.enabled:
        comps.append(Component("controller", component_argv("controller", config_path, overrides),
                               logs / "controller.log"))
    if cfg.exporter.port is not None:
        comps.append(Component("exporter", component_argv("exporter", config_path, overrides), logs / "exporter.log"))
    if cfg.tracking.enabled:
        comps.append(Component("tracker", component_argv("tracker", config_path, overrides), logs / "tracker.log"))
    return comps


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def reward_summary(history: list[tuple[int, float]]) -> tuple[float | None, float | None]:
    """Mean training reward over the first and the last 20% of ``history``'s (step, reward) steps (at least one step
    each); a step that appears more than once counts once, with its newest reward."""
    if not history:
        return None, None
    rewards = [r for _, r in sorted(dict(history).items())]  # one per step: the newest, if a step was redone
    k = max(1, len(rewards) // 5)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def plot_rewards(views: dict, path: Path) -> None:
    """Write a reward-curve PNG: training reward mean per step, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, v in views.items():
        if v.history:
            steps, rewards = zip(*sorted(v.history))
            ax.plot(steps, rewards, label=policy)
    ax.set_xlabel("trainer step (version)")
    ax.set_ylabel("training reward (group mean)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def preflight(cfg: RunConfig) -> None:
    """Check what the config names before any process starts: the workflow and its options, the data
    sources, the curators, each policy's filter chain, serving policies and model directory, the packages of the
    tracking sinks, the placement's CPUs, and the scaling controller's actuator (its compose file or Kubernetes
    credentials; the bus is checked by the caller).

    Raises:
        KeyError, ValueError, TypeError: an unknown workflow, role, option or filter (the message lists the known ones);
            a placement on CPUs this machine lacks (:class:`~astraflow.config.ConfigError`, a ValueError); a
            controller's compose file that does not exist, or no Kubernetes credentials for it.
        ValueError: a weight store URI that is not file:///abs/dir or s3://bucket/prefix.
        producers.sources.SourceError: a data source that is neither built in nor a readable dataset.
        FileNotFoundError: a model directory that does not exist.
        astraflow.tracker.TrackingUnavailable: a tracking sink is set and its package is not installed.
    """
    from astraflow.tracker import require_packages
    from policies.base import Curator, Filter, PolicyConfigError
    from policies.registry import build_chain, build_serving
    from producers.sources import load_source
    from producers.workflows import get_workflow
    from weights.models import BUILT_MODELS, resolve_model
    from weights.store import StoreError, check_store_uri

    check_placement(cfg)
    try:
        check_store_uri(cfg.store)
    except StoreError as e:
        raise ValueError(f"store: {e}") from None
    get_workflow(cfg.workflow.name, policies=cfg.workflow.roles or None, **cfg.workflow.options)
    for src in cfg.data.sources:
        load_source(src.name, adapter=src.adapter, split=src.split, seed=cfg.seed)
    try:
        build_chain(cfg.curators, Curator)
    except PolicyConfigError as e:
        raise PolicyConfigError(e.policy, f"{e.reason} (curators)", e.param) from None
    for name, pc in cfg.policies.items():
        for field, build in (("filters", lambda: build_chain(pc.filters, Filter)),
                             ("serving", lambda: build_serving(pc.serving))):
            try:
                build()
            except PolicyConfigError as e:
                raise PolicyConfigError(e.policy, f"{e.reason} (policies.{name}.{field})", e.param) from None
        if pc.model not in BUILT_MODELS:
            resolve_model(pc.model)
    search = cfg.tools.search
    if search is not None and search.url is None:  # the corpus the launched search server indexes
        from producers.search_server import DEFAULT_CORPUS, load_corpus

        try:
            load_corpus(search.corpus or DEFAULT_CORPUS)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"tools.search.corpus: {e}") from None
    require_packages(cfg.tracking)
    if cfg.controller.enabled:  # the controller's actuator: its compose file, or Kubernetes credentials
        from astraflow.actuators import ActuatorError, build_actuator

        try:
            build_actuator(cfg.controller)
        except ActuatorError as e:
            raise ValueError(str(e)) from None


class Launcher:
    """Runs every component of ``cfg`` on this machine and watches them.

    Args:
        cfg: the validated run config.
        config_path: the YAML file the components re-read.
        overrides: the ``key=value`` overrides, passed on to every component.
    """

    def __init__(self, cfg: RunConfig, config_path: Path, overrides: list[str]):
        self.cfg, self.config_path, self.overrides = cfg, config_path, overrides
        self.names = TopicNames(cfg.run)
        self.components = plan_components(cfg, config_path, overrides)
        self.stopping = False
        self._stall: dict[str, tuple[int | None, float, float]] = {}  # policy -> (version, since, last told)
        #: RaaS workers to run: raas.workers, then the controller's newest target_replicas (read by the view thread)
        self.raas_target = cfg.raas.workers
        self._control: LatestByKey | None = None
        self._progress: LatestByKey | None = None  # the trainers' TrainerProgress, read by the watchdog (view thread)
        self._publish_seen: dict[str, tuple[int, bool]] = {}  # policy -> (publish errors, failing) last told
        #: set by the watchdog (view thread) when a trainer can get no more data; the run then fails with it
        self.data_exhausted: str | None = None
        #: policy -> the filter group's committed offsets on trajectories.<p> and since when they have not moved
        self._filter_seen: dict[str, tuple[dict[int, int | None], float]] = {}
        self._filter_looked = 0.0

    def _start(self, comp: Component) -> None:
        comp.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(comp.env or os.environ, PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{LAUNCHER_PID_ENV: str(os.getpid())})
        placement = getattr(self.cfg.placement, comp.kind, None)
        if placement is not None:  # vLLM servers are placed by their own options
            env.update(placement_env(placement))
        with open(comp.log, "ab") as log:
            comp.proc = subprocess.Popen(comp.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        comp.started_at = time.monotonic()
        self._write_components()

    def _wait_ready(self, comp: Component, timeout_s: float = SEARCH_STARTUP_S) -> None:
        """Wait until started server ``comp`` answers ``GET <ready_url>/health``.

        Raises:
            RuntimeError: it exited first, or did not answer within ``timeout_s`` (then it is killed); the
                message names the component and carries its log's tail.
        """
        from producers.vllm_server import wait_healthy

        try:
            waited = wait_healthy(comp.ready_url, timeout_s, alive=lambda: comp.proc.poll() is None,
                                  what=f"component {comp.name}", log=console.print)
        except RuntimeError as e:
            comp.proc.kill()
            comp.proc.wait()
            _kill_group(comp.proc)
            self._write_components()
            raise RuntimeError(f"{e}; last lines of {comp.log}:\n{_tail(comp.log)}") from None
        console.print(f"{comp.name} answers at {comp.ready_url} (after {waited:.1f} s)")

    def _write_components(self) -> None:
        """``components.json`` in the run directory: per component its ``pid`` (the live or last process),
        ``exit_code`` (None while it runs) and ``restarts``; rewritten atomically at each start, each exit and
        at the end, so operators and fault tools can find the live processes."""
        codes = {c.name: {"pid": c.proc.pid if c.proc else None,
                          "exit_code": c.proc.poll() if c.proc else None, "restarts": c.restarts}
                 for c in self.components}
        atomic_write(self.cfg.run_dir / "components.json", json.dumps(codes, indent=1))

    def _stop_all(self, grace_s: float = 60.0) -> None:
        """SIGTERM every live component, the servers (vLLM, search) last (their clients stop first, so no
        request in flight loses its server); each tier has ``grace_s`` seconds before it is killed."""
        live = [c for c in self.components if c.proc and c.proc.poll() is None]
        servers = ("vllm", "search")
        for tier in ([c for c in live if c.kind not in servers], [c for c in live if c.kind in servers]):
            for c in tier:
                c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for c in tier:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    console.print(f"[yellow]{c.name} did not stop in {grace_s:.0f} s; killing it[/]")
                    c.proc.kill()
                    c.proc.wait()
                _kill_group(c.proc)

    def _supervise(self) -> list[Component]:
        """Report components that stopped while the run goes on and restart them after their back-off (module
        docstring); returns those that cannot be restarted: stopped on bad input, or unable to start."""
        failed = []
        now = time.monotonic()
        for c in self.components:
            if c.restart_at is not None and now >= c.restart_at:
                c.restart_at, c.reported = None, False
                self._start(c)
                console.print(f"[yellow]restarted {c.name}[/] (restart {c.restarts})")
                continue
            code = c.proc.poll() if c.proc else None
            if code is None or c.reported:
                continue
            c.reported = True
            _kill_group(c.proc)  # what it left running: torchrun's ranks, a vLLM server's engine core
            self._write_components()  # its exit code, for operators and fault tools
            if self.stopping or c.retired or (code == 0 and c.kind in DONE_KINDS):
                continue
            # The others run until the launcher stops them: exit 0 means a SIGTERM from elsewhere, and the run
            # would wait on them forever.
            ran_s = now - c.started_at
            how = ("stopped (exit code 0) while the run goes on" if code == 0 else
                   f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                   else f"died with exit code {code}")
            console.print(f"[bold red]component {c.name} {how}[/] after {ran_s:.1f} s; last lines of {c.log}:\n"
                          f"{_tail(c.log)}")
            if code == EXIT_BAD_INPUT:
                console.print(f"[bold red]{c.name} stopped on bad input; a restart would stop there again[/]")
                failed.append(c)
                continue
            delay = self._restart_delay(c, code, ran_s)
            if delay is None:
                console.print(f"[bold red]{c.name} cannot start: it exited on its own {c.start_failures} times "
                              f"before any process of it ran {STARTED_S:.0f} s (exit code {code}; see {c.log})[/]")
                failed.append(c)
                continue
            c.restarts += 1
            c.restart_at = now + delay
            console.print(f"[yellow]restarting {c.name} in {delay:.0f} s[/]")
        return failed

    @staticmethod
    def _restart_delay(c: Component, code: int, ran_s: float) -> float | None:
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

    def run(self) -> dict:
        """Start everything, show the live view, stop cleanly; returns the summary dict.

        Raises:
            RuntimeError: a component died (its log tail is printed first).
        """
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        bus = connect(cfg.bus, cfg.kafka)
        ensure_run_topics(bus.admin(), self.names, list(cfg.policies))
        monitor = RunMonitor(bus, self.names, list(cfg.policies), cfg.workflow.name)
        t0 = time.monotonic()
        for c in self.components:
            self._start(c)
            if c.ready_url is not None:
                self._wait_ready(c)
        console.print(f"run [bold]{cfg.run}[/] in {cfg.run_dir}: {len(self.components)} components "
                      f"(logs in {cfg.run_dir / 'logs'}); bus {cfg.bus}; store {cfg.store}")
        interrupted, failed = False, []
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops cleanly too
        done, view = threading.Event(), None
        try:
            with Live(monitor.table(), console=console, refresh_per_second=2, transient=False) as live:
                # The view waits on the bus (admin requests block up to 30 s when it is down); supervision
                # must not, so the view has its own thread.
                view = threading.Thread(target=self._view, args=(monitor, live, t0, done), name="live-view",
                                        daemon=True)
                view.start()
                while True:
                    self._scale_raas()
                    failed = self._supervise()
                    if failed or self.data_exhausted:
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
            self.stopping = True
            done.set()
            self._stop_all()
            if view is not None:
                # The view's requests are bounded (a down bus costs one timeout per kind of request), so this
                # ends; the monitor's clients must not be used by two threads or closed under the view.
                view.join(timeout=VIEW_JOIN_S)
            if view is not None and view.is_alive():
                console.print(f"[yellow]the live view still waits on the bus after {VIEW_JOIN_S:.0f} s; "
                              f"the last metrics are not read[/]")
            else:
                try:
                    monitor.poll(1.0)
                    monitor.close()
                    for follower in (self._control, self._progress):
                        if follower is not None:
                            follower.close()
                except BusError as e:
                    console.print(f"[yellow]the last metrics could not be read: {e}[/]")
        wall = time.monotonic() - t0
        console.print()  # end the live view's line, so the JSON summary starts on its own line
        summary = self._write_outputs(monitor, wall)
        if failed:
            raise RuntimeError(f"components failed: {', '.join(c.name for c in failed)} (why above; see their logs)")
        if self.data_exhausted and not interrupted:
            raise RuntimeError(self.data_exhausted)
        if interrupted:
            summary["interrupted"] = True
        return summary

    def _view(self, monitor: RunMonitor, live: Live, t0: float, done: threading.Event) -> None:
        """The live view's loop (its own thread, until ``done``): metrics, the table, the watchdog. An
        unreachable bus is reported once per condition; the components ride it out by restarts."""
        trouble, last = "", 0.0
        while not done.is_set():
            try:
                monitor.poll(0.5)
                if time.monotonic() - last > 1.0:
                    live.update(monitor.table(f"run {self.cfg.run}  {time.monotonic() - t0:.0f} s"))
                    last = time.monotonic()
                self._watchdog(monitor)
                self._watch_filters(monitor)
                self._publish_alerts(monitor)
                self._read_target(monitor.bus)
                if trouble:
                    console.print("[green]the bus answers again[/]")
                    trouble = ""
            except BusError as e:
                if not trouble:
                    console.print(f"[bold yellow]bus trouble (components ride it out by restarts): {e}[/]")
                trouble = str(e)
                done.wait(0.5)

    def _read_target(self, bus) -> None:
        """With ``controller.enabled`` and ``actuator: local``: the controller's newest ``target_replicas`` for this
        run's RaaS workers (from ``control``) becomes :attr:`raas_target` (the view thread: it may wait on the bus).
        Another actuator scales RaaS elsewhere (compose, Kubernetes), not the launcher's workers."""
        if not self.cfg.controller.enabled or self.cfg.controller.actuator != "local":
            return
        if self._control is None:
            self._control = LatestByKey(bus, self.names.control, Control, client_id=f"{self.cfg.run}.launcher-control")
        msg = self._control.poll(0.0).get(f"raas.{self.cfg.workflow.name}")
        if msg is not None and msg.action == "target_replicas" and msg.value and msg.value != self.raas_target:
            console.print(f"[cyan]controller: {msg.value} RaaS workers[/] ({msg.reason})")
            self.raas_target = msg.value

    def _scale_raas(self) -> None:
        """The local actuator: start RaaS workers (``raas-N``, the next free N) or SIGTERM the newest ones until
        :attr:`raas_target` run; a worker stopped so is retired (not restarted, not a failure)."""
        active = [c for c in self.components if c.kind == "raas" and not c.retired]
        if len(active) < self.raas_target:
            template = next(c for c in self.components if c.kind == "raas")
            n = max(int(c.name.split("-", 1)[1]) for c in self.components if c.kind == "raas") + 1
            argv = list(template.argv)
            argv[argv.index("--worker-id") + 1] = str(n)
            comp = Component(f"raas-{n}", argv, template.log.with_name(f"raas-{n}.log"))
            self.components.append(comp)
            self._start(comp)
            console.print(f"[cyan]started {comp.name}[/] ({len(active) + 1} RaaS workers)")
        elif len(active) > self.raas_target:
            newest = max(active, key=lambda c: int(c.name.split("-", 1)[1]))
            newest.retired = True
            if newest.proc is not None and newest.proc.poll() is None:
                newest.proc.send_signal(signal.SIGTERM)
            console.print(f"[cyan]stopping {newest.name}[/] ({len(active) - 1} RaaS workers)")

    def _watchdog(self, monitor: RunMonitor) -> None:
        """Print one line per ``watchdog_s`` for each unfinished trainer whose version has not moved,
        naming what it waits for: its backlog, its filter's, and RaaS workers paused by backpressure or held by
        an operator's pause or throttle (`astraflow control`). When no more data can come (:meth:`_starved`),
        :attr:`data_exhausted` says so and the run fails with it."""
        now = time.monotonic()
        for p, view in monitor.views.items():
            trainer = next(c for c in self.components if c.name == f"trainer.{p}")
            if trainer.proc is not None and trainer.proc.poll() == 0:
                continue
            version, since, told = self._stall.get(p, (None, now, now))
            if view.version != version:
                self._stall[p] = (view.version, now, now)
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
            if self._starved(monitor, p, lags, now - since, view.step_s):
                self.data_exhausted = (
                    f"the data ran out: trainer.{p} has been at version {version} of {self.cfg.policies[p].steps} "
                    f"for {now - since:.0f} s, acquisition has sent every prompt and all were rolled out and "
                    f"filtered (samples.{p} lag {samples} committed); raise data.epochs or lower "
                    f"policies.{p}.steps")
                console.print(f"[bold red]watchdog: {self.data_exhausted}[/]")
                return
            console.print(f"[bold yellow]watchdog: trainer.{p} has been at version {version} for {now - since:.0f} s;"
                          f"[/] samples.{p} lag {samples} (committed), trajectories.{p} lag {filtered}; "
                          + (held or "no RaaS worker reports a pause"))

    def _watch_filters(self, monitor: RunMonitor) -> None:
        """Every ``FILTER_CHECK_S``: a policy whose filter group has left records of ``trajectories.<p>`` waiting at
        the same committed offsets for its ``filter_processor.step_deadline_s`` + ``FILTER_WEDGE_MARGIN_S`` seconds,
        all of them with its processors running (a restarted one gets the whole bound), has a wedged filter
        processor (seen: a filter that read nothing for 10 min after a broker restart). Its live processors get
        SIGUSR1 (each writes its threads' stacks to its log: what was blocked) and then SIGKILL;
        supervision restarts them from the committed offsets (their transactional producers fence the killed
        ones). A bus that does not answer is not a wedge: the clocks start again."""
        now = time.monotonic()
        if now - self._filter_looked < FILTER_CHECK_S:
            return
        self._filter_looked = now
        for p in self.cfg.policies:
            group, topic = self.names.filter_group(p), self.names.trajectories(p)
            try:
                committed = monitor.admin.group_offsets(group, topic)
                lag = sum(monitor.admin.group_lag(group, topic, committed).values())
            except BusError:
                self._filter_seen.clear()
                return
            seen, since = self._filter_seen.get(p, (None, now))
            if lag <= 0 or committed != seen:
                self._filter_seen[p] = (committed, now)
                continue
            live = [c for c in self.components if c.kind == "policy" and c.name.split(".")[1] == p
                    and c.proc is not None and c.proc.poll() is None]
            bound = self.cfg.policies[p].filter_processor.step_deadline_s + FILTER_WEDGE_MARGIN_S
            if not live or now - max(since, *(c.started_at for c in live)) < bound:
                continue
            console.print(f"[bold red]watchdog: {lag} records of {topic} have waited at the same committed offsets "
                          f"of {group} for {now - since:.0f} s: killing {', '.join(c.name for c in live)} as wedged "
                          f"(stacks in their logs); it restarts from those offsets[/]")
            for c in live:
                c.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            for c in live:
                c.proc.kill()
            self._filter_seen[p] = (committed, now)

    def _starved(self, monitor: RunMonitor, policy: str, lags: dict, stalled_s: float, step_s: float | None) -> bool:
        """Whether trainer ``policy`` can get no more data: acquisition has finished, every prompt has been rolled
        out and filtered (committed lags 0), the trainer holds less than a batch (its :class:`TrainerProgress`
        against the end offsets of ``samples.<policy>``, less one transaction marker per partition), and it has
        been stalled for over 3 of its newest step times (a step can outlast ``watchdog_s``). The trainer's progress
        is read to the end of ``control`` at each look, so a starved trainer is told at the first look after the
        stall. Unknowns (a bus that does not answer, no progress yet) are not starvation."""
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
            ends = monitor.admin.end_offsets(self.names.samples(policy))
        except BusError:
            return False
        return (progress is not None and not progress.at_barrier
                and sum(ends.values()) - len(ends) - progress.consumed < self.cfg.policies[policy].batch_groups)

    def _publish_alerts(self, monitor: RunMonitor) -> None:
        """One console line when a trainer's weight publishes start failing (or fail again), and one when
        they are durable again (from the trainers' ``publish_errors`` alerts on ``metrics``)."""
        for p, view in monitor.views.items():
            seen = self._publish_seen.get(p, (0, False))
            if (view.publish_errors, view.publish_failing) == seen:
                continue
            self._publish_seen[p] = (view.publish_errors, view.publish_failing)
            if view.publish_failing:
                console.print(f"[bold yellow]trainer.{p}: {view.publish_errors} failed weight publish(es); the newest "
                              f"durable version is {view.durable_version} (reason in logs/trainer.{p}.log)[/]")
            else:
                console.print(f"[green]trainer.{p}: weights are durable again (version {view.durable_version})[/]")

    def _trainer_versions(self) -> dict[str, int]:
        """Each trainer's last reported version (its :class:`TrainerProgress` on ``control``)."""
        follower = LatestByKey(connect(self.cfg.bus, self.cfg.kafka), self.names.control, TrainerProgress,
                               client_id="launcher")
        try:
            latest = follower.read_to_end(timeout_s=30.0)
        except BusError as e:
            console.print(f"[yellow]cannot read the trainers' progress: {e}[/]")
            return {}
        finally:
            follower.close()
        return {m.policy: m.version for m in latest.values()}

    def _write_outputs(self, monitor: RunMonitor, wall_s: float) -> dict:
        run_dir = self.cfg.run_dir
        self._write_components()
        with open(run_dir / "metrics.jsonl", "w") as f:
            for m in monitor.records:
                f.write(json.dumps(m.model_dump(mode="json")) + "\n")
        plot_rewards(monitor.views, run_dir / "reward_curve.png")
        # reward_first / reward_last follow the first policy of the config (the solver, the actor, ...).
        first, last = reward_summary(next(iter(monitor.views.values())).history)
        trainers_done = all(c.proc is not None and c.proc.returncode == 0 for c in self.components
                            if c.kind == "trainer")
        versions = self._trainer_versions()
        versions_done = all(versions.get(p, 0) >= pc.steps for p, pc in self.cfg.policies.items())
        return {
            "run": self.cfg.run,
            "complete": trainers_done and versions_done,
            "restarts": sum(c.restarts for c in self.components),
            "steps": max((v.step for v in monitor.views.values()), default=0),
            "versions": {p: versions.get(p, v.version) for p, v in monitor.views.items()},
            "reward_first": None if first is None else round(first, 4),
            "reward_last": None if last is None else round(last, 4),
            "dead_letters": monitor.dead_letters,
            "wall_s": round(wall_s, 1),
        }
