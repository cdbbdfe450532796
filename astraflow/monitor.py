"""Watching a run: metrics from the ``metrics`` topic, rejected records from ``deadletter``, and
consumer-group lag from committed offsets.

Used by the launcher's live view and by ``astraflow status``. It reads the
``metrics`` and ``deadletter`` topics as its own consumer group, so it never disturbs the run.
"""
from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.table import Table

from trainer.collapse import Collapse
from topics.bus import Bus, BusError, TopicPartition, connect, offsets_after
from topics.codec import MessageError, decode
from topics.layout import RunTopics
from topics.names import TopicNames
from topics.schemas import DeadLetter, Metric

if TYPE_CHECKING:
    from astraflow.config import MetricsSection

#: seconds without a metric after which a RaaS worker (it reports every 2 s) is shown as silent: dead or stopped, while
#: its group may still hold its partitions for ``raas.session_timeout_s``
WORKER_SILENT_S = 10.0
#: seconds of a RaaS worker's ``tokens_total`` reports its rollout throughput is taken over
THROUGHPUT_WINDOW_S = 10.0


def component_of(member: str, components) -> str | None:
    """The component (of ``components``, names like ``raas-0``) that consumer-group member ``member`` is: Kafka
    names a member ``"<instance or client id> <member id>"``, the local bus ``"<client id>-<host>-<pid>-<uuid>"``.
    None: no such component."""
    matches = [c for c in components if member == c or member.startswith((f"{c} ", f"{c}-"))]
    return max(matches, key=len, default=None)


@dataclass
class PolicyView:
    """The latest trainer figures of one policy."""

    step: int = 0
    version: int = 0
    reward: float | None = None
    kl: float | None = None
    entropy: float | None = None  # mean token entropy of the newest step, nats
    clipfrac: float | None = None
    grad_norm: float | None = None  # before clipping
    collapse: str | None = None  # the newest collapse alert (trainer/collapse.py), one line
    tokens_per_s: float | None = None
    step_s: float | None = None  # seconds the newest trainer step took
    staleness: float | None = None
    publish_errors: int = 0  # failed weight publishes so far (the trainer's alerts)
    publish_failing: bool = False
    durable_version: int | None = None  # the newest version stored and announced (from the trainer's metrics)
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, reward mean)


class WideOrTall:
    """A table shown as it is where the console is wide enough for it, else its transposed form: a console of 80
    columns (a log, a CI job, a small terminal) would cut each of its headers and values to an ellipsis."""

    def __init__(self, wide: Table, tall: Table) -> None:
        self.wide, self.tall = wide, tall

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        natural = Measurement.get(console, options.update(max_width=10 ** 4), self.wide).maximum
        yield self.wide if natural <= options.max_width else self.tall


