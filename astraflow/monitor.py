"""Watching a run: metrics from the ``metrics`` topic, rejected records from ``deadletter``, and
consumer-group lag from committed offsets.

Used by the launcher's live view and by ``astraflow status``. It reads the
``metrics`` and ``deadletter`` topics as its own consumer group, so it never disturbs the run.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table

from topics.bus import Bus, BusError, TopicPartition, offsets_after
from topics.codec import MessageError, decode
from topics.names import TopicNames
from topics.schemas import DeadLetter, Metric

@dataclass
class PolicyView:
    """The latest trainer figures of one policy."""

    step: int = 0
    version: int = 0
    reward: float | None = None
    kl: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None  # seconds the newest trainer step took
    staleness: float | None = None
    publish_errors: int = 0  # failed weight publishes so far (the trainer's alerts)
    publish_failing: bool = False
    durable_version: int | None = None  # the newest version stored and announced (from the trainer's metrics)
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, reward mean)


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
        self.consumer = bus.consumer(group or f"monitor.{uuid.uuid4().hex[:8]}")
        self.admin.create_topic(names.deadletter, partitions=4)  # subscribed before any component made it
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
            if m.kind == "trainer" and m.policy in self.views and "publish_errors" in m.values:
                v = self.views[m.policy]
                v.publish_errors = int(m.values["publish_errors"])
                v.publish_failing = bool(m.values.get("publish_failing"))
                v.durable_version = int(m.values.get("durable_version", 0))
            elif m.kind == "trainer" and m.policy in self.views:
                v = self.views[m.policy]
                v.step = m.step or v.step
                v.version = int(m.values.get("version", v.step))
                v.reward = m.values.get("reward_mean", v.reward)
                v.kl = m.values.get("kl", v.kl)
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

    def rollout_throughput(self, window_s: float = 30.0, now: float | None = None) -> float:
        """Generated tokens per second across RaaS workers over the last ``window_s`` seconds before
        ``now`` (default: the wall clock), from their ``tokens_total`` counters and the records'
        timestamps. A worker that reported nothing in the window (stopped, dead) counts 0."""
        now = time.time() if now is None else now
        rate = 0.0
        for series in self._rollout_tokens.values():
            recent = [(t, n) for t, n in series if now - t <= window_s]
            if len(recent) < 2:
                continue
            (t0, n0), (t1, n1) = recent[0], recent[-1]
            rate += (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        return rate

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

    def workers(self, window_s: float = 30.0) -> dict[str, dict[str, float]]:
        """Per RaaS worker reporting within ``window_s`` seconds: its episodes and prompts in flight, the mean
        requests per engine call, and per tool its latency percentiles (seconds), calls and errors, from its
        latest metric (:meth:`producers.raas.RaasWorker._maybe_metrics`)."""
        now, out = time.time(), {}
        for c, m in sorted(self.components.items()):
            if m.kind != "raas" or now - m.ts > window_s:
                continue
            out[c] = {k: v for k, v in m.values.items()
                      if k in ("episodes_inflight", "prompts_inflight") or k.startswith(("tool.", "engine_batch."))}
        return out

    def snapshot(self) -> dict:
        """The monitor's figures as plain data (``astraflow status --json``)."""
        return {
            "policies": {p: {"step": v.step, "version": v.version, "reward": v.reward, "kl": v.kl,
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

    def table(self, title: str = "") -> Group:
        """Rich tables: per policy step, version, reward, KL, throughput, staleness; then lag per group; then
        each group's members, with the RaaS workers an operator's pause or throttle holds; then per RaaS worker
        its episodes in flight and its tools' latency percentiles (:meth:`workers`)."""
        t = Table(title=title or f"run {self.names.run}")
        for col in ("policy", "step", "version", "reward", "KL", "train tok/s", "staleness", "publish errors"):
            t.add_column(col, justify="right" if col != "policy" else "left")
        fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
        for p, v in self.views.items():
            t.add_row(p, str(v.step), str(v.version), fmt(v.reward), fmt(v.kl, "{:.4f}"),
                      fmt(v.tokens_per_s, "{:.0f}"), fmt(v.staleness, "{:.2f}"),
                      f"[bold red]{v.publish_errors} (durable {v.durable_version})[/]" if v.publish_failing
                      else str(v.publish_errors))
        lag = Table(title=f"rollout {self.rollout_throughput():.0f} tok/s; consumer-group lag")
        for col in ("consumer group", "topic", "lag"):
            lag.add_column(col, justify="right" if col == "lag" else "left")
        for (group, topic), n in self.lags().items():
            lag.add_row(group, topic, "?" if n is None else str(n))
        if self.dead_letters:
            lag.caption = f"[yellow]{self.dead_letters} dead letter(s) on {self.names.deadletter}; newest: " \
                          f"{self.last_dead_letter}[/]"
        members = Table(title="consumer-group members")
        for col in ("consumer group", "member", "partitions", "held by control"):
            members.add_column(col)
        held = self.controlled_workers()  # astraflow control's pause or throttle, as the workers report it
        for group, owned in self.members().items():
            for member, parts in sorted(owned.items()):
                members.add_row(group, member, ",".join(map(str, parts)) or "-",
                                f"[yellow]{held[member]}[/]" if member in held else "")
        workers = Table(title="rollout workers")
        tools = sorted({k.split(".")[1] for w in self.workers().values() for k in w if k.startswith("tool.")})
        for col in ("worker", "episodes in flight", "prompts in flight", "requests per engine call",
                    *(f"{tool} p50/p90/p99 s (errors/calls)" for tool in tools)):
            workers.add_column(col, justify="left" if col == "worker" else "right")
        for worker, w in self.workers().items():
            batch = [v for k, v in w.items() if k.startswith("engine_batch.")]
            cells = [f"{w.get(f'tool.{t}.p50_s', 0):.3f}/{w.get(f'tool.{t}.p90_s', 0):.3f}/"
                     f"{w.get(f'tool.{t}.p99_s', 0):.3f} ({w.get(f'tool.{t}.errors_total', 0):.0f}/"
                     f"{w.get(f'tool.{t}.calls_total', 0):.0f})" for t in tools]
            workers.add_row(worker, f"{w.get('episodes_inflight', 0):.0f}", f"{w.get('prompts_inflight', 0):.0f}",
                            f"{max(batch, default=0):.1f}", *cells)
        return Group(t, lag, members, workers)

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

