"""How benches report repetitions: every run, median and spread, and interleaved side-by-side arms."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.spread import describe, interleaved, spread  # noqa: E402


def test_spread_keeps_every_run_and_skips_missing_ones_in_the_figures():
    s = spread([0.9, None, 0.74, 0.97])
    assert s == {"runs": [0.9, None, 0.74, 0.97], "n": 3, "median": 0.9, "min": 0.74, "max": 0.97}
    assert describe(s, ".2f") == "median 0.90 [0.74, 0.97] over 3 (1 without) (0.90, -, 0.74, 0.97)"


def test_spread_of_no_value_is_none():
    s = spread([None, None])
    assert s["n"] == 0 and s["median"] is None and s["min"] is None and s["runs"] == [None, None]
    assert describe(s) == "none over 2 (-, -)"


def test_interleaved_alternates_the_order_each_round():
    assert [a for _, a in interleaved(("A", "B"), 3)] == ["A", "B", "B", "A", "A", "B"]
    assert [r for r, _ in interleaved(("A", "B", "C"), 2)] == [0, 0, 0, 1, 1, 1]
