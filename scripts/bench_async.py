#!/usr/bin/env python
"""Trainer-centric synchronous RL against the dataflow pipeline, same workload and cores.

Both arms train the same model (the built-in tiny model, float32, CPU) with the
same trainer config (``examples/arith-tiny.yaml``), on the same batch
(``--prompts`` arithmetic prompts x ``--group`` samples per step, at most
``--max-new-tokens`` tokens each, the single-turn workflow) for the same number
of trainer steps:

* **sync**: one process, ``torch.set_num_threads(cores)``. Per step it rolls
  out a batch with an :class:`~producers.hf_engine.HFEngine` (every prompt's
  episodes concurrent, their engine calls batched by an
  :class:`~producers.engine_batcher.EngineBatcher`, as RaaS does), trains on it with a
  :class:`~trainer.loop.Trainer`, then loads the new weights into the engine
  (in memory: the most generous weight sync there is). The step after a sync
  samples from the newest weights, so staleness is 0.
* **pipeline**: ``astraflow run`` on the embedded bus and a local weight
  store: acquisition, one RaaS worker, the filter processor and the trainer as
  separate processes (``OMP_NUM_THREADS=1`` each, as the launcher sets), with
  bounded staleness ``--max-staleness`` (default: the example's, 4; the RaaS
  worker pauses while its weights are more than that many versions behind, and
  the trainer drops older groups). Rollout of version k+1's data overlaps with
  training version k. At 2, rollout and training, about equal here, have little
  slack between them, and the pipeline falls further short of its overlap
  bound than at 4.

Only the steady state is timed, in both arms: wall-clock seconds from the end
of trainer step ``--warmup`` to the end of step ``--steps`` (process start-up,
imports and model loading are excluded). For the pipeline the step ends are
the ``ts`` of the trainer's per-step Metric records in ``<run_dir>/metrics.jsonl``.
Rounds interleave the arms (sync 1 thread, sync 2 threads, pipeline; then the
reverse; ...) so that load from other processes on the machine hits every arm
alike; each run is printed, and each arm's median, with the ratio of every
round (the best sync arm's time over the pipeline's) and its spread (min, max).

The sync arm runs with 1 and with 2 torch threads (``--sync-threads 1,2``) and
the faster is the baseline: on the tiny model a second intra-op thread gains
10-30%, and on a loaded machine OpenMP's spinning can make it many times slower.
The pipeline's two busy processes (RaaS and trainer) get the two cores.

A two-stage pipeline can at best hide its shorter stage, so it cannot beat the
1-thread sync arm by more than (rollout + train) / max(rollout, train), and
the best sync arm by more than sync(best) / max(rollout, train) (its processes
run one thread each, so it takes at least the longer 1-thread stage). The
sync child times both phases, and the benchmark prints that bound
(``overlap_bound`` in the JSON line) next to the ratio, and the efficiency (ratio / bound).

Ends with one JSON line ``{"metric": "async_speedup", "value": pipeline_s,
"baseline": sync_s, "ratio": sync_s / pipeline_s, "ratio_spread": {"runs",
"median", "min", "max"}, "sync_s_by_threads": ..., "pipeline_s_runs": ...,
"overlap_bound": ..., ...}`` (seconds for the timed steps, medians over the
rounds; ratio > 1: the pipeline is faster). A round (three runs) takes ~1.5
minutes on 2 cores: the default 3 rounds ~5 minutes, ``--quick`` one round.

Usage: ``scripts/bench_async.py [--quick] [--rounds N] [--steps N] [--warmup K]
[--prompts P] [--group G] [--max-new-tokens T] [--max-staleness S] [--cores C]``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.placement import placement_overrides  # noqa: E402  (after sys.path gets the repository)
from scripts.spread import describe, interleaved, spread  # noqa: E402

CONFIG = ROOT / "examples" / "arith-tiny.yaml"


def workload_overrides(args: argparse.Namespace) -> list[str]:
    """The ``key=value`` overrides of ``examples/arith-tiny.yaml`` that set this benchmark's workload."""
    return [
        f"policies.actor.steps={args.steps}",
        f"policies.actor.batch_groups={args.prompts}",
        f"policies.actor.max_staleness={args.max_staleness}",
        f"policies.actor.checkpoint_every={args.steps}",  # one checkpoint, after the timed window
        f"data.n_samples={args.group}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"raas.batch_prompts={args.prompts}",
        # the in-flight count includes the batch in training, so a batch produced with M groups in
        # flight is trained at most M / prompts versions after the weights it was sampled with
        f"raas.max_inflight_groups={args.prompts * args.max_staleness}",
    ]


