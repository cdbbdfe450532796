"""`astraflow replay`: retraining from a recorded `samples.<policy>` reproduces every version's sha256."""
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from consumers.replay import TrainedLogError, read_trained_log, recorded_checksums
from topics.bus import connect
from topics.names import TopicNames
from weights.store import WeightStore

ROOT = Path(__file__).resolve().parents[2]
# A short run: 6 steps of 4 groups x 4 samples.
SMALL = ["policies.actor.steps=6", "policies.actor.batch_groups=4", "data.n_samples=4", "raas.batch_prompts=8",
         "policies.actor.checkpoint_every=4"]


def astraflow(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astraflow", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, COLUMNS="160", OMP_NUM_THREADS="1"))


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_trained_log_errors_name_the_line(tmp_path):
    log = tmp_path / "trained_groups.jsonl"
    log.write_text('{"version": 1, "group_ids": ["a", "b"], "replayed_ids": ["c"]}\n'
                   '{"version": 3, "group_ids": ["d"]}\n')
    with pytest.raises(TrainedLogError, match="line 2: version 3, expected 2"):
        read_trained_log(log)
    log.write_text('{"version": 1, "group_ids": ["a", "b"], "replayed_ids": ["c"]}\nnot json\n')
    with pytest.raises(TrainedLogError, match="line 2: not a"):
        read_trained_log(log)
    log.write_text('{"version": 1, "group_ids": ["a", "b"], "replayed_ids": ["c"]}\n')
    assert [s.group_ids for s in read_trained_log(log)] == [("a", "b", "c")]


def test_bad_input_exits_2(tmp_path):
    from typer.testing import CliRunner

    from astraflow.cli import app

    args = ["replay", str(ROOT / "examples/arith-tiny.yaml"), f"run_dir={tmp_path}"]
    out = CliRunner().invoke(app, [*args, "--policy", "critic"])
    assert out.exit_code == 2 and "unknown policy 'critic'" in out.output
    out = CliRunner().invoke(app, [*args, "--policy", "actor", "--trained-log", str(tmp_path / "nope.jsonl")])
    assert out.exit_code == 2 and "does not exist" in out.output
    out = CliRunner().invoke(app, [*args, "--policy", "actor", "--threads", "0"])
    assert out.exit_code == 2 and "--threads must be >= 1" in out.output


@pytest.mark.slow
def test_replay_reproduces_every_version_bit_for_bit(tmp_path, bus_url):
    run = f"replay{uuid.uuid4().hex[:8]}"
    args = ["examples/arith-tiny.yaml", f"run={run}", f"run_dir={tmp_path}", f"bus={bus_url}", *SMALL]
    assert last_json(astraflow("run", *args))["versions"] == {"actor": 6}

    copy = f"{run}-replayed"
    s = last_json(astraflow("replay", *args, "--policy", "actor", "--publish-as", copy))
    assert s["metric"] == "replay" and s["mode"] == "exact", s
    # Every version matches, but those the original publisher coalesced under load (replaced while
    # still pending, so never announced): exactly the ones its trainer's log names. The last version
    # is always published.
    coalesced = {int(m) for m in re.findall(r"replaces pending (\d+) \(coalesced\)",
                                            (tmp_path / "logs" / "trainer.actor.log").read_text())}
    assert s["versions"] == 6 and s["mismatched"] == [] and set(s["unrecorded"]) == coalesced, s
    assert s["matched"] == 6 - len(coalesced) and 6 not in coalesced, s

    # It read the topic as its own consumer group, and the original trainer's offsets are untouched.
    bus, names = connect(bus_url), TopicNames(run)
    admin = bus.admin()
    ends = admin.end_offsets(names.samples("actor"))
    replayed_upto = admin.group_offsets(s["group"], names.samples("actor"))
    assert s["group"].startswith("replay.actor.") and any(replayed_upto.values())
    assert all((replayed_upto[p] or 0) <= e for p, e in ends.items())
    # The replayed weights were published as a new run, every version with the original's sha256.
    store = tmp_path.joinpath("weights").as_uri()
    original = recorded_checksums(bus, names, "actor", WeightStore(store, run), versions=6)
    published = recorded_checksums(bus, TopicNames(copy), "actor", None, versions=6)
    assert sorted(published) == [1, 2, 3, 4, 5, 6] and len(original) == s["matched"]
    assert all(published[v] == sha for v, sha in original.items())
    assert sorted(WeightStore(store, copy).versions("actor")) == [1, 2, 3, 4, 5, 6]
