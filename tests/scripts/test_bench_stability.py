"""bench_stability's figures: a run's row from its summary and metrics, the collapsed rule at its boundary, and
the shape of the bench's last JSON line (no runs: the pure functions only)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench_stability import (COLLAPSED_BELOW, EXAMPLES, collapse_alerts,  # noqa: E402
                                     first_policy, is_collapsed, parse_summary, result_line, run_figures,
                                     run_overrides, tail_means)

SUMMARY = {"run": "r", "complete": True, "restarts": 0, "steps": 10, "versions": {"actor": 10},
           "reward_first": 0.2, "reward_last": 0.45, "reward_best": 0.5, "final_over_best": 0.9,
           "dead_letters": 0, "wall_s": 42.5}


def trainer(n: int = 10) -> list[dict]:
    """Trainer rows of steps 1..n: entropy = step, clipfrac = step / 100, no grad_norm."""
    return [{"step": s, "reward_mean": 0.1, "entropy": float(s), "clipfrac": s / 100} for s in range(1, n + 1)]


def test_a_run_row_from_its_summary_and_metrics():
    records = [{"component": "trainer.actor", "kind": "trainer", "policy": "actor", "step": 3,
                "values": {"collapse": 1.0}},
               {"component": "trainer.actor", "kind": "trainer", "policy": "actor", "step": 4,
                "values": {"collapse": 0.0, "reward_mean": 0.3}},
               {"component": "raas.0", "kind": "raas", "policy": None, "step": None, "values": {}}]
    row = run_figures("arith-tiny", 2, SUMMARY, trainer(), records, wall_s=50.0)
    assert row["example"] == "arith-tiny" and row["seed"] == 2 and row["complete"] is True and row["steps"] == 10
    assert (row["reward_first"], row["reward_best"], row["reward_last"]) == (0.2, 0.5, 0.45)
    assert row["final_over_best"] == 0.9 and row["collapsed"] is False  # 0.45 / 0.5 is exactly the boundary
    assert row["gain"] == 0.25 and row["best_gain"] == 0.3
    assert row["wall_s"] == 42.5 and row["collapse_alerts"] == 1
    # last 20% of 10 steps: steps 9 and 10
    assert row["entropy"] == 9.5 and row["clipfrac"] == 0.095 and row["grad_norm"] is None


def test_a_failed_run_is_a_row_not_a_crash():
    row = run_figures("search-tiny", 0, None, [], [], wall_s=3.14159, exit_code=1)
    assert row["complete"] is False and row["exit_code"] == 1 and row["wall_s"] == 3.1
    assert row["reward_last"] is None and row["final_over_best"] is None and row["gain"] is None
    assert row["collapsed"] is None and row["collapse_alerts"] == 0 and row["entropy"] is None
    # a summary that says complete, from a process that exited non-zero, is not complete
    assert run_figures("arith-tiny", 0, SUMMARY, [], [], 1.0, exit_code=1)["complete"] is False
    assert run_figures("arith-tiny", 0, {**SUMMARY, "complete": False}, [], [], 1.0)["complete"] is False


def test_collapsed_below_point_nine():
    assert COLLAPSED_BELOW == 0.9
    assert is_collapsed(0.9) is False and is_collapsed(0.8999) is True and is_collapsed(1.0) is False
    assert is_collapsed(None) is None
    assert run_figures("a", 0, {**SUMMARY, "reward_last": 0.4499, "final_over_best": 0.8998}, [], [], 1.0)["collapsed"]


def test_tail_means_take_the_last_fifth_of_steps_once_each():
    rows = trainer(4) + [{"step": 4, "entropy": 8.0}, {"note": "no step"}]  # step 4 redone; 4 // 5 -> 1 step
    assert tail_means(rows) == {"entropy": 8.0, "clipfrac": None, "grad_norm": None}
    assert tail_means([]) == {"entropy": None, "clipfrac": None, "grad_norm": None}
    assert tail_means(list(reversed(trainer(20))), ("entropy",)) == {"entropy": 18.5}  # steps 17..20


def test_collapse_alerts_count_only_collapse_one():
    assert collapse_alerts([{"values": {"collapse": 1}}, {"values": {"collapse": 1.0}}, {"values": {"collapse": 2}},
                            {"values": {}}, {"values": None}, {}]) == 2


def test_summary_is_the_last_stdout_line():
    out = "starting\n" + json.dumps(SUMMARY) + "\n\n"
    assert parse_summary(out) == SUMMARY
    assert parse_summary("") is None and parse_summary("Traceback ...\nValueError: x") is None
    assert parse_summary(json.dumps(SUMMARY) + "\n[1, 2]") is None and parse_summary('{"run": "r"}') is None


def test_overrides_seed_the_data_and_set_the_first_policy_steps():
    assert run_overrides(2, "actor", None, []) == ["seed=2", "data.shuffle_seed=2"]
    assert run_overrides(1, "solver", 10, ["a.b=1"]) == ["seed=1", "data.shuffle_seed=1", "policies.solver.steps=10",
                                                          "a.b=1"]
    assert [first_policy(ex) for ex in EXAMPLES] == ["actor"] * len(EXAMPLES)


def test_the_json_line_shape():
    rows = [run_figures("arith-tiny", 0, SUMMARY, [], [], 1.0),
            run_figures("search-tiny", 0, {**SUMMARY, "reward_last": 0.3, "final_over_best": 0.6}, [], [], 1.0),
            run_figures("arith-tiny", 1, {**SUMMARY, "reward_last": 0.5, "final_over_best": 1.0}, [], [], 1.0),
            run_figures("search-tiny", 1, None, [], [], 1.0, exit_code=1)]
    line = result_line(rows, ["scripts/bench_stability.py", "--quick"], "abc1234", "Linux, nproc 2")
    assert json.loads(json.dumps(line)) == line
    assert line["metric"] == "stability" and line["runs"] == 4 and line["collapsed"] == 1
    assert line["final_over_best"] == [0.9, 0.6, 1.0, None]
    assert line["gain"] == [0.25, 0.1, 0.3, None] and line["best_gain"] == [0.3, 0.3, 0.3, None]
    assert list(line["examples"]) == ["arith-tiny", "search-tiny"]
    arith, search = line["examples"]["arith-tiny"], line["examples"]["search-tiny"]
    assert arith["final_over_best"] == {"runs": [0.9, 1.0], "n": 2, "median": 0.95, "min": 0.9, "max": 1.0}
    assert arith["gain"]["runs"] == [0.25, 0.3] and arith["collapsed"] == 0
    assert search["final_over_best"]["runs"] == [0.6, None] and search["final_over_best"]["n"] == 1
    assert search["collapsed"] == 1
    assert line["per_run"] == rows and line["command"] == ["scripts/bench_stability.py", "--quick"]
    assert line["commit"] == "abc1234" and line["machine"] == "Linux, nproc 2"
