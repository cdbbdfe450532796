"""Prometheus exporter: a run's ``metrics`` topic and consumer-group lag, served at ``/metrics``.

:class:`MetricsExporter` reads ``metrics`` as its own consumer group (``<run>.exporter``, so it never disturbs
the run and several exporters or dashboards can follow the same run), keeps the newest value of every figure
each component reports, and answers each scrape with them through ``prometheus_client`` (a custom collector:
nothing is registered per figure, so a new figure needs no code here). Figures:

* every value of every ``Metric`` record as a gauge ``astraflow_<name>{component, kind, policy}``
  (``reward_mean``, ``kl``, ``entropy``, ``clipfrac``, ``staleness_mean``, ``tokens_per_s``, ``publish_wait_s``,
  RaaS's ``groups_total``, ...); names are sanitised to Prometheus' ``[a-zA-Z0-9_]``, and the staleness
  histogram ``staleness_hist/<k>`` becomes ``astraflow_staleness_hist{..., staleness="<k>"}`` (the newest
  step's, groups per staleness);
* ``astraflow_consumer_lag{group, topic}``: records not yet committed by each of the run's consumer groups
  (the same figures as ``astraflow status``), read at most every ``lag_every_s`` seconds;
* ``astraflow_component_restarts{component}`` from the launcher's ``components.json`` when the run directory
  is on this machine;
* ``astraflow_metric_age_seconds{component}``: seconds since each component's newest record.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from astraflow.monitor import RunMonitor
from topics.bus import Bus, connect
from topics.names import TopicNames

if TYPE_CHECKING:
    from astraflow.config import MetricsSection

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(value_name: str) -> tuple[str, dict[str, str]]:
    """The Prometheus name and extra labels of one ``Metric.values`` key: ``astraflow_`` + the key with every
    character outside ``[a-zA-Z0-9_]`` replaced by ``_``; ``staleness_hist/<k>`` gives
    (``astraflow_staleness_hist``, {"staleness": k})."""
    if value_name.startswith("staleness_hist/"):
        return "astraflow_staleness_hist", {"staleness": value_name.split("/", 1)[1]}
    return "astraflow_" + _INVALID.sub("_", value_name), {}


class MetricsExporter:
    """Follows a run's ``metrics`` and lag for Prometheus.

    Args:
        bus: the run's bus.
        names: the run's topic names.
        policies: the run's policies; workflow: its workflow name (for the lag of its groups).
        run_dir: where the launcher writes ``components.json`` (restarts), or None.
        group: the consumer group (default ``<run>.exporter``).
        lag_every_s: the least seconds between two lag reads (each asks the broker for offsets).
    """

    def __init__(self, bus: Bus, names, policies: list[str], workflow: str, run_dir: Path | None = None,
                 group: str | None = None, lag_every_s: float = 5.0):
        self.monitor = RunMonitor(bus, names, policies, workflow, group=group or f"{names.run}.exporter", keep=False)
        self.run_dir, self.lag_every_s = run_dir, lag_every_s
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, str, str], dict[str, float]] = {}  # (component, kind, policy) -> values
        self._seen: dict[str, float] = {}  # component -> ts of its newest record
        self._lag: dict[tuple[str, str], int] = {}
        self._lag_at = 0.0

    def poll(self, timeout_s: float = 0.5) -> int:
        """Read new records (and the lag when due); returns how many metrics were read."""
        records = self.monitor.poll(timeout_s)
        with self._lock:
            for m in records:
                key = (m.component, m.kind, m.policy or "")
                values = self._latest.setdefault(key, {})
                if any(k.startswith("staleness_hist/") for k in m.values):  # a new step's histogram replaces the last
                    for k in [k for k in values if k.startswith("staleness_hist/")]:
                        del values[k]
                values.update(m.values)
                if m.step is not None:
                    self._latest[key]["step"] = float(m.step)
                self._seen[m.component] = max(self._seen.get(m.component, 0.0), m.ts)
        if time.monotonic() - self._lag_at >= self.lag_every_s:
            self._lag_at = time.monotonic()
            lags = self.monitor.lags()  # None where unknown (no topic yet, the bus away): the last figure stays
            with self._lock:
                self._lag.update({pair: n for pair, n in lags.items() if n is not None})
        return len(records)

    def collect(self) -> Iterator:
        """The prometheus_client collector protocol: one gauge family per figure (called on each scrape)."""
        from prometheus_client.core import GaugeMetricFamily

        families: dict[str, GaugeMetricFamily] = {}

        def family(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            if name not in families:
                families[name] = GaugeMetricFamily(name, doc, labels=labels)
            return families[name]

        with self._lock:
            for (component, kind, policy), values in self._latest.items():
                for key, value in values.items():
                    name, extra = metric_name(key)
                    labels = ["component", "kind", "policy", *extra]
                    family(name, f"AstraFlow {key.split('/')[0]} (newest value per component)", labels) \
                        .add_metric([component, kind, policy, *extra.values()], float(value))
            now = time.time()
            for component, ts in self._seen.items():
                family("astraflow_metric_age_seconds", "seconds since the component's newest metrics record",
                       ["component"]).add_metric([component], max(0.0, now - ts))
            for (group, topic), n in self._lag.items():
                family("astraflow_consumer_lag", "records not yet committed by the consumer group",
                       ["group", "topic"]).add_metric([group, topic], float(n))
        for component, restarts in self._restarts().items():
            family("astraflow_component_restarts", "restarts of the component by its launcher",
                   ["component"]).add_metric([component], float(restarts))
        yield from families.values()

    def _restarts(self) -> dict[str, int]:
        path = self.run_dir / "components.json" if self.run_dir is not None else None
        if path is None or not path.is_file():
            return {}
        try:
            return {name: int(c.get("restarts", 0)) for name, c in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}  # being replaced by the launcher right now: the next scrape reads it

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread (port 0: a free one); returns the port.

        Raises:
            OSError: the address cannot be bound.
        """
        from prometheus_client import start_http_server
        from prometheus_client.core import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        server, _ = start_http_server(port, addr=host, registry=registry)
        return server.server_port

    def close(self) -> None:
        """Leave the consumer group."""
        self.monitor.close()


#: the exporter's port when ``exporter.port`` is unset
DEFAULT_PORT = 9400


class CannotServe(OSError):
    """The exporter's address cannot be bound; the message names it and why."""


def main(section: MetricsSection, stop: threading.Event) -> None:
    """Serve the run's metrics on ``exporter.host``:``exporter.port`` (default :data:`DEFAULT_PORT`) until ``stop``
    is set (``astraflow exporter``).

    Raises:
        CannotServe: the address cannot be bound.
    """
    exp = MetricsExporter(connect(section.bus, section.kafka), TopicNames(section.run), section.policies,
                          section.workflow, run_dir=section.run_dir, lag_every_s=section.exporter.lag_every_s)
    host = section.exporter.host
    port = section.exporter.port if section.exporter.port is not None else DEFAULT_PORT
    try:
        try:
            port = exp.serve(port, host)
        except OSError as e:
            raise CannotServe(f"exporter.port={port} on {host}: cannot serve: {e}") from e
        logging.getLogger("astraflow").info("exporter: serving http://%s:%d/metrics", host, port)
        while not stop.is_set():
            exp.poll(0.5)
    finally:
        exp.close()
