"""A trainer killed with SIGKILL and restarted trains every produced group exactly once, and ends
with the weights an uninterrupted trainer computes from the same batches; the versions it had published
past its checkpoint keep their weights (the checkpoint's weights get the next free version)."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from astraflow.audit import steps_logged
from topics.bus import connect
from topics.codec import decode, encode, headers_for
from topics.names import TopicNames
from topics.bus import read_topic
from topics.schemas import Metric, Sample, TrainedBatch, TrajectoryGroup, WeightAnnouncement
from trainer.checkpoint import load_latest
from trainer.config import TrainerConfig
from trainer.loop import Trainer
from trainer.model import load_causal_lm
from trainer.service import CHECKPOINTS, trained_batches
from weights.codec import state_sha256
from weights.store import WeightStore

ROOT = Path(__file__).resolve().parents[2]


def _group(rng, gid):
    samples = []
    for i in range(2):
        ids = np.r_[[1], rng.integers(5, 60, 5)].astype(np.int32)
        mask = np.array([0, 0, 0, 1, 1, 1], np.uint8)
        samples.append(Sample(input_ids=ids, loss_mask=mask, behavior_logprobs=np.where(mask, -2.0, 0.0),
                              versions=np.where(mask, 0, -1), reward=float(i)))
    return TrajectoryGroup.build(samples=samples, prompt_id=gid, group_id=gid, policy="pol")


TRAINER = {"param_dtype": "float32", "lr": 1e-4}


def _trainer(bus_url, run, model, run_dir):
    """``astraflow trainer`` for policy ``pol`` of a run config (checkpoints in ``run_dir/trainer.pol``)."""
    config = run_dir / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": run, "bus": bus_url, "run_dir": str(run_dir),
        "policies": {"pol": {"model": str(model), "steps": 10, "batch_groups": 1, "checkpoint_every": 4,
                             "max_staleness": 100, "trainer": TRAINER}}}))
    cmd = [sys.executable, "-m", "astraflow", "trainer", str(config), "--policy", "pol"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigkill_and_restart_trains_every_group_exactly_once(bus_url, tiny_model_dir, tmp_path):
    run = f"resume{uuid.uuid4().hex[:8]}"
    names = TopicNames(run)
    bus = connect(bus_url)
    bus.admin().create_topic(names.samples("pol"), partitions=2)
    producer = bus.producer()
    rng = np.random.default_rng(0)
    produced = [f"g{i:02d}" for i in range(10)]
    first_copy: dict[str, TrajectoryGroup] = {}

    def produce(ids):
        for gid in ids:
            g = _group(rng, gid)  # a redelivered duplicate differs in content: training it would show
            first_copy.setdefault(gid, g)
            producer.send(names.samples("pol"), encode(g), key=g.prompt_id, headers=headers_for(g))
        producer.flush()

    produce(produced[:6])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = _trainer(bus_url, run, tiny_model_dir, run_dir)
    deadline = time.monotonic() + 180  # a loaded 2-core machine takes a while to start a trainer
    store = WeightStore((run_dir / "weights").as_uri(), run)
    # 6 groups: 6 steps, past the checkpoint at version 4; kill once version 6 is stored, before the idle
    # checkpoint (poll_timeout_s, 5 s, after the last batch)
    while steps_logged(run_dir, "pol") < 6 or 6 not in store.versions("pol"):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "trainer made no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert load_latest(run_dir / "trainer.pol" / CHECKPOINTS).version == 4  # steps 5 and 6: redone below
    orphaned = {v: {k: store.get(o.key) for k, o in objs.items()} for v, objs in store.versions("pol").items()
                if v > 4}
    assert sorted(orphaned) == [5, 6]

    produce(produced[6:])
    produce(produced[:2])  # redelivered duplicates (e.g. a RaaS worker crashed before its commit)
    # No wait for the killed member's session: static membership hands its partitions back at once,
    # and a trainer waiting for partitions is not idle.
    proc = _trainer(bus_url, run, tiny_model_dir, run_dir)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    run_dir = run_dir / "trainer.pol"
    entries = trained_batches(bus, names, "pol")
    # Versions 5 and 6 were published: the checkpoint's weights (version 4) became version 7 and the 10th
    # step of the lineage is version 13; 5 and 6 keep their objects, byte for byte.
    announced: dict[int, set[str]] = {}
    for r in read_topic(bus, names.weights):
        ann = decode(r.value, WeightAnnouncement)
        announced.setdefault(ann.version, set()).add(ann.sha256)
    assert all(len(shas) == 1 for shas in announced.values()), announced  # no version named two sets of weights
    assert {v: {k: store.get(o.key) for k, o in objs.items()} for v, objs in store.versions("pol").items()
            if v in (5, 6)} == orphaned
    assert summary["version"] == 13, (summary, entries, err[-2000:])
    assert [e.version for e in entries] == [1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13]
    assert entries[4].base_version == 4 and entries[4].group_ids == []
    trained = [gid for e in entries for gid in e.group_ids]
    assert sorted(trained) == produced  # every produced group exactly once, none twice
    # The weights: an uninterrupted trainer fed the same batches in the same order (one thread, as the
    # subprocess) ends bit-for-bit where the killed-and-restarted one did.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = Trainer(TrainerConfig(policy="pol", **TRAINER), tiny_model_dir)
        for e in entries:
            if e.base_version is not None:
                assert reference.version == 4
                reference.renumber(e.version)
                assert announced[e.version] == {state_sha256(reference.publish_state())}  # version 7 is version 4
            else:
                reference.train_step([first_copy[gid] for gid in e.group_ids])
    finally:
        torch.set_num_threads(threads)
    ckpt = load_latest(run_dir / CHECKPOINTS)
    assert ckpt.version == 13 and ckpt.renumbered == [(4, 7)]
    restarted = load_causal_lm(ckpt.model_dir, "float32").state_dict()
    assert state_sha256(restarted) == state_sha256(reference.model.state_dict())
    # per-step metrics went to the metrics topic
    reader = bus.consumer(None)
    reader.assign([(names.metrics, p) for p in range(bus.admin().describe_topic(names.metrics).partitions)])
    reader.seek_to_beginning()
    metrics = []
    for _ in range(40):
        metrics += [decode(r.value, Metric) for r in reader.poll(timeout_s=0.5)]
        if {m.step for m in metrics} >= set(range(1, 7)) | set(range(8, 14)):
            break
    assert {m.step for m in metrics} >= set(range(1, 7)) | set(range(8, 14))
    for key in ("loss", "pg_loss", "kl", "clipfrac", "entropy", "grad_norm", "reward_mean", "reward_std",
                "staleness_mean", "is_ratio_mean", "is_ratio_max", "is_ratio_min", "tokens_per_s", "wait_frac"):
        assert key in metrics[-1].values, key
    assert metrics[-1].component == "trainer.pol" and metrics[-1].kind == "trainer"
    # the committed offsets cover everything consumed
    lag = bus.admin().group_lag(names.trainer_group("pol"), names.samples("pol"))
    assert sum(lag.values()) == 0


def test_trained_batches_leave_out_the_versions_a_resume_renumbered_past(tmp_path):
    # Killed after recording versions 5 and 6 on trained but before their checkpoint was written: the resume
    # from checkpoint 4 renumbered its weights to 7 and redid the steps as 8 and 9.
    bus, names = connect(f"local://{tmp_path / 'bus'}"), TopicNames("lineage")
    bus.admin().create_topic(names.trained, partitions=1, compacted=True)
    producer = bus.producer()
    batches = [TrainedBatch(policy="pol", version=v, group_ids=[f"g{v}"]) for v in range(1, 7)]
    batches += [TrainedBatch(policy="pol", version=7, base_version=4, group_ids=[]),
                TrainedBatch(policy="pol", version=8, group_ids=["g5"]),
                TrainedBatch(policy="pol", version=9, group_ids=["g6"]),
                TrainedBatch(policy="other", version=5, group_ids=["x"])]
    for b in batches:
        producer.send(names.trained, encode(b), key=f"{b.policy}/{b.version}", headers=headers_for(b))
    producer.flush()
    entries = trained_batches(bus, names, "pol")
    assert [(e.version, e.group_ids) for e in entries] == [
        (1, ["g1"]), (2, ["g2"]), (3, ["g3"]), (4, ["g4"]), (7, []), (8, ["g5"]), (9, ["g6"])]
