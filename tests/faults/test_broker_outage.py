"""The broker stopped for 45 s mid-run and started again: the run reaches its steps with no component restarted
(a fenced group member is re-created in place) and no trainer step redone, every prompt RaaS committed has its
group, no group is trained twice, and the run's record (metrics.jsonl, the summary) counts each record once."""
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from run_checks import assert_exactly_once, finish, wait_for_steps

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30


@pytest.mark.slow
def test_a_broker_outage_is_ridden_out(tmp_path, private_broker):
    run, run_dir = f"outage{uuid.uuid4().hex[:8]}", tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml", f"run={run}", f"run_dir={run_dir}",
         f"bus={private_broker.url}", f"policies.actor.steps={STEPS}", "policies.actor.checkpoint_every=5"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(launcher, run_dir, 10, time.monotonic() + 240)
        private_broker.stop()
        time.sleep(45)
        assert launcher.poll() is None, "the launcher gave up during the outage"
        private_broker.start()
    except BaseException:
        launcher.kill()
        raise
    summary, err = finish(launcher, run_dir, STEPS, 600)
    # no component was restarted: acquisition (a producer with no group membership) waited the outage out in place
    # (topics/patience.py), and so did the group members; one fenced by the coordinator after the restart (a static
    # member whose session expired while the broker came back) is re-created in place. Before the trainer's
    # checkpoint commit was retried with patience (NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS right after the
    # restart) and full snapshots had one byte form (a retried publish was refused as other bytes, and the trainer
    # held at that version), the trainer was restarted in 2 of 3 runs; after, 0 restarts of any component in 4.
    components = json.loads((run_dir / "components.json").read_text())
    restarted = [c for c, v in components.items() if v["restarts"]]
    # seen once in CI (raas-0 restarted, cause not found): the restarted components' logs say why
    why = {c: (run_dir / "logs" / f"{c}.log").read_text()[-6000:] for c in restarted}
    assert not restarted, (components, [line for line in err.splitlines() if "restart" in line or "exit" in line], why)
    assert "the bus answers again after" in (run_dir / "logs" / "acquire.log").read_text()
    # the trainer redid no step: it logged each step once
    trained = [json.loads(line)["step"] for line in (run_dir / "trainer.actor" / "metrics.jsonl").open()]
    assert trained == list(range(1, STEPS + 1)), trained
    # the launcher's monitor rejoined its group after the restart and counted no record twice
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = Counter((r["component"], r["step"]) for r in rows if r["step"] is not None)
    assert not [k for k, n in steps.items() if n > 1], sorted(k for k, n in steps.items() if n > 1)[:10]
    assert steps.keys() >= {("trainer.actor", s) for s in trained}
    rewards = [r["values"]["reward_mean"] for r in sorted(rows, key=lambda r: r["step"] or 0)
               if r["component"] == "trainer.actor" and "reward_mean" in r["values"]]
    assert summary["reward_first"] == round(sum(rewards[:STEPS // 5]) / (STEPS // 5), 4), (summary, rewards)

    assert_exactly_once(run, run_dir, STEPS, private_broker.url)
