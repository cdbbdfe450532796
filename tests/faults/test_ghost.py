"""A ghost weight announcement mid-run (version 1000 announced, its object never stored: a crash between
announce and upload, a foreign writer): RaaS keeps rolling out from the newest durable version, and the
run reaches its steps with every group trained once."""
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from run_checks import assert_exactly_once, finish, wait_for_steps

from topics.bus import connect
from topics.codec import encode, headers_for
from topics.names import TopicNames
from topics.schemas import WeightAnnouncement

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


@pytest.mark.slow
def test_a_ghost_announcement_does_not_stop_the_run(tmp_path):
    run, run_dir = f"ghost{uuid.uuid4().hex[:8]}", tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml", f"run={run}", f"run_dir={run_dir}",
         f"policies.actor.steps={STEPS}"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        wait_for_steps(launcher, run_dir, 3, time.monotonic() + 240)
        ghost = WeightAnnouncement(policy="actor", version=1000, kind="full", uri=f"{run_dir.as_uri()}/nowhere",
                                   bytes=1, sha256="0" * 64, sparsity=0.0)
        producer = connect(f"local://{run_dir / 'bus'}").producer()
        producer.send(TopicNames(run).weights, encode(ghost), key="actor", headers=headers_for(ghost))
        producer.flush()
    except BaseException:
        launcher.kill()
        raise
    finish(launcher, run_dir, STEPS, 400)
    assert "version 1000 is announced but not in the store" in (run_dir / "logs" / "raas-0.log").read_text()
    assert_exactly_once(run, run_dir, STEPS)
