"""Multi-policy co-training: routing, per-role loss masks and rewards, version coupling, whole runs.

The run-based tests start ``astraflow run`` on the shipped CPU examples (real
processes on the embedded bus) and read the run's topics afterwards.
"""
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from astraflow.audit import audit_run
from producers.engines import SamplingParams
from producers.hf_engine import HFEngine
from producers.rewards import score_many
from producers.workflows import WORKFLOWS, accepts, get_workflow, prompt_ids
from topics.bus import connect, read_topic
from topics.codec import decode, encode, headers_for
from topics.names import TopicNames
from topics.schemas import Prompt, TrajectoryGroup, WeightAnnouncement
from trainer.coupling import VersionBarrier

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, dtype=torch.float32)


def arith(a: int, b: int, g: int = 8) -> Prompt:
    return Prompt(prompt_id=f"p-{a}+{b}", source="test", task_type="arith", text=f"{a}+{b}=", answer=str(a + b),
                  n_samples=g)


def segments(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of mask == 1."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def decode_ids(engine, ids) -> str:
    return engine.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def check_generated_only(s) -> None:
    """Masked tokens are exactly the generated ones: they alone carry a version and a logprob."""
    gen = s.loss_mask == 1
    assert gen.any()
    assert np.all(s.versions[gen] >= 0) and np.all(s.versions[~gen] == -1)
    assert np.all(s.behavior_logprobs[~gen] == 0)


# ---------------------------------------------------------------- workflows on the tiny model


def test_verifier_reward_follows_verdict_correctness(engine):
    wf = get_workflow("solve_verify_retry", verifier_max_new_tokens=2)
    for a, b in ((3, 4), (11, 7), (19, 19)):
        prompt = arith(a, b)
        solver, verifier = wf.run(prompt, {"solver": engine, "verifier": engine}, SAMPLING)
        assert solver.policy == "solver" and verifier.policy == "verifier"
        for s_sol, s_ver in zip(solver.samples, verifier.samples):
            check_generated_only(s_ver)
            (start, end), = segments(s_ver.loss_mask)  # one verdict, at the end
            assert end == len(s_ver.input_ids)
            verdict = decode_ids(engine, s_ver.input_ids[start:end])
            first_start, first_end = segments(s_sol.loss_mask)[0]
            first_answer = decode_ids(engine, s_sol.input_ids[first_start:first_end])
            correct = score_many(prompt, [first_answer])[0] > 0.5
            assert s_ver.reward == float(accepts(verdict) == correct)
            # the verifier saw the problem and the solver's first answer as context
            assert decode_ids(engine, s_ver.input_ids[:start]) == f"{a}+{b}={first_answer}\nCorrect (1/0)? "


def test_plan_execute_critique_roles_masks_and_rewards(engine):
    assert "plan_execute_critique" in WORKFLOWS
    wf = get_workflow("plan_execute_critique", policies={"planner": "p", "executor": "e", "critic": "c"},
                      plan_max_new_tokens=3, critic_max_new_tokens=2)
    prompt = arith(5, 6)
    engine.load_weights({}, version=3)
    planner, executor, critic = wf.run(prompt, {"p": engine, "e": engine, "c": engine}, SAMPLING)
    assert [g.policy for g in (planner, executor, critic)] == ["p", "e", "c"]
    assert all(g.workflow == "plan_execute_critique" and len(g.samples) == 8 for g in (planner, executor, critic))
    assert planner.min_version == executor.max_version == critic.max_version == 3
    plan_prefix = prompt_ids(engine.tokenizer, "5+6=\nPlan: ")
    for sp, se, sc in zip(planner.samples, executor.samples, critic.samples):
        for s in (sp, se, sc):
            check_generated_only(s)
            (start, end), = segments(s.loss_mask)  # each role generated once, at the end of its trajectory
            assert end == len(s.input_ids)
        assert list(sp.input_ids[: len(plan_prefix)]) == plan_prefix
        plan = decode_ids(engine, sp.input_ids[len(plan_prefix):]).strip()
        (e_start, _), = segments(se.loss_mask)
        assert decode_ids(engine, se.input_ids[:e_start]) == f"Plan: {plan}\n5+6="  # the plan is context only
        answer = decode_ids(engine, se.input_ids[e_start:])
        correct = score_many(prompt, [answer])[0]
        assert se.reward == sp.reward == correct  # planner credited with the shared outcome
        (c_start, _), = segments(sc.loss_mask)
        assert decode_ids(engine, sc.input_ids[:c_start]) == f"5+6={answer}\nCorrect (1/0)? "
        verdict = decode_ids(engine, sc.input_ids[c_start:])
        assert sc.reward == float(accepts(verdict) == (correct > 0.5))


# ---------------------------------------------------------------- version barrier on a real bus


def announce(producer, names, policy: str, version: int) -> None:
    ann = WeightAnnouncement(policy=policy, version=version, kind="full", uri=f"file:///x/{policy}/{version}",
                             bytes=1, sha256="0" * 64, sparsity=0.0)
    producer.send(names.weights, encode(ann), key=policy, headers=headers_for(ann))
    producer.flush()


def test_version_barrier_waits_for_every_peer(bus_url):
    names = TopicNames(f"barrier-{uuid.uuid4().hex[:8]}")
    bus = connect(bus_url)
    producer = bus.producer()
    barrier = VersionBarrier(bus, names, {"verifier": 5, "critic": 2})
    try:
        assert barrier.wait(0, poll_s=0.1) is not None  # version 0 needs nobody
        announce(producer, names, "verifier", 1)
        stop = threading.Event()
        threading.Timer(1.0, stop.set).start()
        assert barrier.wait(1, stop, poll_s=0.1) is None  # critic has not announced 1: blocked until stop
        assert barrier.behind(1) == {"critic": 0}

        announce(producer, names, "critic", 1)
        later = threading.Timer(1.0, lambda: [announce(producer, names, p, 2) for p in ("verifier", "critic")])
        later.start()
        waited = barrier.wait(2, poll_s=0.1)
        assert waited is not None and waited >= 0.5
        later.join()
        assert barrier.newest == {"verifier": 2, "critic": 2}
        announce(producer, names, "verifier", 3)
        assert barrier.wait(3, poll_s=0.1) is not None  # critic stops at 2: it holds nobody back past that
        with pytest.raises(ValueError, match="at least one peer"):
            VersionBarrier(bus, names, {})
    finally:
        barrier.close()
        producer.close()


# ---------------------------------------------------------------- whole runs


def run_example(tmp_path: Path, config: str, *overrides: str, timeout_s: float = 240) -> tuple[dict, str]:
    run = f"mp-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(ROOT / "examples" / config),
                           f"run={run}", f"run_dir={tmp_path / run}", *overrides],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary, f"local://{tmp_path / run / 'bus'}"


