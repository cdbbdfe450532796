"""RaaS workers: two share one consumer group; one is SIGKILLed mid-rollout; every prompt
still yields exactly one accepted group downstream (de-duplicated by group_id). A SIGTERMed worker stops
mid-batch within seconds, committing exactly the prompts it wrote groups for. A prompt too long for
the model goes to deadletter and the worker moves past it."""
import json
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
from producers.raas import RaasWorker
from topics.bus import connect, read_topic
from topics.codec import decode
from topics.names import TopicNames
from topics.schemas import DeadLetter, Prompt, TrajectoryGroup

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


def start_worker(config, i, log_dir, *overrides):
    log = open(log_dir / f"raas-{i}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "astraflow", "raas", str(config), *overrides, "--worker-id", str(i)],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_sigkill_mid_rollout_loses_nothing_and_dedupes(tmp_path, bus_url, tiny_model_dir):
    config = write_config(tmp_path, bus_url, tiny_model_dir)
    cfg = load_config(config)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
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


def test_sigterm_mid_batch_stops_within_seconds_and_commits_exactly_the_written_prompts(tmp_path, tiny_model_dir):
    """A batch of 8 prompts x 32 samples of up to 1500 tokens at temperature 20 (EOS is rare) takes tens of
    seconds; SIGTERM after its first group stops the worker within 5 s. The committed prompts are exactly those
    with a group; a second worker then rolls out the rest: one group per prompt, none twice."""
    n_prompts = 16
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: stop{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: local://{tmp_path / 'bus'}
policies:
  actor: {{model: {tiny_model_dir}}}
data: {{sources: [{{name: arith, limit: {n_prompts}}}], n_samples: 32}}
sampling: {{max_new_tokens: 1500, temperature: 20.0}}
raas: {{batch_prompts: 8, max_inflight_groups: 100000}}
""")
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    bus.admin().ensure_run_topics(names, ["actor"], partitions=4)
    assert acquire_run(cfg) == n_prompts
    topic, group = names.trajectories("actor"), names.raas_group("single_turn")
    worker = start_worker(path, 0, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while sum(bus.admin().end_offsets(topic).values()) < 1:
            assert time.monotonic() < deadline, "no group was written"
            assert worker.poll() is None, (tmp_path / "raas-0.log").read_text()[-2000:]
            time.sleep(0.1)
        signalled = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(5) == 0, (tmp_path / "raas-0.log").read_text()[-2000:]
        print(f"stopped {time.monotonic() - signalled:.2f} s after SIGTERM")
    finally:
        if worker.poll() is None:
            worker.kill()
    assert "stopped mid-batch" in (tmp_path / "raas-0.log").read_text()
    written = [g.prompt_id for g in read_all(bus, topic)]
    committed = bus.admin().group_offsets(group, names.prompts)
    prompts = [(r, decode(r.value, Prompt)) for r in read_topic(bus, names.prompts)]
    done = [p.prompt_id for r, p in prompts if r.offset < (committed.get(r.partition) or 0)]
    assert 0 < len(written) < n_prompts and len(set(written)) == len(written)
    assert sorted(done) == sorted(written)

    # The prompts left over, the interrupted one included, are rolled out by the next worker (quickly now).
    worker = start_worker(path, 1, tmp_path, "sampling.max_new_tokens=2", "sampling.temperature=1.0")
    try:
        deadline = time.monotonic() + 120
        while sum(bus.admin().group_lag(group, names.prompts).values()) > 0:
            assert time.monotonic() < deadline, "the rest of the prompts was not rolled out"
            assert worker.poll() is None, (tmp_path / "raas-1.log").read_text()[-2000:]
            time.sleep(0.2)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    assert sorted(g.prompt_id for g in read_all(bus, topic)) == sorted(p.prompt_id for _, p in prompts)


def test_a_prompt_longer_than_the_model_context_is_dead_lettered(tmp_path, tiny_model_dir):
    """The tiny model takes 2048 positions; a 3000-digit operand is 3004 prompt tokens."""
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"a": 1, "b": 2}, {"a": "1" * 3000, "b": 1},
                                                             {"a": 3, "b": 4}, {"a": 5, "b": 6}]))
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: long{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
policies:
  actor: {{model: {tiny_model_dir}}}
data: {{sources: [{{name: {data}, adapter: arith}}], n_samples: 2, max_prompt_chars: null}}
sampling: {{max_new_tokens: 2}}
raas: {{batch_prompts: 4}}
""")
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    bus.admin().ensure_run_topics(names, ["actor"], partitions=2)
    assert acquire_run(cfg) == 4  # no character limit at acquisition: RaaS is the one to refuse it
    worker = RaasWorker(cfg, 0, bus)
    lag = lambda: sum(bus.admin().group_lag(names.raas_group("single_turn"), names.prompts).values())  # noqa: E731
    try:
        deadline = time.monotonic() + 120
        while lag() > 0:
            assert time.monotonic() < deadline, "the worker did not get past the long prompt"
            worker.step()
    finally:
        worker.close()
    assert sorted(g.prompt_id for g in read_all(bus, names.trajectories("actor"))) == \
        sorted(decode(r.value, Prompt).prompt_id for r in read_topic(bus, names.prompts)
               if len(decode(r.value, Prompt).text) < 100)
    [letter] = [decode(r.value, DeadLetter) for r in read_topic(bus, names.deadletter)]
    long_prompt = decode(letter.value, Prompt)
    assert long_prompt.text == "1" * 3000 + "+1=" and letter.topic == names.prompts
    assert letter.consumer_group == names.raas_group("single_turn")
    assert letter.error == (f"prompt {long_prompt.prompt_id} (sums) is 3004 tokens: with sampling.max_new_tokens=2 it "
                            "does not fit policy actor's context of 2048 tokens (max_position_embeddings)")
    assert worker.totals["too_long"] == 1 and worker.totals["prompts"] == 3
