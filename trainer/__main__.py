"""``python -m trainer``: run one policy's trainer process (see :mod:`trainer.service`).

Example::

    python -m trainer --bus kafka://127.0.0.1:9092 --run r1 --model tiny-model --run-dir runs/r1/trainer.p \\
        --steps 100 --batch-groups 16 --store file:///abs/runs/r1/weights \\
        --trainer-json '{"policy": "p", "lr": 5e-4}' --replay-json '{"name": "replay", "ratio": 0.25}'

Prints one JSON summary line at the end (:meth:`TrainerService.run`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainer.config import TrainerConfig
from trainer.service import ServiceConfig, TrainerService


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line arguments; see ``python -m trainer --help``."""
    p = argparse.ArgumentParser(prog="python -m trainer", description="Run one policy's trainer.")
    p.add_argument("--bus", required=True, help="kafka://host:port or local://PATH")
    p.add_argument("--run", required=True, help="run name (topic prefix)")
    p.add_argument("--model", required=True, type=Path, help="HF model directory (initial weights, version 0)")
    p.add_argument("--run-dir", required=True, type=Path, help="checkpoints, trained_groups.jsonl, metrics.jsonl")
    p.add_argument("--trainer-json", default="{}", help="TrainerConfig fields as a JSON object")
    p.add_argument("--steps", type=int, default=100, help="stop at this version")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--batch-groups", type=int, help="batch size in groups (default 16)")
    size.add_argument("--batch-samples", type=int, help="batch size in samples")
    p.add_argument("--max-staleness", type=int, default=8, help="versions")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    p.add_argument("--idle-exit-s", type=float, default=None, help="exit after this many seconds without data")
    p.add_argument("--poll-timeout-s", type=float, default=5.0)
    p.add_argument("--store", default=None, help="weight store URI (file:///abs or s3://...); none: no publishing")
    p.add_argument("--replay-json", default=None, help='replay policy spec, e.g. {"name": "replay", "ratio": 0.25}')
    p.add_argument("--tensorboard-dir", type=Path, default=None)
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--no-console", action="store_true", help="no per-step console line")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    a = parse_args(argv)
    try:
        trainer_cfg = TrainerConfig.model_validate(json.loads(a.trainer_json))
    except ValueError as e:
        print(f"--trainer-json: {e}", file=sys.stderr)
        return 2
    cfg = ServiceConfig(
        bus=a.bus, run=a.run, model_dir=a.model, run_dir=a.run_dir, trainer=trainer_cfg, steps=a.steps,
        batch_groups=None if a.batch_samples else (a.batch_groups or 16), batch_samples=a.batch_samples,
        max_staleness=a.max_staleness, checkpoint_every=a.checkpoint_every, idle_exit_s=a.idle_exit_s,
        poll_timeout_s=a.poll_timeout_s, console=not a.no_console, tensorboard_dir=a.tensorboard_dir,
        wandb_project=a.wandb_project)
    replay = None
    if a.replay_json:
        from policies.registry import build_policy

        replay = build_policy(json.loads(a.replay_json))
    publisher = None
    if a.store:
        from topics.bus import connect
        from topics.names import TopicNames
        from weights.publisher import Publisher
        from weights.store import WeightStore

        publisher = Publisher(WeightStore(a.store, a.run), connect(a.bus), TopicNames(a.run), trainer_cfg.policy,
                              producer_id=f"trainer.{trainer_cfg.policy}")
    service = TrainerService(cfg, publisher=publisher, replay=replay)
    try:
        summary = service.run()
    finally:
        if publisher is not None:
            publisher.close()
        service.close()
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
