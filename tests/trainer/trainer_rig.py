"""The trainer-service test rig (a test helper): synthetic groups on ``samples.pol``, ``astraflow trainer`` for
policy ``pol`` in a subprocess (one process, or several ranks under torchrun), the versions it announced, and the
plain process a killed-and-resumed trainer is compared with: trained on the recorded lineage in order."""
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
import yaml

from topics.bus import Bus, read_topic
from topics.codec import decode, encode, headers_for
from topics.names import TopicNames
from topics.schemas import Sample, TrainedBatch, TrajectoryGroup, WeightAnnouncement
from trainer.config import TrainerConfig
from trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    """The environment of the rig's subprocesses: one thread each (as the in-process reference), the repository
    importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command line of ``torchrun --standalone --nproc_per_node nproc`` with ``args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]


def synthetic_group(rng: np.random.Generator, gid: str) -> TrajectoryGroup:
    """A group ``gid`` of policy ``pol``: 2 samples of 6 tokens (3 generated on version 0), rewards 0 and 1."""
    samples = []
    for i in range(2):
        ids = np.r_[[1], rng.integers(5, 60, 5)].astype(np.int32)
        mask = np.array([0, 0, 0, 1, 1, 1], np.uint8)
        samples.append(Sample(input_ids=ids, loss_mask=mask, behavior_logprobs=np.where(mask, -2.0, 0.0),
                              versions=np.where(mask, 0, -1), reward=float(i)))
    return TrajectoryGroup.build(samples=samples, prompt_id=gid, group_id=gid, policy="pol")


def produce(bus: Bus, names: TopicNames, groups: Iterable[TrajectoryGroup]) -> None:
    """Send ``groups`` to ``samples.pol`` (created with 2 partitions if missing), keyed by prompt, and flush."""
    bus.admin().create_topic(names.samples("pol"), partitions=2)
    producer = bus.producer()
    try:
        for g in groups:
            producer.send(names.samples("pol"), encode(g), key=g.prompt_id, headers=headers_for(g))
        producer.flush()
    finally:
        producer.close()


def start_trainer(bus_url: str, run: str, model, run_dir: Path, *, steps: int, checkpoint_every: int,
                  trainer: dict, ranks: int = 1) -> subprocess.Popen:
    """``astraflow trainer`` for policy ``pol`` of a run config written to ``run_dir`` (``batch_groups`` 1,
    ``max_staleness`` 100, checkpoints in ``run_dir/trainer.pol``), under torchrun when ``ranks`` > 1 (with
    ``trainer`` settings, plus ``ranks``); stdout and stderr piped, as text."""
    config = run_dir / "run.yaml"
    settings = {**trainer, "ranks": ranks} if ranks > 1 else trainer
    config.write_text(yaml.safe_dump({
        "run": run, "bus": bus_url, "run_dir": str(run_dir),
        "policies": {"pol": {"model": str(model), "steps": steps, "batch_groups": 1, "checkpoint_every": checkpoint_every,
                             "max_staleness": 100, "trainer": settings}}}))
    args = ["-m", "astraflow", "trainer", str(config), "--policy", "pol"]
    cmd = torchrun(ranks, *args) if ranks > 1 else [sys.executable, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def announced(bus: Bus, names: TopicNames) -> dict[int, list[str]]:
    """Each version announced on ``weights`` for ``pol`` -> the sha256 of every announcement of it, in order."""
    out: dict[int, list[str]] = {}
    for record in read_topic(bus, names.weights):
        ann = decode(record.value, WeightAnnouncement)
        if ann.policy == "pol":
            out.setdefault(ann.version, []).append(ann.sha256)
    return out


def replay_lineage(model_dir, trainer: dict, lineage: list[TrainedBatch],
                   groups: dict[str, TrajectoryGroup]) -> Iterator[Trainer]:
    """One plain process (one thread, as the rig's subprocesses) trained on ``lineage``
    (:func:`trainer.service.trained_batches`) in order, renumbering its weights where a resume did; yields the
    trainer after each entry (its weights are what that entry's version must hold)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = Trainer(TrainerConfig(policy="pol", **trainer), model_dir)
        for entry in lineage:
            if entry.base_version is not None:
                assert reference.version == entry.base_version
                reference.renumber(entry.version)
            else:
                reference.train_step([groups[gid] for gid in entry.group_ids])
            yield reference
    finally:
        torch.set_num_threads(threads)
