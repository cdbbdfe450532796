#!/usr/bin/env python
"""Multi-policy co-training: the dataflow pipeline vs the sequential multi-agent loop.

Workload (both sides, the same prompts in the same order: repetition r runs the ``arith`` prompts of seed r in
the order acquisition sends them with ``data.shuffle_seed`` r): ``solve_verify_retry`` on the synthetic ``arith`` task,
two policies (solver, verifier) that are both the built-in tiny model, B
prompts x G samples per iteration, GRPO with TIS correction (the trainer config
of ``examples/solver-verifier-tiny.yaml``), N iterations (trainer versions).

(a) Sequential multi-agent loop, one process with 2 torch threads (the
    trainer-centric baseline of the AstraFlow paper): per iteration, roll out
    the whole workflow for B prompts (every episode of the batch concurrent on
    one asyncio loop, each policy's engine calls batched by an
    :class:`~producers.engine_batcher.EngineBatcher`, as RaaS does), train the
    solver, then the verifier, then load both new weights into the rollout
    engines.
(b) Dataflow pipeline: ``astraflow run examples/solver-verifier-tiny.yaml``
    with the same B, G, N: acquisition, one RaaS worker (``--raas-workers``),
    one filter processor and one trainer per policy as separate processes with
    one thread each (OMP_NUM_THREADS=1), meeting on the embedded bus and the
    local weight store, placed by the OS (``--place KIND=CPUS`` pins them). Since
    RaaS batches the engine calls of every episode in flight, rollout is the
    smallest stage, so a placement with RaaS alone on CPU 1 and both trainers
    on CPU 0 bounds the pipeline by the trainers' sum, which the OS's own
    placement beats.

Steady-state seconds per iteration, excluding start-up and model loading: an
iteration ends when both policies have reached version v (sequential: both
trained and synced; pipeline: the later of the two trainers' Metric timestamps
for step v). Sequential: s/iter = (end(N) - end(1)) / (N - 1). Pipeline: over
the window W = [end(K), end(N)] (K = 2, after start-up), s/iter = (|W| + D x
rollout) / (N - K), D = max(0, N - K - prompts rolled out in W / B) the batches
trained in W but rolled out before it (RaaS's lead at the window's start, built
while the trainers started) and ``rollout`` the loaded loop's rollout stage
(seconds per batch): groups rolled out ahead before the window do not make the
pipeline look faster than its stages, each charged the time one core takes to
roll it out (rollouts counted by their ``outcomes`` timestamps). The strict
count, |W| / min(N - K, prompts rolled out in W / B), charges a whole iteration
per such batch, and is reported too (:func:`pipeline_s_per_iter`).

Threads: the brief is "equal cores" (2). On a machine shared with other jobs,
2 intra-op threads can be several times slower than 1 for this tiny model
(OpenMP threads wait for each other), so the sequential loop is measured with
1 and with 2 threads and the faster one is the baseline.

Usage: ``scripts/bench_multipolicy.py [--quick] [--repeats R]``. Repetitions alternate the loop and the
pipeline (R = 3 by default: ~6 minutes on 2 cores, a repetition ~2). 64 iterations by default (a window of 62
versions): a longer window spreads the pipeline's repetitions less than 32 iterations do. Prints each measurement,
min/median/max over repeats and each repetition's ratio, and ends with one JSON line
``{"metric": "multipolicy_s_per_iter", "value": pipeline, "baseline": sequential, "ratio": baseline/value,
"ratio_spread": {"runs", "median", "min", "max"}, "pipeline_s_per_iter": {...}, "sequential_s_per_iter":
{...}, "bound": ..., "efficiency": bound/value, "efficiency_runs", "pipeline_s_per_iter_strict",
"efficiency_strict_runs", "bound_idle", "efficiency_idle_strict_runs"}`` (medians over repeats): the bound is the
least s/iter of any pipeline on 2 cores, ``max(stage sum / 2, largest stage)``, from the 1-thread loop's stage
times measured with both cores busy (two copies at once, :func:`loaded_stages`, :func:`two_core_bound`; needs 1 in
``--threads``); ``bound_idle`` from the same loop alone, and ``efficiency_idle_strict_runs`` that bound over the
strict count.
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
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.placement import placement_overrides  # noqa: E402  (after sys.path gets the repository)
from scripts.spread import describe, spread  # noqa: E402

CONFIG = ROOT / "examples" / "solver-verifier-tiny.yaml"
CHECKPOINT_EVERY = 4  # trainer steps


def sequential_s_per_iter(iters: int, batch: int, g: int, threads: int, seed: int) -> tuple[float, dict[str, float]]:
    """The sequential loop's steady-state seconds per iteration (see the module docstring), and its stages'
    median seconds per iteration: ``rollout``, ``train.solver``, ``train.verifier``, ``sync``. Its prompts are the
    pipeline's of the same ``seed`` (``seed`` and ``data.shuffle_seed``, :func:`pipeline_s_per_iter`), in the order
    acquisition sends them (:func:`producers.acquisition.pass_order`)."""
    import torch

    from astraflow.launched import keep_freed_memory

    torch.set_num_threads(threads)
    keep_freed_memory()  # as every component of the pipeline does (astraflow.launched.component_setup)
    from astraflow.config import load_config
    from producers.acquisition import pass_order
    from producers.engine_batcher import EngineBatcher
    from producers.engines import SamplingParams
    from producers.hf_engine import HFEngine
    from producers.sources import load_source
    from producers.workflows import get_workflow
    from trainer.loop import Trainer
    from weights.models import resolve_model

    cfg = load_config(CONFIG)
    policies = ("solver", "verifier")
    engines = {p: HFEngine(resolve_model(cfg.policies[p].model)) for p in policies}
    trainers = {p: Trainer(cfg.trainer_config(p), resolve_model(cfg.policies[p].model)) for p in policies}
    workflow = get_workflow(cfg.workflow.name, policies=cfg.workflow.roles, **cfg.workflow.options)
    sampling = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
                              top_p=cfg.sampling.top_p, seed=None)
    source = load_source("arith", seed=seed)
    order = pass_order(len(source), seed, 0)
    batchers = {p: EngineBatcher(engines[p], name=p) for p in policies}
    loop = asyncio.new_event_loop()

    async def rollout(prompts: list) -> list:  # every episode of the batch concurrent, engine calls batched
        return await asyncio.gather(*(workflow.rollout(p, batchers, sampling, {}) for p in prompts))

    ends = []
    stages: dict[str, list[float]] = defaultdict(list)
    for it in range(iters):
        t0 = time.perf_counter()
        groups = defaultdict(list)
        prompts = [source[order[i]].model_copy(update={"n_samples": g}) for i in range(it * batch, (it + 1) * batch)]
        for group in (grp for per_prompt in loop.run_until_complete(rollout(prompts)) for grp in per_prompt):
            groups[group.policy].append(group)
        stages["rollout"].append(time.perf_counter() - t0)
        for p in policies:  # train each policy in turn
            t0 = time.perf_counter()
            trainers[p].train_step(groups[p])
            stages[f"train.{p}"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in policies:  # sync the rollout engines
            engines[p].load_weights(trainers[p].publish_state(), trainers[p].version)
        stages["sync"].append(time.perf_counter() - t0)
        ends.append(time.perf_counter())
    for b in batchers.values():
        b.close()
    loop.close()
    return (ends[-1] - ends[0]) / (iters - 1), {k: statistics.median(v[1:]) for k, v in stages.items()}


def loaded_stages(iters: int, batch: int, g: int, seed: int, copies: int = 2) -> dict[str, float]:
    """The 1-thread loop's stage seconds per iteration (as :func:`sequential_s_per_iter`) measured with ``copies``
    copies of it running at once, one per core: what each stage costs on a machine whose cores are all busy, as
    they are under any pipeline that reaches the 2-core bound. Each stage's median over the copies.

    Alone, a stage runs with the other core idle; two copies at once take longer per stage (shared caches and
    memory bandwidth), so a bound from the idle-core stage times is one no pipeline that keeps both cores busy can
    reach.

    Raises:
        RuntimeError: a copy failed.
    """
    cmd = [sys.executable, __file__, "--loop-stages", str(iters), str(batch), str(g), str(seed)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(copies)]
    outs = [p.communicate() for p in procs]
    failed = [err[-2000:] for p, (_, err) in zip(procs, outs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"a copy of the loaded loop failed:\n{failed[0]}")
    runs = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def two_core_bound(stages: dict[str, float], workers: int, cores: int = 2) -> float:
    """The least seconds per iteration any pipeline of these stages can take on ``cores`` cores:
    ``max(stage sum / cores, largest stage)``, the rollout stage split over ``workers`` RaaS workers (prompts are
    independent) and the trainers' stages whole (each policy's steps are sequential). Weight syncs are not
    counted (the pipeline's engines load weights between batches: a cost the bound does not grant). Stage
    seconds come from the 1-thread sequential loop (:func:`sequential_s_per_iter`)."""
    work = stages["rollout"] + stages["train.solver"] + stages["train.verifier"]
    return max(work / cores, stages["rollout"] / workers, stages["train.solver"], stages["train.verifier"])


def pipeline_s_per_iter(iters: int, batch: int, g: int, workers: int, timeout_s: float, place: list[str],
                        extra: list[str], rollout_s: float | None, seed: int = 0,
                        first: int = 2) -> tuple[float, float, float]:
    """The pipeline's steady-state seconds per iteration, the same by the strict count, and the run's whole wall
    time (seconds), over the window of the module docstring.

    ``seed`` is the run's ``seed`` and ``data.shuffle_seed``: the arith prompts and their order, those of the loop of
    the same seed (:func:`sequential_s_per_iter`), so that both sides of a repetition train on the same prompts in the
    same order.

    ``rollout_s`` is the loaded loop's rollout stage (seconds per batch, :func:`loaded_stages`): each batch the
    trainers took in the window that RaaS did not roll out in it (it had rolled it out before, its lead at the
    window's start: 2-4 batches, built while the trainers started) adds that much to the window, the time one
    core takes to roll it out, the most its work can add. The strict count (without ``rollout_s``),
    ``|W| / min(versions, batches rolled out in W)``, charges a whole iteration per such batch, about three times
    the rollout's share of an iteration's work, so the same pace of the trainers comes out differently from one
    repetition to the next by how far ahead RaaS was when the window opened.

    Raises:
        RuntimeError: the run failed or did not reach version ``iters`` for both policies.
    """
    run = f"bench-mp-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-mp-") as tmp:
        run_dir = Path(tmp) / run
        # RaaS's in-flight limit: the per-policy default, batch_groups x max_staleness (4 batches; the example's 16
        # groups is for its batches of 4). More batches in flight than max_staleness allows only get the solver's
        # groups, the slowest stage's, dropped as stale.
        overrides = [f"run={run}", f"run_dir={run_dir}", f"seed={seed}", f"data.shuffle_seed={seed}",
                     f"data.n_samples={g}", f"raas.batch_prompts={batch}",
                     "raas.max_inflight_groups=null", "data.epochs=1", f"raas.workers={workers}",
                     *placement_overrides(place), *extra]
        for p in ("solver", "verifier"):
            overrides += [f"policies.{p}.steps={iters}", f"policies.{p}.batch_groups={batch}",
                          f"policies.{p}.checkpoint_every={CHECKPOINT_EVERY}"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(CONFIG), *overrides], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"astraflow run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        ts: dict[str, dict[int, float]] = defaultdict(dict)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            if m.get("kind") == "trainer" and m.get("step") is not None:
                ts[m["policy"]][m["step"]] = m["ts"]
        rolled = rollout_times(f"local://{run_dir / 'bus'}", run, "solver")
    missing = [(p, v) for p in ("solver", "verifier") for v in (first, iters) if v not in ts[p]]
    if missing:
        raise RuntimeError(f"pipeline run lacks trainer metrics for (policy, version) {missing}")
    start_w, end_w = (max(ts[p][v] for p in ("solver", "verifier")) for v in (first, iters))
    rolled_iters = sum(start_w < t <= end_w for t in rolled) / batch
    print(f"    pipeline window: {iters - first} versions trained, {rolled_iters:.2f} iterations rolled out "
          f"in {end_w - start_w:.2f} s", flush=True)
    strict = (end_w - start_w) / min(iters - first, rolled_iters)
    if rollout_s is None:
        return strict, strict, wall
    return (end_w - start_w + max(0.0, iters - first - rolled_iters) * rollout_s) / (iters - first), strict, wall


def rollout_times(bus_url: str, run: str, policy: str) -> list[float]:
    """Timestamps (seconds since the epoch) of ``policy``'s rollouts on the run's ``outcomes`` topic."""
    from topics.bus import connect, read_topic
    from topics.codec import decode
    from topics.names import TopicNames
    from topics.schemas import RolloutOutcome

    outcomes = (decode(r.value, RolloutOutcome) for r in read_topic(connect(bus_url), TopicNames(run).outcomes))
    return [o.ts for o in outcomes if o.policy == policy]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="16 iterations instead of 64, of the same 16 prompts x G=8 (a window of 14 versions "
                         "against 62; until 2026-12-03 quick ran 8 iterations of 8 x 8, another workload)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per mode (alternating; default 3)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch thread counts tried for the sequential loop; the fastest is the baseline")
    ap.add_argument("--raas-workers", type=int, default=1, help="RaaS worker processes of the pipeline")
    ap.add_argument("--place", action="append", default=None, metavar="KIND=CPUS[:THREADS]",
                    help="the pipeline's placement (default none: the OS schedules the processes)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help="a run-config override for the pipeline, e.g. placement.raas.nice=10 (repeatable)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit of one pipeline run")
    ap.add_argument("--loop-stages", type=int, nargs=4, metavar=("ITERS", "BATCH", "G", "SEED"),
                    help=argparse.SUPPRESS)  # one copy of the loaded loop (loaded_stages): prints its stages as JSON
    a = ap.parse_args()
    if a.loop_stages:
        iters, batch, g, seed = a.loop_stages
        print(json.dumps(sequential_s_per_iter(iters, batch, g, 1, seed)[1]))
        return
    a.place = a.place or []
    iters, batch, g = (16 if a.quick else 64), 16, 8
    print(f"workload: solve_verify_retry on arith, tiny solver + tiny verifier, {iters} iterations of "
          f"{batch} prompts x G={g}; {os.cpu_count()} cores; sequential loop {a.threads} threads (best), "
          f"pipeline {a.raas_workers} RaaS worker(s), 1 thread per process, placement: "
          f"{', '.join(a.place) or 'none (the OS schedules)'}; overrides: {' '.join(a.overrides) or 'none'}",
          flush=True)
    seq, pipe, strict, bounds, idle_bounds = [], [], [], [], []
    for r in range(a.repeats):
        tried, rollout_s = {}, None
        for t in a.threads:
            tried[t], stages = sequential_s_per_iter(iters, batch, g, t, seed=r)
            print(f"[{r}] sequential multi-agent loop, {t} thread(s): {tried[t]:.3f} s/iter ("
                  + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()) + ")", flush=True)
            if t == 1:  # the pipeline's processes run one thread each: their stages cost what these do
                idle_bounds.append(two_core_bound(stages, a.raas_workers))
                loaded = loaded_stages(iters, batch, g, seed=r)
                print(f"[{r}] the same loop, two copies at once (both cores busy): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in loaded.items()), flush=True)
                bounds.append(two_core_bound(loaded, a.raas_workers))
                rollout_s = loaded["rollout"]
        seq.append(min(tried.values()))
        value, value_strict, wall = pipeline_s_per_iter(iters, batch, g, a.raas_workers, a.timeout_s, a.place,
                                                        a.overrides, rollout_s, seed=r)
        pipe.append(value)
        strict.append(value_strict)
        print(f"[{r}] dataflow pipeline:            {value:.3f} s/iter, strict count {value_strict:.3f} (whole run "
              f"incl. start-up {wall:.1f} s)", flush=True)
    for name, xs in (("sequential", seq), ("pipeline", pipe)):
        print(f"{name}: min {min(xs):.3f}  median {statistics.median(xs):.3f}  max {max(xs):.3f} s/iter "
              f"over {len(xs)} run(s)")
    value, baseline = statistics.median(pipe), statistics.median(seq)
    bound = statistics.median(bounds) if bounds else None
    idle_bound = statistics.median(idle_bounds) if idle_bounds else None
    if bound is not None:
        print(f"2-core bound: {bound:.3f} s/iter (max(stage sum / 2, largest stage), stages of the 1-thread "
              f"loop run as two copies at once); the pipeline's efficiency {bound / value:.2f} of it; from the "
              f"loop's stages alone (the other core idle) {idle_bound:.3f}", flush=True)
    ratio = spread([b / v for b, v in zip(seq, pipe)], 3)
    print(f"ratio (sequential / pipeline), repetition by repetition: {describe(ratio, '.2f')}", flush=True)
    per_rep = [round(b / v, 3) for b, v in zip(bounds, pipe)]
    per_rep_strict = [round(b / v, 3) for b, v in zip(bounds, strict)]
    per_rep_idle = [round(b / v, 3) for b, v in zip(idle_bounds, strict)]  # the strict count, idle-core bound
    if per_rep:
        print(f"efficiency, repetition by repetition: {per_rep}; by the strict count {per_rep_strict}; by the strict "
              f"count against the idle-core bound (the measure until 2026-12-05) {per_rep_idle}", flush=True)
    print(json.dumps({"metric": "multipolicy_s_per_iter", "value": round(value, 4), "baseline": round(baseline, 4),
                      "ratio": round(baseline / value, 3), "ratio_spread": ratio, "pipeline_s_per_iter": spread(pipe),
                      "sequential_s_per_iter": spread(seq),
                      "bounds": spread(bounds), "repeats": a.repeats, "placement": a.place,
                      "overrides": a.overrides,
                      "bound": None if bound is None else round(bound, 4),
                      "efficiency": None if bound is None else round(bound / value, 3), "efficiency_runs": per_rep,
                      "pipeline_s_per_iter_strict": spread(strict), "efficiency_strict_runs": per_rep_strict,
                      "bound_idle": None if idle_bound is None else round(idle_bound, 4),
                      "efficiency_idle_strict_runs": per_rep_idle}))


if __name__ == "__main__":
    main()
