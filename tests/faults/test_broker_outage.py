"""The broker stopped for 45 s mid-run and started again: the run reaches its steps with no trainer step redone (the
trainer neither waits on nor dies of its group commits: they do not wait for the broker, and as a dynamic group member
it is rejoined by librdkafka), every prompt RaaS committed has its group, no group is trained twice, and the run's
record (metrics.jsonl, the summary) counts each record once. The stateless components wait the outage out in place;
one that librdkafka made unusable (a static member fenced) exits and is restarted from its group's commits."""
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
    # the trainer was not restarted (a restart would redo the steps after its checkpoint); a stateless component
    # that was restarted says why in its log
    components = json.loads((run_dir / "components.json").read_text())
    restarted = [c for c, v in components.items() if v["restarts"]]
    why = {c: (run_dir / "logs" / f"{c}.log").read_text()[-6000:] for c in restarted}
    assert "trainer.actor" not in restarted, (components, why)
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
