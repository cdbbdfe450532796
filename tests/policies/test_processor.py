"""The filter stream processor and the curator gate on both bus backends (real broker, real files)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from policies.curators import FilterSolved, Greso
from policies.filters import FilterZeroAdv
from policies.processor import CuratorGate, FilterProcessor
from policy_factories import make_group, make_outcome, make_prompt, read_all
from topics.bus import connect
from topics.codec import decode, encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import DeadLetter, Metric, Prompt, WeightAnnouncement

REPO = Path(__file__).resolve().parents[2]


def _sum_metrics(records, component):
    total: dict[str, float] = {}
    for r in records:
        m = decode(r.value, Metric)
        if m.component == component:
            for k, v in m.values.items():
                total[k] = total.get(k, 0.0) + v
    return total


def test_filter_zero_adv_stream_is_byte_identical(bus_url, run_id):
    bus = connect(bus_url)
    names = TopicNames(run_id)
    ensure_run_topics(bus.admin(), names, ["solver"], partitions=2)
    groups = [make_group(r, prompt_id=f"q{i}") for i, r in
              enumerate([[0, 1, 1], [1, 1, 1], [0, 0, 0], [0.25, 0.5, 0.5], [0, 1, 0], [1, 1, 1]] * 3)]
    sent = {}
    producer = bus.producer()
    for g in groups:
        value, headers = encode(g), headers_for(g, producer_id="raas-test")
        producer.send(names.trajectories("solver"), value, key=g.prompt_id, headers=headers)
        sent[g.group_id] = (value, {k: v.encode() for k, v in headers.items()}, g.prompt_id.encode())
    producer.send(names.trajectories("solver"), b"not a trajectory group", key="bad")
    producer.flush()
    producer.close()

    proc = FilterProcessor(bus, run_id, "solver", [FilterZeroAdv()], max_records=4, poll_timeout_s=0.5,
                           metrics_interval_s=0.0)
    deadline = time.monotonic() + 60
    while proc.totals["consumed"] < len(groups) + 1 and time.monotonic() < deadline:
        proc.step()
    proc.close()

    kept = [g for g in groups if len({s.reward for s in g.samples}) > 1]
    assert proc.totals["kept"] == len(kept) == 9
    assert proc.totals["dropped.zero_adv"] == proc.filters[0].dropped == 9
    out = read_all(bus, names.samples("solver"), len(kept))
    assert sorted(decode(r.value).group_id for r in out) == sorted(g.group_id for g in kept)
    for r in out:
        value, headers, key = sent[decode(r.value).group_id]
        assert r.value == value and r.key == key  # the very bytes RaaS wrote
        assert {k: r.headers[k] for k in headers} == headers
    dead = [decode(r.value, DeadLetter) for r in read_all(bus, names.deadletter, 1)]
    assert [(d.value, d.topic, d.consumer_group) for d in dead] == \
           [(b"not a trajectory group", names.trajectories("solver"), names.filter_group("solver"))]
    totals = _sum_metrics(read_all(bus, names.metrics, 1), "filter.solver.0")
    assert totals["kept"] == 9 and totals["dropped"] == 9 and totals["dropped.zero_adv"] == 9
    assert totals["dead_letter"] == 1 and totals["consumed"] == 19


def test_curator_gate_learns_from_outcomes_and_versions(bus_url, run_id):
    bus = connect(bus_url)
    names = TopicNames(run_id)
    ensure_run_topics(bus.admin(), names, ["solver"], partitions=2)
    greso = Greso(step=0.1, p_easy=0.5)
    gate = CuratorGate(bus, run_id, [FilterSolved(threshold=0.9), greso], policy="solver", metrics_interval_s=60)
    assert gate.submit(make_prompt("a"))
    producer = bus.producer()
    for pid, rewards in (("a", [1, 1, 1, 1]), ("b", [0, 1, 0, 1])):
        o = make_outcome(pid, rewards, version=0)
        producer.send(names.outcomes, encode(o), key=pid, headers=headers_for(o))
    producer.flush()
    applied, deadline = 0, time.monotonic() + 60
    while applied < 2 and time.monotonic() < deadline:
        applied += gate.pump(timeout_s=0.5)
    assert applied == 2
    assert not gate.submit(make_prompt("a"))  # solved: EWMA 1.0 >= 0.9
    assert gate.submit(make_prompt("b"))
    ann = WeightAnnouncement(policy="solver", version=3, kind="full", uri="file:///w/3", bytes=10,
                             sha256="0" * 64, sparsity=0.0)
    producer.send(names.weights, encode(ann), key="solver", headers=headers_for(ann))
    producer.flush()
    producer.close()
    deadline = time.monotonic() + 60
    while gate.version < 3 and time.monotonic() < deadline:
        gate.pump(timeout_s=0.2)
    assert gate.version == 3 and greso.version == 3
    assert greso.p_easy == 0.4  # 1 easy zero-variance of 2 outcomes (0.5) is over target: p_easy - step
    gate.close()
    assert gate.totals == {"submitted": 2, "skipped": 1, "skipped.filter_solved": 1}
    prompts = [decode(r.value, Prompt).prompt_id for r in read_all(bus, names.prompts, 2)]
    assert sorted(prompts) == ["a", "b"]
    assert _sum_metrics(read_all(bus, names.metrics, 1), "curator.solver") == \
           {"submitted": 2.0, "skipped": 1.0, "skipped.filter_solved": 1.0}


def _send_outcomes(bus, names, outcomes) -> None:
    producer = bus.producer()
    for o in outcomes:
        producer.send(names.outcomes, encode(o), key=o.prompt_id, headers=headers_for(o))
    producer.flush()
    producer.close()


def _pump_until(gate, n: int, timeout_s: float = 60.0) -> int:
    applied, deadline = 0, time.monotonic() + timeout_s
    while applied < n and time.monotonic() < deadline:
        applied += gate.pump(timeout_s=0.5)
    return applied


def test_greso_state_survives_a_restart_of_the_gate(bus_url, run_id):
    # A gate learns GRESO streaks from 40 outcomes and adapts p at a new version, saves its state at flush
    # (the compacted state topic) and closes; a new gate with a fresh chain restores the same skip
    # probabilities, p_easy/p_hard, EWMAs and random draws, and applies none of the 40 outcomes again.
    bus = connect(bus_url)
    names = TopicNames(run_id)
    ensure_run_topics(bus.admin(), names, ["solver"], partitions=2)
    chain = [FilterSolved(threshold=0.9), Greso(step=0.1, seed=7)]
    gate = CuratorGate(bus, run_id, chain, policy="solver", metrics_interval_s=60)
    pids = [f"p{i}" for i in range(20)]
    rewards = [[1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1]]
    _send_outcomes(bus, names, [make_outcome(pid, rewards[(i + k) % 3]) for k in range(2) for i, pid in enumerate(pids)])
    assert _pump_until(gate, 40) == 40
    ann = WeightAnnouncement(policy="solver", version=1, kind="full", uri="file:///w/1", bytes=10,
                             sha256="0" * 64, sparsity=0.0)
    producer = bus.producer()
    producer.send(names.weights, encode(ann), key="solver", headers=headers_for(ann))
    producer.flush()
    deadline = time.monotonic() + 60
    while gate.version < 1 and time.monotonic() < deadline:
        gate.pump(timeout_s=0.2)
    for pid in pids[:5]:
        gate.submit(make_prompt(pid))  # GRESO draws from its generator
    gate.close()
    greso = chain[1]
    before = {pid: greso.submit_probability(pid) for pid in pids}
    assert greso.version == 1 and (greso.p_easy, greso.p_hard) == (0.4, 0.4)  # over both targets: p - step
    assert sorted(set(before.values())) == [0.4 ** 2, 0.4, 1.0], before  # streaks of 2, of 1, none

    fresh = [FilterSolved(threshold=0.9), Greso(step=0.1, seed=7)]
    restarted = CuratorGate(bus, run_id, fresh, policy="solver", metrics_interval_s=60)
    try:
        assert {pid: fresh[1].submit_probability(pid) for pid in pids} == before
        assert (fresh[1].p_easy, fresh[1].p_hard, fresh[1].version) == (greso.p_easy, greso.p_hard, 1)
        assert fresh[0].ewma == chain[0].ewma and len(fresh[0].ewma) == 20
        assert fresh[1].rng.random() == greso.rng.random()
        assert _pump_until(restarted, 1, timeout_s=5) == 0  # saved and committed: nothing is applied twice
        assert {pid: fresh[1].submit_probability(pid) for pid in pids} == before
    finally:
        restarted.close()


def test_a_batch_past_its_deadline_names_where_it_hung_and_exits_and_loses_nothing(bus_url, run_id, tmp_path):
    """A filter that never returns: the processor's process writes its stacks (the hung frame named) and exits 1
    once the batch passes ``step_deadline_s``, instead of wedging the run; nothing was committed, so a restarted
    processor (the supervisor's job) passes the group on."""
    (tmp_path / "hang_filter.py").write_text(
        "import time\nfrom policies.base import Filter\n\n"
        "class Hang(Filter):\n    def keep(self, group):\n        time.sleep(3600)\n")
    bus = connect(bus_url)
    names = TopicNames(run_id)
    ensure_run_topics(bus.admin(), names, ["solver"], partitions=2)
    group = make_group([0, 1, 1], prompt_id="q0")
    producer = bus.producer()
    producer.send(names.trajectories("solver"), encode(group), key=group.prompt_id, headers=headers_for(group))
    producer.flush()
    producer.close()

    code = ("import sys; from hang_filter import Hang; from policies.processor import FilterProcessor; "
            "from topics.bus import connect; FilterProcessor(connect(sys.argv[1]), sys.argv[2], 'solver', [Hang()], "
            "poll_timeout_s=0.5, step_deadline_s=3.0).run()")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, bus_url, run_id], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    # it exited at its 3 s deadline (~5-10 s with the interpreter's start-up), not after the filter's 3600 s hang
    assert time.monotonic() - started < 60
    assert "Timeout (0:00:03)!" in done.stderr
    assert 'hang_filter.py", line 6 in keep' in done.stderr  # the hung frame, named

    proc = FilterProcessor(bus, run_id, "solver", [FilterZeroAdv()], poll_timeout_s=0.5, metrics_interval_s=0.0)
    deadline = time.monotonic() + 60
    while proc.totals["consumed"] < 1 and time.monotonic() < deadline:
        proc.step()
    proc.close()
    assert [decode(r.value).group_id for r in read_all(bus, names.samples("solver"), 1)] == [group.group_id]
