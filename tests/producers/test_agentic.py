"""Agentic rollouts on the RaaS episode scheduler, with the search agent, its tiny model and a real search
server (a subprocess): a server that hangs, answers 500 or garbage, or dies mid-run costs the affected
episodes an error observation and the run goes on; a worker SIGKILLed with 20 or more episodes in flight
loses no prompt and yields one group per prompt (the committed offsets never pass an unfinished prompt)."""
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict

import pytest

from astraflow.config import load_config
from producers.acquisition import acquire_run
from producers.raas import RaasWorker
from topics.bus import connect, read_topic
from topics.codec import decode
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Metric, Prompt, TrajectoryGroup

from tests.producers.test_raas import start_worker


@pytest.fixture(scope="module")
def search_model_dir():
    """The tiny search model (``scripts/make_tiny_search_model.py``), built once and cached."""
    from weights.models import resolve_model
    return resolve_model("tiny-search")


def start_search_server(log_path, *options):
    """``astraflow search-server --port 0 OPTIONS`` as a subprocess; (the process, its URL) once it serves."""
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "astraflow", "search-server", "--port", "0", *options],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while True:
        found = re.search(r"serving (http://\S+)", open(log_path).read())
        if found:
            return proc, found[1]
        assert proc.poll() is None and time.monotonic() < deadline, open(log_path).read()
        time.sleep(0.1)


def write_config(tmp_path, bus_url, model_dir, url, n_prompts, samples, **raas):
    path = tmp_path / "run.yaml"
    raas_items = ", ".join(f"{k}: {v}" for k, v in {"batch_prompts": 8, "max_inflight_groups": 100000, **raas}.items())
    path.write_text(f"""
run: agent{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: {bus_url}
policies:
  actor: {{model: {model_dir}}}
workflow: {{name: search_agent, options: {{max_turns: 2}}}}
tools: {{search: {{url: "{url}", timeout_s: 1.0}}}}
data: {{sources: [{{name: search, limit: {n_prompts}}}], n_samples: {samples}}}
sampling: {{max_new_tokens: 24}}
raas: {{{raas_items}}}
""")
    return path


def groups_of(bus, topic):
    return [decode(r.value, TrajectoryGroup) for r in read_topic(bus, topic)]


def observations(group, tokenizer):
    """The tool answers the samples of ``group`` saw (the text between <result> and </result>)."""
    out = []
    for s in group.samples:
        out += re.findall(r"<result>(.*?)</result>", tokenizer.decode(s.input_ids.tolist()), re.S)
    return out


def status_of(worker):
    """What ``astraflow status`` shows of ``worker`` (its rollout row), once it reported a metric now."""
    from rich.console import Console

    from astraflow.monitor import RunMonitor

    worker._maybe_metrics(every_s=0.0)
    worker.producer.flush()
    monitor = RunMonitor(worker.bus, worker.names, ["actor"], "search_agent")
    try:
        deadline = time.monotonic() + 30
        while worker.id not in monitor.workers():
            assert time.monotonic() < deadline, "the worker's metric did not arrive"
            monitor.poll(0.5)
        console = Console(width=200, record=True)
        console.print(monitor.table())
        assert "search p50/p90/p99 s (errors/calls)" in console.export_text()
        return monitor.snapshot()["workers"][worker.id]
    finally:
        monitor.close()


