"""RaaS workers: two share one consumer group; one is SIGKILLed mid-rollout; every prompt
still yields exactly one accepted group downstream (de-duplicated by group_id). A SIGTERMed worker stops
mid-batch within seconds, committing exactly the prompts it wrote groups for. A prompt too long for
the model goes to deadletter and the worker moves past it. Prompts in flight together share one generate
call, writing the groups a rollout per prompt writes; an interrupted one writes and commits nothing. A reward that
raises scores 0.0 and is counted in the worker's metrics. A prompt whose workflow or tool raises is dead-lettered and
the worker goes on; a failed engine call is raised, the prompt left for redelivery. Closing a worker takes tools
with a synchronous or an async close, and one close that raises does not stop the rest."""
import asyncio
import datetime
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict

import numpy as np
import pytest

from astraflow.config import load_config
from producers.acquisition import acquire_run
from producers.raas import RaasWorker
from producers.engine_batcher import EngineCallFailed
from producers.engines import SamplingParams
from producers.rewards import register_reward, reward_errors
from producers.workflows import SingleTurn, gather_episodes, register_workflow
from raas_rig import reported
from topics.bus import connect, read_topic
from topics.codec import decode, encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import DeadLetter, Prompt, RolloutOutcome, TrajectoryGroup

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
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=4)
    assert acquire_run(cfg.acquisition_section()) == N_PROMPTS
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
    """A batch of 8 prompts x 16 samples of up to 1500 tokens at temperature 20 (EOS is rare) takes seconds to
    tens of seconds, in one generate call whose groups are written together at its end; SIGTERM once the first
    batch is committed, in the second batch, stops that batch within 5 s (the time of the worker's "stopped
    mid-batch" line) and drops it whole; the worker then exits 0. The committed prompts are exactly those with a
    group; a second worker then rolls out the rest: one group per prompt, none twice."""
    n_prompts = 16
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: stop{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: local://{tmp_path / 'bus'}
policies:
  actor: {{model: {tiny_model_dir}}}
data: {{sources: [{{name: arith, limit: {n_prompts}}}], n_samples: 16}}
sampling: {{max_new_tokens: 1500, temperature: 20.0}}
raas: {{batch_prompts: 8, max_inflight_groups: 100000}}
""")
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=4)
    assert acquire_run(cfg.acquisition_section()) == n_prompts
    topic, group = names.trajectories("actor"), names.raas_group("single_turn")
    worker = start_worker(path, 0, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while sum(bus.admin().end_offsets(topic).values()) < 1:
            assert time.monotonic() < deadline, "no group was written"
            assert worker.poll() is None, (tmp_path / "raas-0.log").read_text()[-2000:]
            time.sleep(0.1)
        while not any(bus.admin().group_offsets(group, names.prompts).values()):  # the first batch committed
            assert time.monotonic() < deadline, "the first batch was not committed"
            time.sleep(0.05)
        time.sleep(0.5)  # the worker is polling or rolling out its second batch
        signalled = datetime.datetime.now()
        worker.send_signal(signal.SIGTERM)
        # the process exits cleanly; its exit (closing the bus, unloading torch) is bounded loosely: CI's two
        # cores are shared with another test run
        assert worker.wait(30) == 0, (tmp_path / "raas-0.log").read_text()[-2000:]
        print(f"exited {(datetime.datetime.now() - signalled).total_seconds():.2f} s after SIGTERM")
    finally:
        if worker.poll() is None:
            worker.kill()
    log_text = (tmp_path / "raas-0.log").read_text()
    stopped = re.search(r"^(\S+ \S+) raas-0 producers.raas INFO raas-0: stopped mid-batch", log_text, re.M)
    assert stopped, log_text[-2000:]
    # the stop took effect within a decode step: well before the batch (tens of seconds) could have ended
    took = (datetime.datetime.strptime(stopped[1], "%Y-%m-%d %H:%M:%S,%f") - signalled).total_seconds()
    print(f"stopped mid-batch {took:.2f} s after SIGTERM")
    assert took < 5
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
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=2)
    assert acquire_run(cfg.acquisition_section()) == 4  # no character limit at acquisition: RaaS is the one to refuse it
    worker = RaasWorker(cfg.raas_section(), 0, bus)
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


@pytest.mark.parametrize("long_at", [0, 1])
def test_concurrent_prompts_share_one_generate_call_and_an_interrupted_one_writes_and_commits_nothing(tmp_path, tiny_model_dir,
                                                                                          long_at):
    """Four prompts in one partition, the one at ``long_at`` too long for the model. The first tick's generate call
    (the three others' 3 copies each, 9 rows) is interrupted after its prefill: no group is written and nothing is
    committed past the long prompt. First in the partition, it is dead-lettered before the call and committed;
    behind a prompt of the call, it waits for that prompt's group (so the redelivery does not dead-letter it
    twice). The next ticks write, in one call, the groups (and outcomes) that a rollout of each prompt alone makes
    (greedy): one per prompt, one dead letter in all."""
    import threading

    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: batch{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: local://{tmp_path / 'bus'}
policies:
  actor: {{model: {tiny_model_dir}}}
data: {{sources: [{{name: arith, limit: 4}}], n_samples: 3}}
raas: {{batch_prompts: 8}}
""")
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=1)
    texts = ["1+2=", "3+4=", "5+6="]
    texts.insert(long_at, "1" * 3000 + "+1=")
    prompts = [Prompt(prompt_id=f"p{i}", source="test", task_type="arith", text=t, answer=str(eval(t[:-1])),
                      n_samples=3) for i, t in enumerate(texts)]
    producer = bus.producer()
    for p in prompts:
        producer.send(names.prompts, encode(p), key=p.prompt_id, headers=headers_for(p))
    producer.flush()
    group = names.raas_group("single_turn")
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    try:
        worker.sampling = SamplingParams(max_new_tokens=4, temperature=0)
        engine = worker.engines["actor"]
        calls, real = [], engine.generate
        engine.generate = lambda batch, sampling: calls.append(len(batch)) or real(batch, sampling)
        engine.interrupt, forwards = threading.Event(), []

        def interrupt_after_prefill(*_):
            forwards.append(1)
            if len(forwards) == 1:
                engine.interrupt.set()

        hook = engine.model.register_forward_hook(interrupt_after_prefill)
        try:
            assert worker.step() == 0
            deadline = time.monotonic() + 60
            while worker.episodes:  # the call runs on the engine's thread: the ticks until it is interrupted
                assert time.monotonic() < deadline, "the interrupted call did not end"
                assert worker.step() == 0
        finally:
            hook.remove()
        assert calls == [9] and len(forwards) == 1
        assert read_all(bus, names.trajectories("actor")) == [] and read_topic(bus, names.outcomes) == []
        assert len(read_topic(bus, names.deadletter)) == (1 if long_at == 0 else 0)
        assert (bus.admin().group_offsets(group, names.prompts).get(0) or 0) == (1 if long_at == 0 else 0)

        engine.interrupt.clear()
        rolled = worker.step()
        while worker.episodes:
            assert time.monotonic() < deadline + 60, "the rollout did not end"
            rolled += worker.step()
        assert rolled == 3 and calls == [9, 9]
        assert bus.admin().group_offsets(group, names.prompts).get(0) == 4
        written = read_all(bus, names.trajectories("actor"))
        short = [p for p in prompts if len(p.text) < 100]
        assert [g.prompt_id for g in written] == [p.prompt_id for p in short]
        letters = [decode(r.value, DeadLetter) for r in read_topic(bus, names.deadletter)]
        assert [decode(x.value, Prompt).prompt_id for x in letters] == [prompts[long_at].prompt_id]
        outcomes = [decode(r.value, RolloutOutcome) for r in read_topic(bus, names.outcomes)]
        assert [(o.group_id, o.rewards) for o in outcomes] == [(g.group_id, [s.reward for s in g.samples])
                                                                for g in written]
        assert worker.totals["prompts"] == 3 and worker.totals["too_long"] == 1
        for p, g in zip(short, written):
            [alone] = worker.workflow.run(p, worker.engines, worker.sampling)
            assert g.producer_id == "raas-0" and g.group_id == alone.group_id
            assert g.model_dump(exclude={"samples", "created_ts", "producer_id"}) == \
                alone.model_dump(exclude={"samples", "created_ts", "producer_id"})
            for s, t in zip(g.samples, alone.samples, strict=True):
                assert s.input_ids.tolist() == t.input_ids.tolist() and s.reward == t.reward
                assert s.loss_mask.tolist() == t.loss_mask.tolist() and s.versions.tolist() == t.versions.tolist()
                np.testing.assert_allclose(s.behavior_logprobs, t.behavior_logprobs, atol=1e-5)
    finally:
        worker.close()


