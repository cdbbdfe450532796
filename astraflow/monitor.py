"""Watching a run: metrics from the ``metrics`` topic and consumer-group lag from committed offsets.

Used by the launcher's live view and by ``astraflow status``. It reads the
``metrics`` topic as its own consumer group, so it never disturbs the run.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from rich.table import Table

from topics.bus import Bus, BusError
from topics.codec import MessageError, decode
from topics.names import TopicNames
from topics.schemas import Metric

def raas_group(workflow: str) -> str:
    """Consumer group of the RaaS workers on ``prompts``."""
    return f"raas.{workflow}"


def filter_group(policy: str) -> str:
    """Consumer group of ``policy``'s filter processor on ``trajectories.<policy>``."""
    return f"filter.{policy}"


def trainer_group(policy: str) -> str:
    """Consumer group of ``policy``'s trainer on ``samples.<policy>``."""
    return f"trainer.{policy}"


@dataclass
class PolicyView:
    """The latest trainer figures of one policy."""

    step: int = 0
    version: int = 0
    reward: float | None = None
    kl: float | None = None
    tokens_per_s: float | None = None
    staleness: float | None = None
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, reward mean)


class RunMonitor:
    """Follows a run's ``metrics`` topic and reads its consumer-group lag.

    Args:
        bus: the run's bus.
        names: the run's topic names.
        policies: policy names.
        workflow: the workflow name (its RaaS group is ``raas.<workflow>``).
        group: this monitor's own consumer group (default: a fresh unique one,
            reading the whole topic from the beginning).
    """

    def __init__(self, bus: Bus, names: TopicNames, policies: list[str], workflow: str, group: str | None = None):
        self.bus, self.names, self.policies, self.workflow = bus, names, policies, workflow
        self.admin = bus.admin()
        self.consumer = bus.consumer(group or f"monitor.{uuid.uuid4().hex[:8]}")
        self.consumer.subscribe([names.metrics])
        self.views = {p: PolicyView() for p in policies}
        self.components: dict[str, Metric] = {}
        self.records: list[Metric] = []
        self.rejected = 0
        self._rollout_tokens: list[tuple[float, float]] = []  # (ts, cumulative generated tokens) from RaaS

    def poll(self, timeout_s: float = 0.2) -> list[Metric]:
        """Read new metrics and update the views; returns them (invalid records are counted, not raised)."""
        out = []
        for r in self.consumer.poll(1000, timeout_s):
            try:
                m = decode(r.value, Metric, topic=r.topic, partition=r.partition, offset=r.offset)
            except MessageError:
                self.rejected += 1
                continue
            out.append(m)
            self.components[m.component] = m
            if m.kind == "trainer" and m.policy in self.views:
                v = self.views[m.policy]
                v.step = m.step or v.step
                v.version = int(m.values.get("version", v.step))
                v.reward = m.values.get("reward_mean", v.reward)
                v.kl = m.values.get("kl", v.kl)
                v.tokens_per_s = m.values.get("tokens_per_s", v.tokens_per_s)
                v.staleness = m.values.get("staleness_mean", v.staleness)
                if "reward_mean" in m.values:
                    v.history.append((v.step, m.values["reward_mean"]))
        self.records += out
        return out

    def lags(self) -> dict[str, int]:
        """Per consumer group and topic, the total lag (records) from committed offsets."""
        pairs = [(raas_group(self.workflow), self.names.prompts)]
        for p in self.policies:
            pairs += [(filter_group(p), self.names.trajectories(p)), (trainer_group(p), self.names.samples(p))]
        out = {}
        for group, topic in pairs:
            try:
                out[f"{group} on {topic}"] = sum(self.admin.group_lag(group, topic).values())
            except BusError:
                out[f"{group} on {topic}"] = -1
        return out

    def rollout_throughput(self) -> float:
        """Generated tokens per second across RaaS workers, from their ``tokens_total`` counters."""
        total = sum(m.values.get("tokens_total", 0.0) for c, m in self.components.items() if m.kind == "raas")
        now = time.time()
        self._rollout_tokens.append((now, total))
        self._rollout_tokens = [(t, n) for t, n in self._rollout_tokens if now - t <= 30]
        t0, n0 = self._rollout_tokens[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0

    def table(self, title: str = "") -> Table:
        """A rich table: per policy step, version, reward, KL, throughput, staleness; then the lags."""
        t = Table(title=title or f"run {self.names.run}")
        for col in ("policy", "step", "version", "reward", "KL", "train tok/s", "staleness"):
            t.add_column(col, justify="right" if col != "policy" else "left")
        fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
        for p, v in self.views.items():
            t.add_row(p, str(v.step), str(v.version), fmt(v.reward), fmt(v.kl, "{:.4f}"),
                      fmt(v.tokens_per_s, "{:.0f}"), fmt(v.staleness, "{:.2f}"))
        t.add_section()
        t.add_row("rollout tok/s", f"{self.rollout_throughput():.0f}", "", "", "", "", "")
        for name, lag in self.lags().items():
            t.add_row(f"lag {name}", str(lag), "", "", "", "", "")
        return t

    def close(self) -> None:
        self.consumer.close()

