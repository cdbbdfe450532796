"""`astraflow replay`: retraining from a recorded `samples.<policy>` reproduces every version's sha256."""
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from astraflow.replay import ReplayError, read_groups, recorded_checksums
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.names import TopicNames
from topics.schemas import Sample, TrajectoryGroup
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


def test_bad_input_exits_2(tmp_path):
    from typer.testing import CliRunner

    from astraflow.cli import app

    args = ["replay", str(ROOT / "examples/arith-tiny.yaml"), f"run_dir={tmp_path}"]
    out = CliRunner().invoke(app, [*args, "--policy", "critic"])
    assert out.exit_code == 2 and "unknown policy 'critic'" in out.output
    out = CliRunner().invoke(app, [*args, "--policy", "actor", "--threads", "0"])
    assert out.exit_code == 2 and "--threads must be >= 1" in out.output


def _group(gid: str, reward: float = 1.0) -> TrajectoryGroup:
    sample = Sample(input_ids=np.array([1, 5, 6], np.int32), loss_mask=np.array([0, 1, 1], np.uint8),
                    behavior_logprobs=np.array([0, -1, -1], np.float32), versions=np.array([-1, 0, 0], np.int32),
                    reward=reward)
    return TrajectoryGroup.build(samples=[sample], prompt_id=f"p-{gid}", group_id=gid, policy="actor")


def test_read_groups_reads_a_transactional_topic_to_its_end_and_commits_what_it_read(bus_url):
    # samples.<policy> is written in transactions (the filter processor): on Kafka each ends in a commit
    # marker the reader never receives; the read still ends, with every committed group and none aborted.
    bus, names = connect(bus_url), TopicNames(f"rg{uuid.uuid4().hex[:8]}")
    topic = names.samples("actor")
    bus.admin().create_topic(topic, partitions=2)
    producer = bus.producer(transactional_id=f"{names.run}.filter.actor.0")
    try:
        for gids, commit in ((["a", "b"], True), (["x"], False), (["c", "a"], True)):
            producer.begin_transaction()
            for i, gid in enumerate(gids):
                g = _group(gid, reward=float(commit and i == 1))  # the second "a" differs from the first
                producer.send(topic, encode(g), key=g.prompt_id, headers=headers_for(g))
            producer.send(topic, b"not a group", key=b"junk")
            producer.flush()
            producer.commit_transaction() if commit else producer.abort_transaction()
    finally:
        producer.close()
    group = f"replay.actor.{uuid.uuid4().hex[:8]}"
    found = read_groups(bus, topic, group, {"a", "c"}, timeout_s=60)
    assert sorted(found) == ["a", "c"] and found["a"].samples[0].reward == 0.0  # the first "a" is kept
    committed = bus.admin().group_offsets(group, topic)
    ends = bus.admin().end_offsets(topic)
    assert sum(o or 0 for o in committed.values()) >= 6 and all((committed[p] or 0) <= e for p, e in ends.items())
    with pytest.raises(ReplayError, match="1 of 2 logged groups"):
        read_groups(bus, topic, group, {"a", "x"}, timeout_s=60)


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
    original = recorded_checksums(bus, names, "actor", WeightStore(store, run))
    published = recorded_checksums(bus, TopicNames(copy), "actor", None)
    assert sorted(published) == [1, 2, 3, 4, 5, 6] and len(original) == s["matched"]
    assert all(published[v] == sha for v, sha in original.items())
    assert sorted(WeightStore(store, copy).versions("actor")) == [1, 2, 3, 4, 5, 6]


def test_a_replay_of_a_run_that_is_not_there_says_so_and_exits_2(tmp_path):
    from typer.testing import CliRunner

    from astraflow.cli import app

    result = CliRunner().invoke(app, ["replay", "examples/arith-tiny.yaml", "run=nosuchrun", f"run_dir={tmp_path}",
                                      "--policy", "actor"])
    assert result.exit_code == 2, result.output
    assert "no run 'nosuchrun' with policy 'actor'" in " ".join(result.output.split())


def test_a_version_the_weights_topic_lacks_takes_its_checksum_from_the_stored_snapshot(tmp_path):
    import torch

    from topics.layout import ensure_run_topics
    from weights.codec import save_full

    bus, names = connect(f"local://{tmp_path / 'bus'}"), TopicNames("gone")
    ensure_run_topics(bus.admin(), names, ["actor"])  # no announcement on weights
    store = WeightStore(tmp_path.joinpath("weights").as_uri(), "gone")
    sha = save_full({"w": torch.arange(6, dtype=torch.bfloat16)}, tmp_path / "full.safetensors", version=3)
    store.put(store.key("actor", 3, "full"), tmp_path / "full.safetensors")
    assert recorded_checksums(bus, names, "actor", store, timeout_s=10) == {3: sha}