def small_run(tmp_path, tiny_model_dir, workflow="single_turn"):
    """A run of ``workflow`` on the local bus (tiny model, 2 samples of 2 tokens, one partition) with its topics
    created: (config, topic names, bus)."""
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: small{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: local://{tmp_path / 'bus'}
policies:
  actor: {{model: {tiny_model_dir}}}
workflow: {{name: {workflow}}}
data: {{sources: [{{name: arith, limit: 2}}], n_samples: 2}}
sampling: {{max_new_tokens: 2}}
""")
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=1)
    return cfg, names, bus


def no_gold(prompt: Prompt, completion: str) -> float:
    """A reward with a bug: it raises on every completion."""
    raise LookupError(f"no gold answer for {prompt.prompt_id}")


def test_a_reward_that_raises_scores_zero_and_the_worker_reports_it(tmp_path, tiny_model_dir, caplog):
    reward = f"test_raises_{uuid.uuid4().hex[:8]}"  # a fresh name: test_agentic imports this module again
    register_reward(reward)(no_gold)
    cfg, names, bus = small_run(tmp_path, tiny_model_dir)
    producer = bus.producer()
    for i in range(2):
        p = Prompt(prompt_id=f"p{i}", source="test", task_type="arith", text=f"{i}+1=", answer=str(i + 1),
                   n_samples=2, metadata={"reward": reward})
        producer.send(names.prompts, encode(p), key=p.prompt_id, headers=headers_for(p))
    producer.flush()
    before = sum(reward_errors().values())
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    try:
        rolled, deadline = 0, time.monotonic() + 120
        with caplog.at_level(logging.WARNING, logger="producers.rewards"):
            while rolled < 2:
                assert time.monotonic() < deadline, "the prompts were not rolled out"
                rolled += worker.step()
        shown = reported(worker)
    finally:
        worker.close()
    groups = read_all(bus, names.trajectories("actor"))
    assert sorted(g.prompt_id for g in groups) == ["p0", "p1"]
    assert [s.reward for g in groups for s in g.samples] == [0.0] * 4
    assert shown["reward_errors_total"] == before + 4
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"reward {reward!r} failed on prompt p{i}, scored 0.0: LookupError: no gold answer for p{i}"
        for i in (0, 0, 1, 1)]


class FaultyRollout(SingleTurn):
    """``single_turn``, but a prompt whose metadata names a ``fault`` fails: ``workflow`` raises in the workflow
    once its samples are generated; ``tool`` runs its episodes through the ``probe`` tool (:class:`ResettingTool`,
    which raises) while the others wait a minute on a tool call."""

    async def rollout(self, prompt, engines, sampling, tools):
        fault = prompt.metadata.get("fault")
        if fault == "tool":
            await gather_episodes([tools["probe"](prompt.text),
                                   *(asyncio.sleep(60) for _ in range(prompt.n_samples - 1))])
        groups = await super().rollout(prompt, engines, sampling, tools)
        if fault == "workflow":
            raise ValueError(f"cannot parse the answer of {prompt.prompt_id}")
        return groups


class ResettingTool:
    """A tool that breaks its contract (a failed call is an answer): it raises on every call."""

    async def __call__(self, query: str) -> str:
        raise ConnectionResetError(f"the probe server reset the connection on {query!r}")


def test_a_prompt_whose_workflow_or_tool_raises_is_dead_lettered_and_the_worker_goes_on(tmp_path, tiny_model_dir):
    """Of four prompts in one partition, the workflow raises on the second and a tool on the third: each goes to
    deadletter naming the prompt and the error, is counted, and is committed as handled; the other two are
    written, and nothing of the failed prompts is left running (its sibling episodes are cancelled)."""
    workflow = f"faulty_{uuid.uuid4().hex[:8]}"  # a fresh name: test_agentic imports this module again
    register_workflow(workflow)(FaultyRollout)
    cfg, names, bus = small_run(tmp_path, tiny_model_dir, workflow)
    producer = bus.producer()
    faults = [None, "workflow", "tool", None]
    for i, fault in enumerate(faults):
        p = Prompt(prompt_id=f"p{i}", source="test", task_type="arith", text=f"{i}+1=", answer=str(i + 1),
                   n_samples=2, metadata={"fault": fault} if fault else {})
        producer.send(names.prompts, encode(p), key=p.prompt_id, headers=headers_for(p))
    producer.flush()
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    worker.tools["probe"] = ResettingTool()
    group = names.raas_group(workflow)
    try:
        deadline = time.monotonic() + 120
        while (bus.admin().group_offsets(group, names.prompts).get(0) or 0) < 4:
            assert time.monotonic() < deadline, "the worker did not get past the failing prompts"
            worker.step()
        assert not worker.episodes and not [t for t in asyncio.all_tasks(worker.loop) if not t.done()]
        shown = reported(worker)
    finally:
        worker.close()
    assert sorted(g.prompt_id for g in read_all(bus, names.trajectories("actor"))) == ["p0", "p3"]
    letters = [decode(r.value, DeadLetter) for r in read_topic(bus, names.deadletter)]
    assert [(decode(x.value, Prompt).prompt_id, x.offset, x.topic, x.consumer_group) for x in letters] == [
        ("p1", 1, names.prompts, group), ("p2", 2, names.prompts, group)]
    assert [x.error for x in letters] == [
        f"prompt p1 (test): the rollout of workflow {workflow!r} failed: ValueError: cannot parse the answer of p1",
        f"prompt p2 (test): the rollout of workflow {workflow!r} failed: ConnectionResetError: the probe server "
        "reset the connection on '2+1='"]
    assert worker.totals["rollout_errors"] == 2 and worker.totals["prompts"] == 2
    assert shown["rollout_errors_total"] == 2.0


def test_a_failed_engine_call_is_raised_and_the_prompt_left_for_redelivery(tmp_path, tiny_model_dir):
    """The engine's thread is gone (its executor shut down): the call fails for every prompt in it, which is the
    engine's failure, not a prompt's. The worker raises it (its supervisor restarts it), dead-letters nothing and
    commits nothing."""
    cfg, names, bus = small_run(tmp_path, tiny_model_dir)
    producer = bus.producer()
    p = Prompt(prompt_id="p0", source="test", task_type="arith", text="1+1=", answer="2", n_samples=2)
    producer.send(names.prompts, encode(p), key=p.prompt_id, headers=headers_for(p))
    producer.flush()
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    worker.batchers["actor"].executor.shutdown()
    try:
        deadline = time.monotonic() + 60
        with pytest.raises(EngineCallFailed, match="RuntimeError: cannot schedule new futures after shutdown"):
            while time.monotonic() < deadline:
                worker.step()
    finally:
        worker.close()
    assert read_topic(bus, names.deadletter) == [] and worker.totals["rollout_errors"] == 0
    assert bus.admin().group_offsets(names.raas_group("single_turn"), names.prompts).get(0) is None


class ClosingTool:
    """A tool that echoes its query and records its synchronous close, which raises (a server already gone) with
    ``fails``."""

    def __init__(self, fails: bool = False):
        self.fails, self.closed = fails, False

    async def __call__(self, query: str) -> str:
        return query

    def close(self) -> None:
        self.closed = True
        if self.fails:
            raise ConnectionResetError("the tool's server is gone")


class AsyncClosingTool(ClosingTool):
    """A :class:`ClosingTool` whose close is a coroutine function."""

    async def close(self) -> None:
        await asyncio.sleep(0)
        super().close()


def test_close_takes_sync_and_async_tool_closes_and_one_that_raises_does_not_stop_the_rest(tmp_path, tiny_model_dir,
                                                                                          caplog):
    cfg, names, bus = small_run(tmp_path, tiny_model_dir)
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    tools = {"sync": ClosingTool(), "broken": ClosingTool(fails=True), "async": AsyncClosingTool(),
             "async_broken": AsyncClosingTool(fails=True)}
    worker.tools.update(tools)
    with caplog.at_level(logging.ERROR, logger="producers.raas"):
        worker.close()
    assert {name: t.closed for name, t in tools.items()} == dict.fromkeys(tools, True)
    assert worker.loop.is_closed()
    with pytest.raises(RuntimeError, match="after shutdown"):  # the cleanup after the tools ran too
        worker.batchers["actor"].executor.submit(int)
    assert [(r.getMessage(), str(r.exc_info[1])) for r in caplog.records] == [
        ("raas-0: closing tool broken failed; closing the rest", "the tool's server is gone"),
        ("raas-0: closing tool async_broken failed; closing the rest", "the tool's server is gone")]
