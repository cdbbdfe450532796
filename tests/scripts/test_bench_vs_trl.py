"""bench_vs_trl's summary of paired runs: every run's figures, the round-by-round ratios and their spread,
and a verdict that says "not met" or "parity" when the runs say so."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_vs_trl import OURS, TRL, report, summarize  # noqa: E402

# 50 steps: reward 0.1, then 1.0 from step 25, then 0.6 for the last 10 (TRL's threshold: 0.6); the 20-step
# moving average first reaches 0.6 at step index 36
LEARNS = [0.1] * 25 + [1.0] * 15 + [0.6] * 10


def rows(dt: float, rewards: list[float] = LEARNS) -> list[dict]:
    """A run's per-step rows, one step every ``dt`` seconds."""
    return [{"t": (i + 1) * dt, "step": i + 1, "reward": r} for i, r in enumerate(rewards)]


def test_a_run_that_never_reaches_the_threshold_is_not_met():
    res = summarize({TRL: [rows(1.0), rows(1.2)], OURS: [rows(0.6), rows(0.6, [0.1] * 50)]})
    assert res["threshold"] == 0.6 and res["reached"] == 1 and res["rounds"] == 2
    assert res["wall_ratio"]["runs"] == [0.6, 0.5] and res["wall_ratio"]["min"] == 0.5
    assert res["time_to_threshold_ratio"]["runs"] == [0.6, None]
    ours = res["systems"][OURS]
    assert ours["time_to_threshold_s"]["runs"] == [22.2, None] and ours["time_to_threshold_s"]["n"] == 1
    assert ours["gain"]["runs"] == [0.5, 0.0] and ours["wall_s"]["max"] == 30.0
    assert res["systems"][TRL]["time_to_threshold_s"]["runs"] == [37.0, 44.4]
    assert res["verdict"] == "equal-step wall time 0.50-0.60x TRL's (faster); time to TRL's final reward: " \
                             "not met in 1 of 2 runs"


def test_a_spread_that_straddles_one_is_parity():
    res = summarize({TRL: [rows(1.0)] * 3, OURS: [rows(0.9), rows(1.1), rows(0.8)]})
    assert res["time_to_threshold_ratio"] == {"runs": [0.9, 1.1, 0.8], "n": 3, "median": 0.9, "min": 0.8,
                                              "max": 1.1}
    assert res["verdict"] == "equal-step wall time 0.80-1.10x TRL's (parity); time to TRL's final reward: " \
                             "0.80-1.10x TRL's (parity)"


def test_the_report_ends_with_every_run_and_the_spread(tmp_path, capsys):
    report({TRL: [rows(1.0), rows(1.2)], OURS: [rows(0.6), rows(0.9)]}, 50, [0, 1], [], tmp_path / "curves.png")
    out = capsys.readouterr().out.splitlines()
    last = json.loads(out[-1])
    assert last["metric"] == "time_to_reward_vs_trl" and last["repeats"] == 2
    assert last["ratio"] == 0.675 and last["ours"] == 27.8 and last["baseline"] == 40.7  # medians
    assert last["time_to_threshold_ratio"]["runs"] == [0.6, 0.75]
    assert last["systems"][OURS]["wall_s"] == {"runs": [30.0, 45.0], "n": 2, "median": 37.5, "min": 30.0,
                                               "max": 45.0}
    assert "| AstraFlow | 37.5 [30.0, 45.0] |" in "\n".join(out)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
