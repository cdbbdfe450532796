"""Training on several ranks (``trainer.ranks``), on the CPU: real torchrun subprocesses, 2 gloo ranks, for each
multi-rank backend: FSDP2 (``backend: torch``) and DeepSpeed ZeRO-2 (``backend: deepspeed``, DeepSpeed's cpu
accelerator). Each is compared with one plain process trained on the same batches."""
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

from astraflow.audit import steps_logged
from topics.bus import connect
from topics.names import TopicNames
from trainer.checkpoint import load_latest
from trainer.config import TrainerConfig
from trainer.distributed import collective_backend
from trainer.loop import Trainer
from trainer.model import load_causal_lm
from trainer.service import CHECKPOINTS, trained_batches
from trainer_rig import ROOT, announced, env, produce, replay_lineage, start_trainer, synthetic_group, torchrun
from weight_tolerance import RESUME_ATOL, WEIGHT_ATOL, weight_gaps

WORKER = Path(__file__).with_name("dist_worker.py")

#: The multi-rank backends, by ``trainer.backend``, and the checkpoint subdirectory each writes.
BACKENDS = pytest.mark.parametrize("backend", ["torch", "deepspeed"], ids=["fsdp2", "deepspeed"])
SHARDED_DIR = {"torch": "dcp", "deepspeed": "deepspeed"}


