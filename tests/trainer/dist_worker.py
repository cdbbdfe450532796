"""Trains a Trainer on fixed synthetic batches; run alone (1 rank) or under torchrun (N ranks).

Usage: ``python dist_worker.py MODEL_DIR OUT RANKS [BACKEND]`` (under ``torchrun --nproc_per_node RANKS``
when RANKS > 1); BACKEND: ``torch`` (the default: FSDP2 on several ranks) or ``deepspeed`` (ZeRO-2). Rank 0 writes ``OUT`` (``torch.save`` of {"weights": name -> float32 tensor, "metrics":
[per-step metrics dicts], "published": [versions]}).
"""
import sys

import numpy as np
import torch

from topics.schemas import Sample, TrajectoryGroup
from trainer.config import TrainerConfig
from trainer.loop import Trainer

#: The config both runs share: float32, 3 micro-batches of 2 in the first mini-batch of 4 and 1 in the
#: second (so on 2 ranks one rank runs a zero-loss filler pass), TIS with a separate π_old forward.
CONFIG = dict(param_dtype="float32", lr=1e-3, mini_batch_size=4, micro_batch_size=2, correction="tis",
              max_grad_norm=1.0)


def batches(steps=3, groups=3):
    """Deterministic synthetic batches: ``steps`` lists of ``groups`` groups of 2 samples (6 tokens)."""
    rng = np.random.default_rng(0)
    out = []
    for s in range(steps):
        gs = []
        for g in range(groups):
            samples = []
            for i in range(2):
                ids = np.r_[[1], rng.integers(5, 60, 5)].astype(np.int32)
                mask = np.array([0, 0, 0, 1, 1, 1], np.uint8)
                samples.append(Sample(input_ids=ids, loss_mask=mask,
                                      behavior_logprobs=np.where(mask, rng.uniform(-4, -1, 6), 0.0),
                                      versions=np.where(mask, s, -1), reward=float(rng.uniform())))
            gid = f"s{s}g{g}"
            gs.append(TrajectoryGroup.build(samples=samples, prompt_id=gid, group_id=gid, policy="pol"))
        out.append(gs)
    return out


class Recorder:
    def __init__(self):
        self.versions, self.state, self.errors, self.durable_version = [], None, [], None
        self.last_publish = {}

    def publish(self, state_dict, version, samples_consumed=None):
        self.versions.append(version)
        self.state = {k: v.float().clone() for k, v in state_dict.items()}


def main(model_dir: str, out: str, ranks: str, backend: str = "torch") -> None:
    torch.set_num_threads(1)
    import os

    rank = int(os.environ.get("RANK", "0"))
    pub = Recorder() if rank == 0 else None
    trainer = Trainer(TrainerConfig(policy="pol", ranks=int(ranks), backend=backend, **CONFIG), model_dir, publisher=pub)
    metrics = [trainer.train_step(b) for b in batches()]
    if rank == 0:
        torch.save({"weights": pub.state, "metrics": metrics, "published": pub.versions}, out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
