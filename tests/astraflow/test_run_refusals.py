"""What ``astraflow run`` refuses, for real: a weight store it cannot use stops it before anything starts (exit 2,
naming the store), and a ``sampling.max_new_tokens`` that leaves no room for a prompt in the model's context fails
the run at the RaaS worker's start (exit 1, naming the field, the failed run's summary on stdout)."""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml",
                           f"run=refused{uuid.uuid4().hex[:8]}", f"run_dir={tmp_path / 'run'}",
                           f"bus=local://{tmp_path / 'bus'}", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_a_store_that_cannot_be_used_is_refused_before_anything_starts(tmp_path):
    proc = run(tmp_path, "store=file:///proc/astraflow-no-store")  # a directory that cannot be made
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot use store file:///proc/astraflow-no-store" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "logs").exists()  # no component was started


def test_max_new_tokens_past_the_models_context_fails_the_run_naming_the_field(tmp_path):
    proc = run(tmp_path, f"store=file://{tmp_path / 'store'}", "sampling.max_new_tokens=100000")
    assert proc.returncode == 1, proc.stderr[-2000:]
    log = (tmp_path / "run" / "logs" / "raas-0.log").read_text()
    assert "sampling.max_new_tokens=100000: policy actor's model takes 2048 positions" in log, log[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["complete"] is False and "raas-0" in summary["failed"], summary
