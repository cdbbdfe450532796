"""Trains a Trainer on fixed synthetic batches; run alone (1 rank) or under torchrun (N ranks).

Usage: ``python dist_worker.py MODEL_DIR OUT RANKS [BACKEND [EXAMPLE]]`` (under ``torchrun --nproc_per_node RANKS``
when RANKS > 1); BACKEND: ``torch`` (the default: FSDP2 on several ranks) or ``deepspeed`` (ZeRO-2); EXAMPLE: a
GPU example's YAML whose trainer settings are trained (:func:`example_trainer`) instead of :data:`CONFIG`. Rank 0
writes ``OUT`` (``torch.save`` of {"weights": name -> float32 tensor, "states": [the weights each step returned
(what rank 0 publishes), name -> tensor in param_dtype], "metrics": [per-step metrics dicts], "published": [the
versions of the steps that returned weights],
"backend_config": the process group's backend, "collective_backend": the one trainer.distributed names for the
training device, "mp_param_dtype": FSDP2's compute dtype (None for other backends)}); other ranks write their
metrics to ``OUT.rank<r>``.
"""
import sys
from pathlib import Path

import numpy as np
import torch

from topics.schemas import Sample, TrajectoryGroup
from trainer.config import TrainerConfig
from trainer.loop import Trainer

#: The config both runs share: float32, 3 micro-batches of 2 in the first mini-batch of 4 and 1 in the
#: second (so on 2 ranks one rank runs a zero-loss filler pass), TIS with a separate π_old forward.
CONFIG = dict(param_dtype="float32", lr=1e-3, mini_batch_size=4, micro_batch_size=2, correction="tis",
              max_grad_norm=1.0)


def example_trainer(example: str | Path) -> dict:
    """The trainer settings of a GPU example (``policies.actor.trainer``) scaled down to the tiny model on the
    CPU: its dtypes, lr, correction and ranks, with ``device: cpu`` and :data:`CONFIG`'s batch sizes."""
    import yaml

    trainer = dict(yaml.safe_load(Path(example).read_text())["policies"]["actor"]["trainer"])
    trainer.update(device="cpu", mini_batch_size=CONFIG["mini_batch_size"], micro_batch_size=CONFIG["micro_batch_size"])
    return trainer


def sparsity(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """The fraction of the weights that two published versions hold equal (the paper's per-version sparsity)."""
    return sum(int((old[k] == new[k]).sum()) for k in new) / sum(v.numel() for v in new.values())


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


def main(model_dir: str, out: str, ranks: str, backend: str = "torch", example: str | None = None) -> None:
    torch.set_num_threads(1)
    import os

    from trainer.distributed import collective_backend, leave

    rank = int(os.environ.get("RANK", "0"))
    settings = example_trainer(example) if example else CONFIG
    config = TrainerConfig(**{**settings, "policy": "pol", "ranks": int(ranks), "backend": backend})
    trainer = Trainer(config, model_dir)
    metrics, published, states = [], [], []
    for b in batches():
        step = trainer.train_step(b, with_weights=True)  # the gather is a collective: every rank asks
        metrics.append(step.metrics)
        if step.weights:  # rank 0's: copied before the next step updates them in place
            published.append(step.version)
            states.append({k: v.detach().cpu().clone() for k, v in step.weights.items()})
    if rank == 0:
        policy = getattr(trainer.backend, "mp_policy", None)
        torch.save({"weights": {k: v.float() for k, v in states[-1].items()}, "states": states,
                    "metrics": metrics, "published": published,
                    "backend_config": torch.distributed.get_backend_config() if torch.distributed.is_initialized()
                    else None, "collective_backend": collective_backend(trainer.device),
                    "mp_param_dtype": None if policy is None else policy.param_dtype}, out)
    else:
        torch.save(metrics, f"{out}.rank{rank}")
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:])
