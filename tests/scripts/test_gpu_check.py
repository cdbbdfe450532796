"""scripts/gpu_check.sh's dry run on the CPU (GPU_CHECK_DEVICE=cpu, the small model): every step's code runs as it
would on a lent GPU, so the script a GPU session gets once is known to work before that session."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~80 s on 2 busy cores: the engine, 2 GRPO steps, 1- and 2-rank training, the weights bench
def test_the_gpu_check_dry_run_passes_on_the_cpu(tmp_path):
    env = dict(os.environ, GPU_CHECK_DEVICE="cpu", GPU_CHECK_SMALL="1", OUT=str(tmp_path / "out"),
               GPU_CHECK_TMP=str(tmp_path), OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["ok"], summary["failed"], summary["device"]) == (True, 0, "cpu"), summary
    steps = summary["steps"]
    assert all(steps[s]["status"] == "PASS" for s in ("env", "build", "engine", "trainer", "ranks", "bench")), steps
    assert steps["engine"]["logprob_mae_vs_recompute"] < 1e-4  # the engine's logprobs are the trainer's
    assert steps["ranks"]["two_ranks_torch_max_gap"] < 1e-5  # 2 FSDP2 ranks end with the weights of one
    assert 0.9 < steps["bench"]["sparsity"] < 1.0  # bf16 weights move at lr 1e-6 (fp32 master weights)