def test_tool_faults_cost_an_error_observation_and_the_run_goes_on(tmp_path, search_model_dir):
    """A server that hangs (a tenth of the calls), answers 500 or garbage (a fifth each): those episodes see
    ``error: ...`` and finish; then the server is SIGKILLed mid-run, and the rest see ``cannot reach``. Every
    prompt gets its group, and the worker counts each kind of failure."""
    server, url = start_search_server(tmp_path / "search.log", "--hang", "0.1", "--error", "0.2",
                                      "--garbage", "0.2", "--seed", "3")
    n_prompts = 24
    path = write_config(tmp_path, f"local://{tmp_path / 'bus'}", search_model_dir, url, n_prompts, 4, max_episodes=16)
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=2)
    assert acquire_run(cfg.acquisition_section()) == n_prompts
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    topic = names.trajectories("actor")
    lag = lambda: sum(bus.admin().group_lag(names.raas_group("search_agent"), names.prompts).values())  # noqa: E731
    try:
        deadline = time.monotonic() + 180
        # the first half rolled out, and a hung call timed out (else the server's death cuts them all)
        tool = worker.tools["search"]
        while sum(bus.admin().end_offsets(topic).values()) < n_prompts // 2 or not tool.errors["timeout"]:
            assert time.monotonic() < deadline, "the first half of the prompts was not rolled out"
            worker.step()
        shown = status_of(worker)
        assert shown["episodes_inflight"] >= 0 and shown["tool.search.calls_total"] > 0
        assert 0 < shown["tool.search.p50_s"] <= shown["tool.search.p90_s"] <= shown["tool.search.p99_s"]
        server.send_signal(signal.SIGKILL)
        server.wait()
        while lag() > 0 or worker.episodes:
            assert time.monotonic() < deadline, "the run did not go on after the server died"
            worker.step()
        assert all(tool.errors[kind] > 0 for kind in ("timeout", "http", "garbage", "connect")), tool.errors
    finally:
        worker.close()
        if server.poll() is None:
            server.kill()
    groups = groups_of(bus, topic)
    assert sorted({g.prompt_id for g in groups}) == sorted(decode(r.value, Prompt).prompt_id
                                                           for r in read_topic(bus, names.prompts))
    seen = [o for g in groups for o in observations(g, worker.engines["actor"].tokenizer)]
    for phrase in ("timed out after 1.0 s", "HTTP 500", "not the expected JSON", "cannot reach the search server",
                   "the code of "):
        assert any(phrase in o for o in seen), (phrase, seen[:20])
    assert all(len(g.samples) == 4 for g in groups)


@pytest.mark.slow
def test_sigkill_with_20_episodes_in_flight_loses_no_prompt_and_duplicates_no_group(tmp_path, bus_url,
                                                                                     search_model_dir):
    """Tool latency median 0.5 s, p99 3 s: episodes finish out of order. Once the worker reports 20 or more
    episodes in flight and has written groups, it is SIGKILLed. Every prompt below the committed offsets has its
    group (nothing unfinished was committed); a second worker rolls out the rest; each prompt has exactly one
    group id (a prompt rolled out twice wrote the same id, which the serving stage de-duplicates)."""
    server, url = start_search_server(tmp_path / "search.log", "--median-s", "0.5", "--p99-s", "3", "--seed", "1")
    n_prompts = 48
    path = write_config(tmp_path, bus_url, search_model_dir, url, n_prompts, 4, max_episodes=40)
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=2)
    assert acquire_run(cfg.acquisition_section()) == n_prompts
    topic, group = names.trajectories("actor"), names.raas_group("search_agent")
    worker = start_worker(path, 0, tmp_path)
    try:
        deadline, inflight = time.monotonic() + 180, 0
        while inflight < 20 or not sum(bus.admin().end_offsets(topic).values()):
            assert time.monotonic() < deadline, f"never 20 episodes in flight with groups written ({inflight})"
            assert worker.poll() is None, (tmp_path / "raas-0.log").read_text()[-2000:]
            metrics = [decode(r.value, Metric) for r in read_topic(bus, names.metrics)]
            inflight = max([m.values.get("episodes_inflight", 0) for m in metrics if m.component == "raas-0"][-1:],
                           default=0)
            time.sleep(0.3)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        written = {g.prompt_id for g in groups_of(bus, topic)}
        committed = bus.admin().group_offsets(group, names.prompts)
        prompts = [(r, decode(r.value, Prompt)) for r in read_topic(bus, names.prompts)]
        below = [p.prompt_id for r, p in prompts if r.offset < (committed.get(r.partition) or 0)]
        assert set(below) <= written and len(written) < n_prompts
        print(f"killed with {inflight:.0f} episodes in flight: {len(written)} prompts written, {len(below)} "
              f"committed")

        worker = start_worker(path, 1, tmp_path)
        deadline = time.monotonic() + 240
        while sum(bus.admin().group_lag(group, names.prompts).values()) > 0:
            assert time.monotonic() < deadline, "the rest of the prompts was not rolled out"
            assert worker.poll() is None, (tmp_path / "raas-1.log").read_text()[-2000:]
            time.sleep(0.3)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
        server.kill()
    ids = defaultdict(set)
    groups = groups_of(bus, topic)
    for g in groups:
        ids[g.prompt_id].add(g.group_id)
    assert sorted(ids) == sorted(p.prompt_id for _, p in prompts)
    assert all(len(x) == 1 for x in ids.values())
    print(f"{len(groups) - len(ids)} groups written twice (same ids), de-duplicated downstream")