def run_sync(args: argparse.Namespace, threads: int) -> dict:
    """The synchronous arm in a child process with ``threads`` torch threads.

    Returns:
        ``{"timed_s", "rollout_s", "train_s"}``: seconds of the timed steps, and of their
        rollout and train (with weight load) phases.

    Raises:
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_sync-child", str(threads),
           *(f"--{k.replace('_', '-')}={v}" for k, v in
             (("steps", args.steps), ("warmup", args.warmup), ("prompts", args.prompts),
              ("group", args.group), ("max_new_tokens", args.max_new_tokens)))]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"sync arm failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sync_child(args: argparse.Namespace, threads: int) -> None:
    """Body of the synchronous arm: roll out, train, load weights, in turn; prints {"timed_s": ...}."""
    import torch

    torch.set_num_threads(threads)
    from astraflow.config import load_config
    from producers.engine_batcher import EngineBatcher
    from producers.engines import SamplingParams
    from producers.hf_engine import HFEngine
    from producers.sources import load_source
    from producers.workflows import get_workflow
    from trainer.loop import Trainer
    from weights.models import resolve_model

    cfg = load_config(CONFIG, workload_overrides(args))
    pc = cfg.policies["actor"]
    model_dir = resolve_model(pc.model)
    engine = HFEngine(model_dir)
    trainer = Trainer(cfg.trainer_config("actor"), model_dir)
    workflow = get_workflow(cfg.workflow.name, policies=cfg.workflow.roles or None)
    source = load_source("arith", seed=cfg.seed)
    sampling = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
                              top_p=cfg.sampling.top_p)
    batcher = EngineBatcher(engine, name="actor")
    loop = asyncio.new_event_loop()

    async def rollout(prompts: list) -> list:  # every episode of the batch concurrent, engine calls batched
        return await asyncio.gather(*(workflow.rollout(p, {"actor": batcher}, sampling, {}) for p in prompts))

    index, start, rollout_s, train_s = 0, None, 0.0, 0.0
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        prompts = [source[(index + i) % len(source)].model_copy(update={"n_samples": args.group})
                   for i in range(args.prompts)]
        index += args.prompts
        groups = [g for per_prompt in loop.run_until_complete(rollout(prompts)) for g in per_prompt]
        t1 = time.perf_counter()
        trainer.train_step(groups)
        engine.load_weights(trainer.publish_state(), trainer.version)
        if step > args.warmup:
            rollout_s, train_s = rollout_s + t1 - t0, train_s + time.perf_counter() - t1
        if step == args.warmup:
            start = time.perf_counter()
    timed_s = time.perf_counter() - start
    batcher.close()
    loop.close()
    print(json.dumps({"timed_s": timed_s, "rollout_s": rollout_s, "train_s": train_s}))


def run_pipeline(args: argparse.Namespace) -> dict:
    """The dataflow arm: ``astraflow run`` in a fresh run directory; returns timed seconds and staleness.

    Raises:
        RuntimeError: the run failed, or its metrics lack trainer steps ``warmup`` or ``steps``.
    """
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        run = f"bench-async-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-m", "astraflow", "run", str(CONFIG), *workload_overrides(args),
               *placement_overrides(args.place), f"run={run}", f"run_dir={tmp}/{run}"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if out.returncode != 0:
            raise RuntimeError(f"pipeline arm failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        ends, staleness = {}, []
        for line in (Path(tmp) / run / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["kind"] == "trainer" and rec["step"] is not None:
                ends[int(rec["step"])] = float(rec["ts"])
                if int(rec["step"]) > args.warmup:
                    staleness.append(rec["values"]["staleness_mean"])
    missing = {args.warmup, args.steps} - set(ends)
    if missing:
        raise RuntimeError(f"pipeline metrics lack trainer steps {sorted(missing)} (have {sorted(ends)})")
    return {"timed_s": ends[args.steps] - ends[args.warmup],
            "staleness_mean": sum(staleness) / len(staleness)}


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="25 steps (5 warm-up), 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per arm (default 3; 1 quick)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps (default 40; 25 quick)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the timed window")
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per step")
    parser.add_argument("--group", type=int, default=16, help="G: samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="generation budget per sample")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="bounded staleness of the pipeline (versions; default: the example's, 4)")
    parser.add_argument("--place", action="append", default=[], metavar="KIND=CPUS[:THREADS]",
                        help="the pipeline's placement, e.g. --place trainer=0 --place raas=1 (default: the OS "
                             "schedules its processes, 1 thread each)")
    parser.add_argument("--sync-threads", default="1,2",
                        help="comma-separated torch thread counts tried for the sync arm (e.g. 1,2); the fastest is the baseline")
    parser.add_argument("--_sync-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 25 if args.quick else 40
    if args.max_staleness is None:
        from astraflow.config import load_config
        args.max_staleness = load_config(CONFIG).policies["actor"].max_staleness
    if args._sync_child is not None:
        sync_child(args, args._sync_child)
        return
    rounds = args.rounds or (1 if args.quick else 3)
    if not 0 < args.warmup < args.steps:
        parser.error(f"--warmup must be in [1, --steps), got {args.warmup} with --steps {args.steps}")
    threads = [int(t) for t in args.sync_threads.split(",")]
    timed = args.steps - args.warmup
    print(f"workload: tiny model, {args.prompts} prompts x G={args.group}, max_new_tokens={args.max_new_tokens}, "
          f"{args.steps} trainer steps, timed {timed} (after {args.warmup} warm-up); pipeline max_staleness="
          f"{args.max_staleness}; 2 cores per arm; pipeline placement: "
          f"{', '.join(args.place) or 'none (the OS schedules, 1 thread per process)'}", flush=True)
    sync: dict[int, list[float]] = {t: [] for t in threads}
    sync_phases: dict[int, list[tuple[float, float]]] = {t: [] for t in threads}
    pipe: list[dict] = []
    for r, arm in interleaved([*threads, "pipeline"], rounds):
        if arm == "pipeline":
            pipe.append(run_pipeline(args))
            print(f"round {r + 1}: pipeline {pipe[-1]['timed_s']:.2f} s "
                  f"(staleness mean {pipe[-1]['staleness_mean']:.2f})", flush=True)
            continue
        out = run_sync(args, arm)
        sync[arm].append(out["timed_s"])
        sync_phases[arm].append((out["rollout_s"], out["train_s"]))
        print(f"round {r + 1}: sync ({arm} thread{'s' * (arm > 1)}) {sync[arm][-1]:.2f} s", flush=True)
    sync_med = {t: statistics.median(v) for t, v in sync.items()}
    best = min(sync_med, key=sync_med.get)
    sync_s = sync_med[best]
    pipeline_s = statistics.median(p["timed_s"] for p in pipe)
    ratio = spread([s / p["timed_s"] for s, p in zip(sync[best], pipe)], 3)
    print(f"sync {sync_s:.2f} s ({best} threads), pipeline {pipeline_s:.2f} s, for {timed} steps; ratio "
          f"(sync / pipeline, round by round) {describe(ratio, '.2f')}", flush=True)
    # A two-stage pipeline of 1-thread processes can at best hide the shorter stage: it takes at least
    # max(rollout, train) of the 1-thread sync arm, so it beats that arm by at most (rollout + train) /
    # max(rollout, train) and the best sync arm by at most sync_s / max(rollout, train) (smaller when 2 threads
    # are faster than 1).
    phases = sync_phases.get(1, [])
    bound = statistics.median((r + t) / max(r, t) for r, t in phases) if phases else None
    bound_best = sync_s / statistics.median(max(r, t) for r, t in phases) if phases else None
    if bound is not None:
        print(f"overlap bound: rollout {statistics.median(r for r, _ in phases):.2f} s + train "
              f"{statistics.median(t for _, t in phases):.2f} s in the 1-thread sync arm, so no two-stage pipeline "
              f"beats it by more than {bound:.2f}x, nor the best sync arm by more than {bound_best:.2f}x; "
              f"efficiency {sync_s / pipeline_s / bound_best:.2f} of that bound", flush=True)
    print(json.dumps({
        "metric": "async_speedup", "value": round(pipeline_s, 3), "baseline": round(sync_s, 3),
        "ratio": round(sync_s / pipeline_s, 3), "ratio_spread": ratio, "unit": "s", "timed_steps": timed,
        "sync_threads": best, "sync_s_by_threads": {t: [round(x, 3) for x in v] for t, v in sync.items()},
        "pipeline_s_runs": [round(p["timed_s"], 3) for p in pipe],
        "pipeline_staleness_mean": round(statistics.mean(p["staleness_mean"] for p in pipe), 3),
        "max_staleness": args.max_staleness, "prompts": args.prompts, "group": args.group,
        "max_new_tokens": args.max_new_tokens, "model": "tiny", "placement": args.place,
        "overlap_bound": None if bound_best is None else round(bound_best, 3),
        "efficiency": None if bound_best is None else round(sync_s / pipeline_s / bound_best, 3)}))


if __name__ == "__main__":
    main()
