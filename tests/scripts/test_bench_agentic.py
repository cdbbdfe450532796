"""The agentic bench's parts that need no model: the timed window and CPU share of a run, the time to a reward,
reading a run's metrics and logs, the overrides of each arm, and the process-tree CPU sampler."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_agentic  # noqa: E402
from bench_agentic import (TreeCpu, arm_overrides, interpolate, latency_overrides, log_problems,  # noqa: E402
                           read_metrics, summarise, time_to_reward)


def test_interpolate_is_linear_and_clamped():
    s = [(0.0, 0.0), (2.0, 4.0), (4.0, 4.0)]
    assert interpolate(s, -1.0) == 0.0
    assert interpolate(s, 1.0) == pytest.approx(2.0)
    assert interpolate(s, 3.0) == pytest.approx(4.0)
    assert interpolate(s, 9.0) == 4.0


def test_summarise_times_the_steady_window():
    run = {"ends": {1: 10.0, 2: 12.0, 3: 13.0, 4: 14.0, 5: 15.0}, "groups": {s: 16 for s in range(1, 6)},
           "cpu": [(10.0, 0.0), (15.0, 10.0)]}
    out = summarise(run, warmup=3, n_cores=2, batch_groups=16)
    assert out["window"] == [3, 5]
    assert out["steps_per_s"] == pytest.approx(1.0) and out["trainer_steps_per_s"] == pytest.approx(1.0)
    assert out["short_batches"] == 0
    assert out["cpu_busy"] == pytest.approx(4.0 / (2.0 * 2))  # 4 CPU s (interpolated) over 2 s x 2 cores


def test_summarise_counts_short_batches_as_the_groups_they_trained():
    # a pipeline trainer that gave up waiting trains what it has: 4 and 8 of 16 groups
    run = {"ends": {1: 0.0, 2: 5.0, 3: 10.0}, "groups": {1: 16, 2: 4, 3: 8}, "cpu": []}
    out = summarise(run, warmup=1, n_cores=2, batch_groups=16)
    assert out["trainer_steps_per_s"] == pytest.approx(0.2)
    assert out["steps_per_s"] == pytest.approx(12 / 16 / 10.0) and out["short_batches"] == 2


def test_summarise_a_capped_run_uses_the_steps_it_finished():
    out = summarise({"ends": {1: 0.0, 2: 4.0, 3: 6.0}, "groups": {}, "cpu": []}, warmup=3, n_cores=2, batch_groups=16)
    assert out["window"] == [1, 3] and out["steps_per_s"] == pytest.approx(1 / 3) and out["cpu_busy"] is None
    none = summarise({"ends": {1: 0.0}, "groups": {}, "cpu": []}, warmup=3, n_cores=2, batch_groups=16)
    assert none["window"] is None and none["steps_per_s"] is None


def test_time_to_reward_needs_a_full_window():
    run = {"ends": {s: float(s) for s in range(1, 7)}, "rewards": {1: 1.0, 2: 0.0, 3: 0.0, 4: 1.0, 5: 1.0, 6: 1.0}}
    # trailing means over 3: -, -, 1/3, 1/3, 2/3, 1
    assert time_to_reward(run, 0.6, 3) == (5, 4.0)
    assert time_to_reward(run, 1.5, 3) is None


def test_overrides_per_arm():
    assert latency_overrides(0.0) == ["tools.search.latency.median_s=0.0", "tools.search.latency.p99_s=0.0"]
    assert latency_overrides(0.3)[1] == "tools.search.latency.p99_s=3.0"

    class Args:
        steps, set = 7, ["tools.search.timeout_s=2"]

    lockstep = arm_overrides(Args, "pipeline-1", 0.3, "actor", 8)
    assert "raas.max_episodes=8" in lockstep and "policies.actor.steps=7" in lockstep
    assert lockstep[-1] == "tools.search.timeout_s=2"
    assert not any(o.startswith("raas.max_episodes") for o in arm_overrides(Args, "pipeline", 0.3, "actor", 8))


def test_read_metrics_and_log_problems(tmp_path):
    recs = [
        {"kind": "trainer", "step": 1, "ts": 5.0, "values": {"reward_mean": 0.25, "dropped_stale_total": 0}},
        {"kind": "trainer", "step": 1, "ts": 6.0, "values": {"reward_mean": 0.9}},  # a later record of step 1
        {"kind": "raas", "step": None, "ts": 6.5, "values": {"tool.search.p50_s": 0.3, "engine_batch.actor": 12.0}},
        {"kind": "trainer", "step": 2, "ts": 7.0,
         "values": {"reward_mean": 0.5, "dropped_stale_total": 3, "groups": 3}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = read_metrics(tmp_path / "metrics.jsonl")
    assert out["ends"] == {1: 5.0, 2: 7.0} and out["rewards"] == {1: 0.25, 2: 0.5} and out["groups"] == {2: 3}
    assert out["stale_dropped"] == 3 and out["tool_p50_s"] == 0.3 and out["engine_batch"] == 12.0
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "raas-0.log").write_text("fine\n2026 raas ERROR something broke\nTraceback (most recent call last):\n")
    (logs / "trainer.actor.log").write_text("all good\n")
    assert log_problems(logs) == ["raas-0: 2026 raas ERROR something broke",
                                  "raas-0: Traceback (most recent call last):"]
    assert log_problems(tmp_path / "missing") == []


def test_tree_cpu_counts_a_busy_child_after_it_exits():
    proc = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 1.2: pass"])
    cpu = TreeCpu(proc.pid).start()
    proc.wait()
    time.sleep(bench_agentic.CPU_SAMPLE_S * 2)
    cpu.stop()
    assert cpu.samples[-1][1] >= 0.4
    assert all(b[1] >= a[1] for a, b in zip(cpu.samples, cpu.samples[1:]))


def test_the_trl_arm_runs_on_the_hermes_tokenizer_and_says_why_not_on_the_tag_one(tmp_path):
    """trl_unavailable: None for a model whose chat template TRL can call tools with, else the reason (here: the
    tag model's template, which renders message contents only)."""
    pytest.importorskip("trl", reason="trl is only in the bench profile")
    import importlib.util

    def model_dir(name: str, script: str):
        spec = importlib.util.spec_from_file_location(script, ROOT / "scripts" / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = tmp_path / name
        module.build_tokenizer().save_pretrained(out)
        (out / "config.json").write_text("{}")
        return str(out)

    assert bench_agentic.trl_unavailable(model_dir("hermes", "make_tiny_hermes_model")) is None
    why = bench_agentic.trl_unavailable(model_dir("tag", "make_tiny_model"))
    assert "supports_tool_calling is False" in why and why.endswith("tag's")
