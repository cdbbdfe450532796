"""RaaS workers: two share one consumer group; one is SIGKILLed mid-rollout; every prompt
still yields exactly one accepted group downstream (de-duplicated by group_id)."""
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict

import pytest

from astraflow.config import load_config
from producers.acquisition import acquire_run
from topics.bus import connect, read_topic
from topics.codec import decode
from topics.names import TopicNames
from topics.schemas import TrajectoryGroup

N_PROMPTS = 200


def write_config(tmp_path, bus_url, model_dir):
    run = f"raas{uuid.uuid4().hex[:8]}"
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: {run}
run_dir: {tmp_path / 'run'}
bus: {bus_url}
policies:
  actor: {{model: {model_dir}}}
workflow: {{name: single_turn}}
data: {{sources: [{{name: arith, limit: {N_PROMPTS}}}], n_samples: 4}}
sampling: {{max_new_tokens: 4}}
raas: {{batch_prompts: 2, max_inflight_groups: 100000, session_timeout_s: 6}}
""")
    return path


def read_all(bus, topic):
    return [decode(r.value, TrajectoryGroup) for r in read_topic(bus, topic)]


def start_worker(config, i, log_dir):
    log = open(log_dir / f"raas-{i}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "astraflow", "raas", str(config), "--worker-id", str(i)],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_sigkill_mid_rollout_loses_nothing_and_dedupes(tmp_path, bus_url, tiny_model_dir):
    config = write_config(tmp_path, bus_url, tiny_model_dir)
    cfg = load_config(config)
    names, bus = TopicNames(cfg.run), connect(cfg.bus)
    bus.admin().ensure_run_topics(names, ["actor"], partitions=4)
    assert acquire_run(cfg) == N_PROMPTS
    topic = names.trajectories("actor")
    workers = [start_worker(config, i, tmp_path) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while sum(bus.admin().end_offsets(topic).values()) < 2 and time.monotonic() < deadline:
            assert all(w.poll() is None for w in workers), (tmp_path / "raas-0.log").read_text()[-2000:]
            time.sleep(0.2)
        # Kill a worker that is rolling out (it has written groups), mid-run.
        victim = int(sorted(g.producer_id for g in read_all(bus, topic))[0].split("-")[1])
        survivor = 1 - victim
        workers[victim].send_signal(signal.SIGKILL)
        remaining = sum(bus.admin().group_lag(names.raas_group("single_turn"), names.prompts).values())
        assert remaining > 0  # killed mid-run: prompts were left for the survivor
        workers[victim].wait()
        deadline = time.monotonic() + 180
        while sum(bus.admin().group_lag(names.raas_group("single_turn"), names.prompts).values()) > 0:
            assert time.monotonic() < deadline, "prompts were not all processed"
            assert workers[survivor].poll() is None, (tmp_path / f"raas-{survivor}.log").read_text()[-2000:]
            time.sleep(0.5)
        workers[survivor].send_signal(signal.SIGTERM)
        assert workers[survivor].wait(60) == 0
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    groups = read_all(bus, topic)
    by_id = {}
    for g in groups:
        if g.group_id in by_id:  # a redelivered prompt: same group_id, dropped downstream
            assert by_id[g.group_id].prompt_id == g.prompt_id
        by_id[g.group_id] = g
    per_prompt = defaultdict(set)
    for g in by_id.values():
        per_prompt[g.prompt_id].add(g.group_id)
    assert len(per_prompt) == N_PROMPTS
    assert all(len(ids) == 1 for ids in per_prompt.values())
    assert {g.producer_id for g in groups} == {"raas-0", "raas-1"}
    for g in by_id.values():
        assert len(g.samples) == 4 and g.policy == "actor"
        for s in g.samples:
            assert s.loss_mask.sum() >= 1 and (s.versions[s.loss_mask == 1] == 0).all()
