"""The broker stopped for 45 s mid-run and started again: the run reaches its steps, every prompt
RaaS committed has its group, and no group is trained twice."""
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from run_checks import assert_exactly_once, steps_trained

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
        deadline = time.monotonic() + 240
        while steps_trained(run_dir) < 10:
            assert launcher.poll() is None, launcher.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "no training progress"
            time.sleep(0.2)
        private_broker.stop()
        time.sleep(45)
        assert launcher.poll() is None, "the launcher gave up during the outage"
        private_broker.start()
        out, err = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["complete"] and summary["versions"] == {"actor": STEPS}, summary

    assert_exactly_once(run, run_dir, STEPS, private_broker.url)