@pytest.mark.slow
@BACKENDS
def test_two_ranks_end_with_the_weights_of_one(tiny_model_dir, tmp_path, backend):
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    single = subprocess.Popen([sys.executable, str(WORKER), str(tiny_model_dir), str(one), "1"], cwd=ROOT,
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out2 = subprocess.run(torchrun(2, str(WORKER), str(tiny_model_dir), str(two), "2", backend), cwd=ROOT, env=env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    out1 = single.communicate(timeout=600)[0]
    assert single.returncode == 0, out1[-3000:]
    assert out2.returncode == 0, out2.stdout[-5000:]
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    assert a["published"] == b["published"] == [1, 2, 3]  # rank 0 published each version once
    assert b["backend_config"] == b["collective_backend"] == "cpu:gloo"  # the group trainer.distributed names
    init = load_causal_lm(tiny_model_dir, "float32").state_dict()
    assert set(a["weights"]) == set(b["weights"]) == set(init)
    moved = max(float((a["weights"][k] - init[k]).abs().max()) for k in init)
    assert moved > 100 * WEIGHT_ATOL  # training moved the weights far beyond the tolerance
    assert not weight_gaps(a["weights"], b["weights"])
    # metrics are reduced over the ranks: rank 0 reports what one process reports
    for m1, m2 in zip(a["metrics"], b["metrics"]):
        for key in ("loss", "pg_loss", "entropy", "clipfrac", "grad_norm", "is_ratio_mean", "is_ratio_min",
                    "is_ratio_max", "samples", "tokens", "version"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key


def test_collectives_use_the_training_devices_backend():
    """On CUDA the group has nccl for CUDA tensors (the metrics, on the training device) and gloo for CPU ones
    (pickled objects, checkpoints); on the CPU gloo alone. A pure-nccl group has no backend for CPU tensors."""
    assert collective_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert collective_backend(torch.device("cpu")) == "cpu:gloo"


#: micro-batches of 1 sample: each rank trains on one sample of each 2-sample batch
SERVICE_TRAINER = {"param_dtype": "float32", "lr": 1e-3, "micro_batch_size": 1}


def _trainer(bus_url, run, model, run_dir, steps, backend, checkpoint_every=2):
    """``astraflow trainer`` for policy ``pol`` under torchrun on 2 ranks with ``backend``."""
    return start_trainer(bus_url, run, model, run_dir, steps=steps, checkpoint_every=checkpoint_every,
                         trainer={**SERVICE_TRAINER, "backend": backend}, ranks=2)


def _reference(tiny_model_dir, lineage, groups):
    """One plain process's weights after training on ``lineage`` (:func:`trainer.service.trained_batches`)."""
    *_, reference = replay_lineage(tiny_model_dir, SERVICE_TRAINER, lineage, groups)
    return reference.model.state_dict()


@pytest.mark.slow
@BACKENDS
@pytest.mark.parametrize("bus_url", ["local"], indirect=True)
def test_two_rank_service_publishes_each_version_once(bus_url, tiny_model_dir, tmp_path, backend):
    run = f"dist{uuid.uuid4().hex[:8]}"
    names = TopicNames(run)
    bus = connect(bus_url)
    rng = np.random.default_rng(0)
    groups = {f"g{i}": synthetic_group(rng, f"g{i}") for i in range(3)}
    produce(bus, names, groups.values())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = _trainer(bus_url, run, tiny_model_dir, run_dir, steps=3, backend=backend)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-5000:]
    summary = json.loads(out.strip().splitlines()[-1])  # only rank 0 prints one
    assert summary["version"] == 3 and summary["steps_run"] == 3
    assert len([line for line in out.splitlines() if line.startswith("{")]) == 1
    entries = trained_batches(bus, names, "pol")
    assert [e.version for e in entries] == [1, 2, 3]
    assert sorted(gid for e in entries for gid in e.group_ids) == sorted(groups)
    versions = {v: len(shas) for v, shas in announced(bus, names).items() if v > 0}
    assert versions == {1: 1, 2: 1, 3: 1}, versions  # rank 0 alone published, once each
    assert steps_logged(run_dir, "pol") == 3  # one metrics line per step
    assert sum(bus.admin().group_lag(names.trainer_group("pol"), names.samples("pol")).values()) == 0
    # the backend's own checkpoint; its gathered model/ matches one plain process trained on the same batches
    ckpt = load_latest(run_dir / "trainer.pol" / CHECKPOINTS)
    assert ckpt.version == 3 and ckpt.sharded_dir.name == SHARDED_DIR[backend] and ckpt.optimizer == {}
    saved = load_causal_lm(ckpt.model_dir, "float32").state_dict()
    assert not weight_gaps(saved, _reference(tiny_model_dir, entries, groups))


def _child_with_rank(parent: int, rank: int) -> int | None:
    """The pid of ``parent``'s child process whose environment has ``RANK=<rank>`` (a torchrun worker)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("bus_url", ["local"], indirect=True)
@pytest.mark.parametrize("backend, victim_rank", [("torch", 1), ("torch", 0), ("deepspeed", 1)],
                         ids=["fsdp2-rank1", "fsdp2-rank0", "deepspeed-rank1"])
def test_sigkill_of_a_rank_then_resume_trains_nothing_twice(bus_url, tiny_model_dir, tmp_path, backend, victim_rank):
    """A rank (1: a follower; 0: the one on the bus) is SIGKILLed after the checkpoint at version 3; torchrun
    tears the group down. The restarted 2-rank trainer resumes from its backend's checkpoint (model and
    optimizer shards), redoes steps 4.., and ends with every group trained once and the weights of one plain
    process trained on the same batches. Which rank dies matters to the service (rank 0 or a follower), the
    same code for both backends; what the backend changes is the checkpoint resumed, so DeepSpeed runs once
    (both DeepSpeed variants passed 2026-12-02; the fourth cost CI a minute)."""
    run = f"dkill{uuid.uuid4().hex[:8]}"
    names = TopicNames(run)
    bus = connect(bus_url)
    rng = np.random.default_rng(1)
    groups = {f"g{i}": synthetic_group(rng, f"g{i}") for i in range(6)}
    # 4 groups (one a step) before the kill: the trainer then waits at version 4 for data, so the kill lands
    # between the checkpoints at 3 and 6 however slow the machine (with all 6 there, one CI run's DeepSpeed trainer
    # reached 6 while the test looked for the rank to kill); the other 2 come before the restart
    produce(bus, names, list(groups.values())[:4])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = _trainer(bus_url, run, tiny_model_dir, run_dir, steps=6, backend=backend, checkpoint_every=3)
    deadline = time.monotonic() + 300
    while steps_logged(run_dir, "pol") < 4:  # past the checkpoint at version 3, before the next at 6
        assert proc.poll() is None, proc.communicate()[1][-5000:]
        assert time.monotonic() < deadline, "trainer made no progress"
        time.sleep(0.05)
    victim = _child_with_rank(proc.pid, victim_rank)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0  # torchrun reports the lost rank
    killed_at = steps_logged(run_dir, "pol")
    assert killed_at == 4
    assert load_latest(run_dir / "trainer.pol" / CHECKPOINTS).version == 3
    produce(bus, names, list(groups.values())[4:])

    proc = _trainer(bus_url, run, tiny_model_dir, run_dir, steps=6, backend=backend, checkpoint_every=3)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-5000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps_run"] == 3  # resumed at 3: the lineage's steps 4, 5, 6
    entries = trained_batches(bus, names, "pol")
    lineage = [e for e in entries if e.base_version is None]
    assert [e.version for e in lineage[:3]] == [1, 2, 3] and len(lineage) == 6
    renumbered = [e for e in entries if e.base_version is not None]
    if renumbered:  # versions past 3 were published before the kill: the checkpoint's weights took the next number
        (moved,) = renumbered
        assert moved.base_version == 3 and moved.version > 4 and moved.group_ids == []
        assert [e.version for e in lineage[3:]] == [moved.version + 1, moved.version + 2, moved.version + 3]
    else:
        assert [e.version for e in lineage] == list(range(1, 7))
    assert summary["version"] == lineage[-1].version
    assert sorted(gid for e in entries for gid in e.group_ids) == sorted(groups)  # each group once
    assert sum(bus.admin().group_lag(names.trainer_group("pol"), names.samples("pol")).values()) == 0
    ckpt = load_latest(run_dir / "trainer.pol" / CHECKPOINTS)
    assert ckpt.version == lineage[-1].version
    saved = load_causal_lm(ckpt.model_dir, "float32").state_dict()
    # A lost optimizer state, or a group trained twice or skipped, moves every tensor by ~lr (weight_tolerance.py).
    assert not weight_gaps(saved, _reference(tiny_model_dir, entries, groups), atol=RESUME_ATOL)


def test_launcher_starts_a_multi_rank_trainer_under_torchrun(tmp_path):
    from astraflow.launcher.plan import trainer_argv

    config = tmp_path / "run.yaml"
    one = trainer_argv(1, config, ["a=b"], "pol")
    assert one == [sys.executable, "-m", "astraflow", "trainer", str(config), "a=b", "--policy", "pol"]
    assert trainer_argv(4, config, ["a=b"], "pol") == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", *one[1:]]


def test_ranks_without_torchrun_is_an_error(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        Trainer(TrainerConfig(policy="pol", ranks=2, param_dtype="float32"), tiny_model_dir)
    with pytest.raises(ValueError):
        TrainerConfig(ranks=0)
    assert TrainerConfig().ranks == 1