def read_decoded(bus, topic: str, schema):
    """Every record of ``topic``, decoded, in (partition, offset) order."""
    return [decode(r.value, schema) for r in read_topic(bus, topic)]


@pytest.mark.slow
def test_solver_verifier_run_trains_both_policies_on_their_own_tokens(tmp_path, tiny_model_dir):
    summary, bus_url = run_example(tmp_path, "solver-verifier-tiny.yaml")
    assert summary["versions"] == {"solver": 5, "verifier": 5}  # the example's steps
    bus, names = connect(bus_url), TopicNames(summary["run"])
    tok = HFEngine(tiny_model_dir).tokenizer
    retry = re.compile(r"^\nVerifier: [^\n]*\nTry again: $", re.S)
    for policy in ("solver", "verifier"):
        groups = read_decoded(bus, names.samples(policy), TrajectoryGroup)
        assert len(groups) >= 5 * 4  # at least the five batches of batch_groups=4 it trained on
        for g in groups:
            assert g.policy == policy and g.workflow == "solve_verify_retry"
            for s in g.samples:
                check_generated_only(s)
                segs = segments(s.loss_mask)
                text = lambda a, b: tok.decode(s.input_ids[a:b].tolist(), skip_special_tokens=True)  # noqa: E731
                if policy == "verifier":
                    (start, end), = segs  # the verdict only
                    assert end == len(s.input_ids) and text(0, start).endswith("\nCorrect (1/0)? ")
                else:
                    assert 1 <= len(segs) <= 2  # the answer, and the retried answer after a rejection
                    assert re.fullmatch(r"\d+\+\d+=", text(0, segs[0][0]))
                    if len(segs) == 2:
                        assert retry.match(text(segs[0][1], segs[1][0]))
                        assert segs[1][1] == len(s.input_ids)


