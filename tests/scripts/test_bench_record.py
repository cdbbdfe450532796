"""``scripts/bench_record.py`` refuses what would not land as one file of docs/benchmarks/data, before it runs a
bench."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, message", [
    (["../outside", "--", "scripts/bench_async.py"], "NAME '../outside': letters, digits"),
    (["a/b", "--", "scripts/bench_async.py"], "NAME 'a/b': letters, digits"),
    (["async"], "give the bench after --"),
    (["async", "--", "rm", "-rf", "x"], "give the bench after --"),
])
def test_a_bad_name_or_bench_is_refused_and_nothing_runs(argv, message):
    out = subprocess.run([sys.executable, "scripts/bench_record.py", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""