class RunMonitor:
    """Follows a run's ``metrics`` and ``deadletter`` topics and reads its consumer-group lag.

    ``dead_letters`` counts the records the run rejected so far (bad prompt lines, prompts over a model's
    context, invalid messages), ``last_dead_letter`` says where the newest came from and why.

    Args:
        bus: the run's bus.
        names: the run's topic names.
        policies: policy names.
        workflow: the workflow name (its RaaS group is ``<run>.raas.<workflow>``).
        group: this monitor's own consumer group (default: a fresh unique one,
            reading the whole topic from the beginning).
        keep: keep every record (:attr:`records`) and each policy's reward history, as a run's outputs need;
            False for a long-running follower (the exporter, the controller) that needs only the newest figures.
    """

    def __init__(self, bus: Bus, names: TopicNames, policies: list[str], workflow: str, group: str | None = None,
                 keep: bool = True):
        self.bus, self.names, self.policies, self.workflow = bus, names, policies, workflow
        self.admin = bus.admin()
        # Its own group has no other member to hand partitions to: a static member there, whose close frees the
        # client without librdkafka's consumer close, which can freeze the process (topics.kafka.KafkaConsumer.close;
        # the launcher has no watchdog of its own). A shared group's members close, leaving it at once.
        me = f"monitor.{uuid.uuid4().hex[:8]}"
        self.consumer = bus.consumer(group) if group else bus.consumer(me, instance_id=me)
        RunTopics(names).deadletter.create(self.admin)  # subscribed before any component made it
        self.consumer.subscribe([names.metrics, names.deadletter])
        self.views = {p: PolicyView() for p in policies}
        self.components: dict[str, Metric] = {}
        self.records: list[Metric] = []
        self.keep = keep
        self.rejected = 0
        self.dead_letters = 0
        self.last_dead_letter: str | None = None
        #: per partition of ``metrics`` and ``deadletter``, the offset after the newest record read (:meth:`commit`)
        self.read_to: dict[TopicPartition, int] = {}
        self._rollout_tokens: dict[str, list[tuple[float, float]]] = {}  # worker -> [(ts, tokens_total)]

    def poll(self, timeout_s: float = 0.2) -> list[Metric]:
        """Read new metrics and dead letters and update the views; returns the metrics (invalid records are
        counted, not raised). Each record counts once: one read again (its offset is below :attr:`read_to`) is
        skipped."""
        out = []
        # A member that rejoins its group (after a broker restart, say) reads on from the group's committed offsets,
        # before what it already read: the records below read_to are not counted twice.
        records = [r for r in self.consumer.poll(1000, timeout_s) if r.offset >= self.read_to.get(r.tp, 0)]
        self.read_to.update(offsets_after(records))
        for r in records:
            if r.topic == self.names.deadletter:
                self._count_dead_letter(r)
                continue
            try:
                m = decode(r.value, Metric, topic=r.topic, partition=r.partition, offset=r.offset)
            except MessageError:
                self.rejected += 1
                continue
            out.append(m)
            self.components[m.component] = m
            if m.kind == "raas" and "tokens_total" in m.values:
                series = self._rollout_tokens.setdefault(m.component, [])
                series.append((m.ts, m.values["tokens_total"]))
                del series[:-1000]  # a worker reports every 2 s: far more than any throughput window
            if m.kind == "trainer" and m.policy in self.views and "collapse" in m.values:
                try:
                    self.views[m.policy].collapse = Collapse.from_values(m.values).describe()
                except KeyError as e:
                    print(f"monitor: {m.component}'s collapse alert lacks {e}; not shown", file=sys.stderr)
            elif m.kind == "trainer" and m.policy in self.views and "publish_errors" in m.values:
                v = self.views[m.policy]
                v.publish_errors = int(m.values["publish_errors"])
                v.publish_failing = bool(m.values.get("publish_failing"))
                v.durable_version = int(m.values.get("durable_version", 0))
            elif m.kind == "trainer" and m.policy in self.views:
                v = self.views[m.policy]
                # the metric's step is the version; steps_done less the versions a resumed trainer skipped
                v.step = int(m.values.get("steps_done", m.step or v.step))
                v.version = int(m.values.get("version", m.step or v.version))
                v.reward = m.values.get("reward_mean", v.reward)
                v.kl = m.values.get("kl", v.kl)
                v.entropy = m.values.get("entropy", v.entropy)
                v.clipfrac = m.values.get("clipfrac", v.clipfrac)
                v.grad_norm = m.values.get("grad_norm", v.grad_norm)
                v.tokens_per_s = m.values.get("tokens_per_s", v.tokens_per_s)
                v.step_s = m.values.get("step_s", v.step_s)
                if "durable_version" in m.values:
                    v.durable_version = int(m.values["durable_version"])
                v.staleness = m.values.get("staleness_mean", v.staleness)
                if "reward_mean" in m.values and self.keep:
                    v.history.append((v.step, m.values["reward_mean"]))
        if self.keep:
            self.records += out
        return out

    def _count_dead_letter(self, r) -> None:
        self.dead_letters += 1
        try:
            letter = decode(r.value, DeadLetter, topic=r.topic, partition=r.partition, offset=r.offset)
        except MessageError as e:
            self.last_dead_letter = str(e)[:300]
            return
        where = f"{letter.topic}:{letter.offset}" if letter.partition < 0 else \
            f"{letter.topic}[{letter.partition}]@{letter.offset}"
        self.last_dead_letter = f"{where}: {letter.error}"[:300]

    def _groups(self) -> list[tuple[str, str]]:
        """The run's (consumer group, topic) pairs."""
        pairs = [(self.names.raas_group(self.workflow), self.names.prompts)]
        for p in self.policies:
            pairs += [(self.names.filter_group(p), self.names.trajectories(p)),
                      (self.names.trainer_group(p), self.names.samples(p))]
        return pairs

    def members(self) -> dict[str, dict[str, list[int]]]:
        """Per consumer group of the run, its live members -> the partitions each owns (empty: unknown).
        After the first group the bus cannot describe (e.g. the broker is down), the rest are not asked:
        each request could wait out its timeout, and a view must not hang for minutes."""
        out, down = {}, False
        for group, _ in self._groups():
            try:
                out[group] = {} if down else {
                    m: [tp.partition for tp in tps] for m, tps in self.admin.group_members(group).items()}
            except BusError:
                out[group], down = {}, True
        return out

    def lags(self) -> dict[tuple[str, str], int | None]:
        """Per (consumer group, topic), the total lag in records from committed offsets (None: unknown,
        e.g. the topic does not exist yet, or the bus did not answer). After the first pair the bus cannot
        answer for, the rest are not asked (each request could wait out its timeout)."""
        out, down = {}, False
        for group, topic in self._groups():
            try:
                out[(group, topic)] = None if down else sum(self.admin.group_lag(group, topic).values())
            except BusError:
                out[(group, topic)], down = None, True
        return out

    def worker_throughput(self, window_s: float = THROUGHPUT_WINDOW_S, now: float | None = None) -> dict[str, float]:
        """Per RaaS worker that ever reported, its generated tokens per second over the last ``window_s`` seconds
        before ``now`` (default: the wall clock), from its ``tokens_total`` counter and the records' timestamps
        (a restarted worker's counter starts again: only the reports since are used). A worker silent for
        ``WORKER_SILENT_S`` seconds, or with fewer than two reports in the window, has 0."""
        now = time.time() if now is None else now
        out = {}
        for worker, series in sorted(self._rollout_tokens.items()):
            recent = [(t, n) for t, n in series if now - t <= window_s]
            restart = max((i for i in range(1, len(recent)) if recent[i][1] < recent[i - 1][1]), default=0)
            recent = recent[restart:]
            out[worker] = 0.0
            if len(recent) >= 2 and now - recent[-1][0] <= WORKER_SILENT_S and recent[-1][0] > recent[0][0]:
                out[worker] = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        return out

    def rollout_throughput(self, window_s: float = THROUGHPUT_WINDOW_S, now: float | None = None) -> float:
        """Generated tokens per second across RaaS workers (the sum of :meth:`worker_throughput`): a worker
        that stopped or died counts 0 once it has been silent ``WORKER_SILENT_S`` seconds."""
        return sum(self.worker_throughput(window_s, now).values())

    def silent_s(self, component: str, now: float | None = None) -> float | None:
        """Seconds since ``component``'s newest metric (by its timestamp; None: it never reported)."""
        m = self.components.get(component)
        return None if m is None else max(0.0, (time.time() if now is None else now) - m.ts)

    def paused_workers(self, window_s: float = 30.0) -> list[str]:
        """RaaS workers whose latest metric (within ``window_s`` seconds) says they are paused."""
        now = time.time()
        return sorted(c for c, m in self.components.items()
                      if m.kind == "raas" and m.values.get("paused") and now - m.ts <= window_s)

    def controlled_workers(self, window_s: float = 30.0) -> dict[str, str]:
        """RaaS workers whose latest metric (within ``window_s`` seconds) says an operator's ``astraflow control``
        holds them: worker -> ``"paused"`` or ``"throttled"`` (``paused`` above is backpressure alone)."""
        now = time.time()
        return {c: "paused" if m.values.get("paused_by_control") else "throttled"
                for c, m in sorted(self.components.items())
                if m.kind == "raas" and now - m.ts <= window_s
                and (m.values.get("paused_by_control") or m.values.get("throttled"))}

    def workers(self, window_s: float = 300.0) -> dict[str, dict[str, float]]:
        """Per RaaS worker reporting within ``window_s`` seconds: its rollout throughput (``tokens_per_s``,
        :meth:`worker_throughput`), the seconds since its newest report (``silent_s``: over ``WORKER_SILENT_S``,
        it is dead or stopped; ``stopped`` 1: its last report said it stopped), its episodes and prompts in flight,
        the mean requests per engine call, and per tool its latency percentiles (seconds), calls and errors, from its
        latest metric
        (:meth:`producers.raas.RaasWorker._maybe_metrics`)."""
        now, out = time.time(), {}
        rates = self.worker_throughput(now=now)
        for c, m in sorted(self.components.items()):
            if m.kind != "raas" or now - m.ts > window_s:
                continue
            out[c] = {"tokens_per_s": rates.get(c, 0.0), "silent_s": max(0.0, now - m.ts),
                      **{k: v for k, v in m.values.items()
                         if k in ("episodes_inflight", "prompts_inflight", "stopped")
                         or k.startswith(("tool.", "engine_batch."))}}
        return out

    def seen(self) -> bool:
        """Whether the run has shown itself: a metric read, or a consumer group with a lag."""
        return bool(self.records) or any(n is not None for n in self.lags().values())

    def snapshot(self) -> dict:
        """The monitor's figures as plain data (``astraflow status --json``)."""
        return {
            "policies": {p: {"step": v.step, "version": v.version, "reward": v.reward, "kl": v.kl,
                             "entropy": v.entropy, "clipfrac": v.clipfrac, "grad_norm": v.grad_norm,
                             "collapse": v.collapse,
                             "train_tokens_per_s": v.tokens_per_s, "staleness": v.staleness,
                             "publish_errors": v.publish_errors, "publish_failing": v.publish_failing,
                             "durable_version": v.durable_version}
                         for p, v in self.views.items()},
            "rollout_tokens_per_s": self.rollout_throughput(),
            "lag": {f"{group} {topic}": n for (group, topic), n in self.lags().items()},
            "members": self.members(),
            "held_by_control": self.controlled_workers(),
            "workers": self.workers(),
            "dead_letters": self.dead_letters,
            "last_dead_letter": self.last_dead_letter,
        }

    def show_live(self) -> None:
        """Show :meth:`table` in the terminal, reading on and refreshing it every second, until Ctrl-C."""
        from rich.live import Live

        try:
            with Live(self.table(), refresh_per_second=1) as live:
                while True:
                    self.poll(1.0)
                    live.update(self.table())
        except KeyboardInterrupt:
            pass

    def table(self, title: str = "") -> Group:
        """Rich tables: per policy step, version, reward, KL, entropy, clip fraction, gradient norm, throughput,
        staleness (a collapse alert as the caption); then lag per group; then
        each group's members, with the RaaS workers an operator's pause or throttle holds; then per RaaS worker
        its episodes in flight and its tools' latency percentiles (:meth:`workers`)."""
        columns = ("policy", "step", "version", "reward", "KL", "entropy", "clipfrac", "grad norm", "train tok/s",
                   "staleness", "publish errors")
        fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
        rows = [[p, str(v.step), str(v.version), fmt(v.reward), fmt(v.kl, "{:.4f}"), fmt(v.entropy, "{:.4f}"),
                 fmt(v.clipfrac, "{:.4f}"), fmt(v.grad_norm, "{:.3g}"), fmt(v.tokens_per_s, "{:.0f}"),
                 fmt(v.staleness, "{:.2f}"), f"[bold red]{v.publish_errors} (durable {v.durable_version})[/]"
                 if v.publish_failing else str(v.publish_errors)] for p, v in self.views.items()]
        collapses = [f"{p}: {v.collapse}" for p, v in self.views.items() if v.collapse]
        caption = "[bold red]" + "; ".join(collapses) + "[/]" if collapses else None
        t = Table(title=title or f"run {self.names.run}", caption=caption)
        for col in columns:
            t.add_column(col, justify="right" if col != "policy" else "left")
        for row in rows:
            t.add_row(*row)
        tall = Table(title=title or f"run {self.names.run}", caption=caption)
        tall.add_column("policy")
        for row in rows:
            tall.add_column(row[0], justify="right")
        for i, col in enumerate(columns[1:], 1):
            tall.add_row(col, *(row[i] for row in rows))
        lag = Table(title=f"rollout {self.rollout_throughput():.0f} tok/s; consumer-group lag")
        for col in ("consumer group", "topic", "lag"):
            lag.add_column(col, justify="right" if col == "lag" else "left")
        for (group, topic), n in self.lags().items():
            lag.add_row(group, topic, "?" if n is None else str(n))
        if self.dead_letters:
            lag.caption = f"[yellow]{self.dead_letters} dead letter(s) on {self.names.deadletter}; newest: " \
                          f"{self.last_dead_letter}[/]"
        members = Table(title="consumer-group members")
        for col in ("consumer group", "member", "partitions", "held by control", "last metric"):
            members.add_column(col)
        held = self.controlled_workers()  # astraflow control's pause or throttle, as the workers report it
        for group, owned in self.members().items():
            for member, parts in sorted(owned.items()):
                c = component_of(member, self.components)
                members.add_row(group, member, ",".join(map(str, parts)) or "-",
                                f"[yellow]{held[c]}[/]" if c in held else "", self._last_metric(c))
        workers = Table(title="rollout workers")
        listed = self.workers()
        tools = sorted({k.split(".")[1] for w in listed.values() for k in w if k.startswith("tool.")})
        for col in ("worker", "tok/s", "last metric", "episodes in flight", "prompts in flight",
                    "requests per engine call", *(f"{tool} p50/p90/p99 s (errors/calls)" for tool in tools)):
            workers.add_column(col, justify="left" if col == "worker" else "right")
        for worker, w in listed.items():
            batch = [v for k, v in w.items() if k.startswith("engine_batch.")]
            cells = [f"{w.get(f'tool.{t}.p50_s', 0):.3f}/{w.get(f'tool.{t}.p90_s', 0):.3f}/"
                     f"{w.get(f'tool.{t}.p99_s', 0):.3f} ({w.get(f'tool.{t}.errors_total', 0):.0f}/"
                     f"{w.get(f'tool.{t}.calls_total', 0):.0f})" for t in tools]
            workers.add_row(worker, f"{w['tokens_per_s']:.0f}", self._last_metric(worker),
                            f"{w.get('episodes_inflight', 0):.0f}", f"{w.get('prompts_inflight', 0):.0f}",
                            f"{max(batch, default=0):.1f}", *cells)
        return Group(WideOrTall(t, tall), lag, members, workers)

    def _last_metric(self, component: str | None) -> str:
        """A table cell: how long ago ``component`` last reported; a RaaS worker silent for ``WORKER_SILENT_S``
        seconds is marked ``SILENT``, one whose last report said it stopped ``stopped``."""
        ago = None if component is None else self.silent_s(component)
        if ago is None:
            return "-"
        if self.components[component].values.get("stopped"):
            return f"stopped {ago:.0f} s ago"
        if self.components[component].kind == "raas" and ago > WORKER_SILENT_S:
            return f"[bold red]SILENT {ago:.0f} s[/]"
        return f"{ago:.0f} s ago"

    def commit(self) -> None:
        """Commit :attr:`read_to` for this monitor's consumer group, on the partitions it still owns (one that
        moved in a rebalance is re-read by its new owner from the last commit); for a follower that must
        resume after what it handled (the tracker), once it has handled every record read.

        Raises:
            topics.bus.BusError: the commit was refused (FatalBusError: the consumer is unusable).
        """
        owned = set(self.consumer.assignment())
        offsets = {tp: offset for tp, offset in self.read_to.items() if tp in owned}
        if offsets:
            self.consumer.commit(offsets)

    def close(self) -> None:
        """Leave the consumer group without committing."""
        self.consumer.close()


def observe_run(section: MetricsSection, seconds: float, wait: bool = False) -> RunMonitor | None:
    """A :class:`RunMonitor` of ``section``'s run (``astraflow status``) that has read its metrics for ``seconds``;
    the caller closes it. A run whose ``metrics`` topic does not exist is said so on stderr, and nothing is read
    or created (a mistyped ``run=`` is not a new run): None, or with ``wait``, once the topic exists.

    Raises:
        topics.bus.BusError: the bus cannot be used.
    """
    bus, metrics = connect(section.bus, section.kafka), TopicNames(section.run).metrics
    admin = bus.admin()
    if metrics not in admin.list_topics():
        print(f"run {section.run!r} has no metrics topic on {section.bus}: not started yet, or another run= / bus=?"
              + (" Waiting for it." if wait else ""), file=sys.stderr, flush=True)
        if not wait:
            return None
        while metrics not in admin.list_topics():
            time.sleep(2.0)
    monitor = RunMonitor(bus, TopicNames(section.run), section.policies, section.workflow)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        monitor.poll(0.5)
    if not monitor.seen():
        print(f"run {section.run!r} has no metrics on {section.bus} yet", file=sys.stderr, flush=True)
    return monitor