def announcement_order_is_lockstep(anns: list[WeightAnnouncement], finals: dict[str, int]) -> None:
    """In log order: when policy p announces v + 1, every other policy q has announced min(v, final_q)."""
    newest = {p: 0 for p in finals}
    for ann in anns:
        for q, v in newest.items():
            if q != ann.policy:
                assert v >= min(ann.version - 1, finals[q]), (ann.policy, ann.version, newest)
        newest[ann.policy] = max(newest[ann.policy], ann.version)


@pytest.mark.slow
def test_barrier_coupling_keeps_trainers_in_lockstep(tmp_path):
    # the verifier needs 3x the groups per step: independent trainers would drift apart
    summary, bus_url = run_example(tmp_path, "solver-verifier-tiny.yaml", "coupling=barrier",
                                   "policies.solver.batch_groups=2", "policies.verifier.batch_groups=6",
                                   "policies.solver.steps=4", "policies.verifier.steps=4")
    assert summary["versions"] == {"solver": 4, "verifier": 4}
    anns = read_decoded(connect(bus_url), TopicNames(summary["run"]).weights, WeightAnnouncement)
    assert sorted({(a.policy, a.version) for a in anns}) == [(p, v) for p in ("solver", "verifier")
                                                              for v in range(1, 5)]
    announcement_order_is_lockstep(anns, {"solver": 4, "verifier": 4})


@pytest.mark.slow
def test_plan_execute_critique_run_completes(tmp_path):
    summary, bus_url = run_example(tmp_path, "plan-execute-critique-tiny.yaml")
    assert summary["versions"] == {"planner": 4, "executor": 4, "critic": 4}
    bus, names = connect(bus_url), TopicNames(summary["run"])
    for policy in ("planner", "executor", "critic"):
        groups = read_decoded(bus, names.samples(policy), TrajectoryGroup)
        assert groups and all(g.policy == policy for g in groups)


def assert_exactly_once(tmp_path: Path, summary: dict, bus_url: str, workflow: str = "solve_verify_retry") -> None:
    """Per policy: each version trained once, no group trained twice, no committed prompt without its group."""
    for policy, steps in summary["versions"].items():
        audit = audit_run(connect(bus_url), TopicNames(summary["run"]), policy, workflow)
        assert audit.versions == list(range(1, steps + 1)), (policy, audit.versions)
        assert not audit.trained_twice and not audit.lost, (policy, audit.trained_twice[:3], audit.lost[:3])
        assert audit.committed_prompts > 0, policy


@pytest.mark.slow
def test_a_finished_policy_holds_no_other_back(tmp_path):
    # The solver's trainer stops at 5; its backlog must not pause rollouts the verifier still needs.
    summary, bus_url = run_example(tmp_path, "solver-verifier-tiny.yaml", "policies.solver.steps=5",
                                   "policies.verifier.steps=15")
    assert summary["complete"] and summary["versions"] == {"solver": 5, "verifier": 15}, summary
    assert_exactly_once(tmp_path, summary, bus_url)


@pytest.mark.slow
def test_a_trainer_at_the_barrier_holds_no_rollout_back(tmp_path):
    # Near-greedy sampling: most verifier groups have equal rewards and filter_zero_adv drops them, so
    # the solver waits at the barrier while its backlog grows; rollouts must go on for the verifier.
    summary, bus_url = run_example(tmp_path, "solver-verifier-tiny.yaml", "coupling=barrier",
                                   "policies.verifier.filters=[{name: filter_zero_adv}]", "sampling.temperature=0.02")
    assert summary["complete"] and summary["versions"] == {"solver": 5, "verifier": 5}, summary
    assert_exactly_once(tmp_path, summary, bus_url)
