"""The Prometheus exporter: a run's figures at /metrics over real HTTP, read from the bus as its own consumer
group; in a whole `astraflow run` with `exporter.port` set, live values during the run, among them every figure
the Grafana dashboard (deploy/grafana/astraflow.json) queries."""
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from astraflow.exporter import MetricsExporter, metric_name
from producers.ports import free_port
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Metric

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "astraflow.json"


#: the dashboard's figures that only a trainer's collapse alert carries (trainer/collapse.py: Collapse.values)
COLLAPSE_ALERT_ONLY = {"astraflow_collapse", "astraflow_reward_window", "astraflow_reward_best_window"}


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value} (comments left out)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its query variables."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def served_names(scraped: dict[str, float]) -> set[str]:
    """The metric names of a scrape (:func:`scrape`)."""
    return {key.split("{")[0] for key in scraped}


def test_the_grafana_dashboard_is_a_dashboard_of_prometheus_panels_on_a_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    assert variables["policy"]["datasource"] == ds
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for p in panels:
        g = p["gridPos"]
        assert p["title"] and p["datasource"] == ds and 0 <= g["x"] < g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ds and re.search(r"\bastraflow_\w+", t["expr"]), (p["title"], t)
    queries = " ".join(dashboard_queries(dashboard))
    for figure in ("reward_mean", "kl", "entropy", "clipfrac", "staleness_hist", "consumer_lag", "tokens_total",
                   "component_restarts", "publish_wait_s", "grad_norm", "collapse"):
        assert f"astraflow_{figure}" in queries, figure
    assert queries.count("(") == queries.count(")") and queries.count("{") == queries.count("}")


def test_names_are_sanitised_and_the_staleness_histogram_is_a_label():
    assert metric_name("reward_mean") == ("astraflow_reward_mean", {})
    assert metric_name("version.actor") == ("astraflow_version_actor", {})
    assert metric_name("staleness_hist/3") == ("astraflow_staleness_hist", {"staleness": "3"})


def test_every_figure_on_metrics_is_served_with_lag_and_the_newest_histogram(bus_url, tmp_path):
    names = TopicNames(f"exp{uuid.uuid4().hex[:8]}")
    bus = connect(bus_url)
    ensure_run_topics(bus.admin(), names, ["actor"])
    (tmp_path / "components.json").write_text(json.dumps({"raas-0": {"pid": 1, "exit_code": None, "restarts": 2}}))
    producer = bus.producer()

    def send(m: Metric) -> None:
        producer.send(names.metrics, encode(m), key=m.component, headers=headers_for(m))
        producer.flush()

    exporter = MetricsExporter(bus, names, ["actor"], "single_turn", run_dir=tmp_path, lag_every_s=0.0)
    port = exporter.serve(0)
    try:
        send(Metric(component="trainer.actor", kind="trainer", policy="actor", step=1,
                    values={"reward_mean": 0.25, "kl": 0.01, "staleness_hist/0": 16.0}))
        send(Metric(component="raas-0", kind="raas", values={"groups_total": 32.0}))
        deadline = time.monotonic() + 30
        while 'astraflow_groups_total{component="raas-0",kind="raas",policy=""}' not in scrape(port):
            exporter.poll(0.5)
            assert time.monotonic() < deadline, scrape(port)
        got = scrape(port)
        trainer = 'component="trainer.actor",kind="trainer",policy="actor"'
        assert got[f"astraflow_reward_mean{{{trainer}}}"] == 0.25 and got[f"astraflow_kl{{{trainer}}}"] == 0.01
        assert got[f"astraflow_step{{{trainer}}}"] == 1
        assert got[f'astraflow_staleness_hist{{{trainer},staleness="0"}}'] == 16
        assert got['astraflow_component_restarts{component="raas-0"}'] == 2
        assert f'astraflow_consumer_lag{{group="{names.trainer_group("actor")}",topic="{names.samples("actor")}"}}' in got
        assert 0 <= got['astraflow_metric_age_seconds{component="trainer.actor"}'] < 60
        # the next step: its values replace the last ones, and its histogram the last histogram
        send(Metric(component="trainer.actor", kind="trainer", policy="actor", step=2,
                    values={"reward_mean": 0.5, "staleness_hist/1": 16.0}))
        while scrape(port)[f"astraflow_reward_mean{{{trainer}}}"] != 0.5:
            exporter.poll(0.5)
            assert time.monotonic() < deadline
        got = scrape(port)
        assert f'astraflow_staleness_hist{{{trainer},staleness="0"}}' not in got
        assert got[f'astraflow_staleness_hist{{{trainer},staleness="1"}}'] == 16 and got[f"astraflow_kl{{{trainer}}}"] == 0.01
    finally:
        producer.close()
        exporter.close()


@pytest.mark.slow
def test_a_run_serves_live_metrics_while_it_trains(tmp_path):
    """`exporter.port` set: `astraflow run` starts the exporter as a component; scraped during the run, the
    trainer's reward and step move and the consumer lag is there, and every metric the Grafana dashboard queries
    is served; the exporter stops with the run."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml",
                             f"run=exprun{uuid.uuid4().hex[:8]}", f"run_dir={tmp_path}", "policies.actor.steps=60",
                             f"exporter.port={port}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    # the collapse panel's figures come only with a trainer's collapse alert (tests/astraflow/test_monitor_status.py)
    queried = {name for q in dashboard_queries(json.loads(DASHBOARD.read_text()))
               for name in re.findall(r"\bastraflow_\w+", q)} - COLLAPSE_ALERT_ONLY
    steps, seen, deadline = [], set(), time.monotonic() + 400
    try:
        while (len(set(steps)) < 3 or not queried <= seen) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1.0)
            try:
                got = scrape(port)
            except httpx.HTTPError:
                continue  # not serving yet
            seen |= served_names(got)
            step = got.get('astraflow_step{component="trainer.actor",kind="trainer",policy="actor"}')
            if step is not None:
                steps.append(step)
                assert 0 <= got['astraflow_reward_mean{component="trainer.actor",kind="trainer",policy="actor"}'] <= 1
                assert any(re.match(r'astraflow_consumer_lag\{group=".*trainer\.actor"', k) for k in got), got
        assert len(set(steps)) >= 3, steps  # three different live steps seen
        assert queried <= seen, f"the dashboard queries metrics the exporter never served: {sorted(queried - seen)}"
        out, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    components = json.loads((tmp_path / "components.json").read_text())
    assert components["exporter"]["exit_code"] == 0, components
    assert "serving http://127.0.0.1" in (tmp_path / "logs" / "exporter.log").read_text()
