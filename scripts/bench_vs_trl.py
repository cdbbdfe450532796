#!/usr/bin/env python
"""AstraFlow against TRL's ``GRPOTrainer`` on the same workload and cores: reward against wall time.

The workload is arith-tiny's (``examples/arith-tiny.yaml``): the built-in tiny model, the ``arith`` source,
the exact-answer reward (:func:`producers.rewards.arith_reward`, the same function for both), 16 prompts x
G=16 samples per step, 4 new tokens, temperature 1.8, AdamW at lr 5e-4 (constant, no weight decay, gradient
norm clipped at 1), float32, no KL penalty. The two systems run one after the other, each given the same
cores (``--cpus``, by CPU affinity; torch threads = their number), in rounds that interleave them (TRL
AstraFlow, AstraFlow TRL, ...: :func:`scripts.spread.interleaved`), so that the machine's drift (~30% within
an hour on a shared VM) hits both; round r runs both with seed r:

* **TRL** 1.16 (the ``bench`` extra: ``scripts/install.sh bench``): one process, ``GRPOTrainer`` with
  ``use_cpu=True``, ``beta=0``, ``num_generations=16``, ``per_device_train_batch_size=256``,
  ``max_completion_length=4``, ``lr_scheduler_type="constant"``, prompts in the tiny model's chat format
  (the token ids AstraFlow's rollout sends). It is on-policy: each step generates, scores and trains.
* **AstraFlow**: ``astraflow run examples/arith-tiny.yaml`` (embedded bus, local store, its processes
  placed by the launcher on the same cores), ``--set`` overrides passed on.

Both clocks start when the process is launched (imports, model load and, for AstraFlow, its components'
start-up count). The **threshold** is the reward TRL reaches: the mean training reward of its last 20% of
steps. **Time to threshold** is the first wall time at which a system's reward, averaged over its last 20
steps, reaches it (None when it never does). **Reward at equal time** is each system's 20-step average at
the wall time TRL took for all its steps.

Printed: per run the wall time and reward gain; a table of each figure's median and spread [min, max] over
the runs; AstraFlow's time over TRL's round by round (wall time for equal steps, and time to threshold)
with its spread; a verdict that says "parity" when that spread straddles 1 and "not met" when an AstraFlow
run never reached the threshold; the curves as one PNG (``--png``); and a last JSON line
``{"metric": "time_to_reward_vs_trl", "ours": s, "baseline": s, "ratio": median of the rounds' ratios (null
unless every AstraFlow run reached the threshold), "wall_ratio": {"runs", "median", "min", "max"},
"time_to_threshold_ratio": {...}, "systems": {name: {figure: {"runs", "median", "min", "max"}}},
"verdict": ..., ...}``.

Usage: ``scripts/bench_vs_trl.py [--quick] [--steps N] [--repeats N] [--cpus 0,1] [--png PATH]
[--set KEY=VALUE ...] [--place KIND=CPUS[:THREADS] ...]``. Cost on 2 quiet cores: a round of 400 steps (the
default) ~3-3.5 minutes, so the default 3 rounds ~10 minutes; ``--quick`` (200 steps, 3 rounds) ~5-6 minutes.
"""
from __future__ import annotations

import argparse
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

from scripts.bench_staleness import moving_average  # noqa: E402
from scripts.spread import describe, interleaved, spread  # noqa: E402

EXAMPLE = ROOT / "examples" / "arith-tiny.yaml"
WINDOW = 20  # steps in the moving average
PROMPTS_PER_STEP, GROUP = 16, 16
TRL, OURS = "TRL GRPOTrainer", "AstraFlow"


def trl_worker(steps: int, seed: int, out: Path, t0: float) -> None:
    """Run TRL's GRPOTrainer on arith-tiny in this process; append ``{"t", "step", "reward"}`` per step to
    ``out`` (``t``: seconds since ``t0``, a ``time.time()`` taken when the process was launched)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from producers.rewards import arith_reward
    from producers.sources import load_source
    from weights.models import resolve_model

    torch.manual_seed(seed)
    model_dir = resolve_model("tiny")
    source = load_source("arith", seed=seed)
    rows = [source[i] for i in range(steps * PROMPTS_PER_STEP)]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p.text}], "index": i} for i, p in enumerate(rows)])

    def reward(prompts, completions, index, **_):
        return [arith_reward(rows[i], c[0]["content"]) for c, i in zip(completions, index)]

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                with out.open("a") as f:
                    f.write(json.dumps({"t": time.time() - t0, "step": state.global_step,
                                        "reward": logs["reward"]}) + "\n")

    config = GRPOConfig(output_dir=str(out.parent / "trl-out"), use_cpu=True, beta=0.0, num_generations=GROUP,
                        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, max_completion_length=4,
                        temperature=1.8, learning_rate=5e-4, lr_scheduler_type="constant", weight_decay=0.0,
                        max_grad_norm=1.0, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
                        seed=seed, bf16=False, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()]).train()


def run_trl(steps: int, seed: int, cpus: list[int], work: Path) -> list[dict]:
    """TRL in a child process pinned to ``cpus``; its per-step rows.

    Raises:
        RuntimeError: TRL is not installed (``scripts/install.sh bench``) or the run failed.
    """
    out = work / f"trl-{seed}.jsonl"
    cmd = [sys.executable, __file__, "--trl-worker", str(out), "--steps", str(steps), "--seed", str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus)), "ASTRAFLOW_BENCH_T0": repr(time.time())}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    if done.returncode != 0:
        raise RuntimeError(f"TRL run exited {done.returncode}:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def run_ours(steps: int, seed: int, cpus: list[int], extra: list[str], work: Path) -> list[dict]:
    """``astraflow run`` of the example pinned to ``cpus``; per trainer step ``{"t", "step", "reward"}``.

    Raises:
        RuntimeError: the run failed (its stderr tail in the message).
    """
    run_dir = work / f"ours-{seed}"
    cmd = [sys.executable, "-m", "astraflow", "run", str(EXAMPLE), f"run=vstrl{uuid.uuid4().hex[:8]}",
           f"run_dir={run_dir}", f"policies.actor.steps={steps}", f"seed={seed}", f"data.shuffle_seed={seed}",
           *extra]
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the launcher places its components
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} exited {done.returncode}:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_seen = {}
    for r in rows:
        if r.get("kind") == "trainer" and r.get("step") and "reward_mean" in r["values"]:
            steps_seen.setdefault(r["step"], {"t": r["ts"] - t0, "step": r["step"], "reward": r["values"]["reward_mean"]})
    return [steps_seen[k] for k in sorted(steps_seen)]


def moving(rows: list[dict]) -> list[tuple[float, float]]:
    """(wall time, mean reward of the last :data:`WINDOW` steps) at each step."""
    return list(zip((r["t"] for r in rows), moving_average([r["reward"] for r in rows], WINDOW)))


def fifth_means(rows: list[dict]) -> tuple[float, float]:
    """Mean reward of the first and of the last 20% of steps."""
    k = max(1, len(rows) // 5)
    return statistics.fmean(r["reward"] for r in rows[:k]), statistics.fmean(r["reward"] for r in rows[-k:])


def time_to(curve: list[tuple[float, float]], threshold: float) -> float | None:
    """The first wall time at which the moving average reaches ``threshold`` (None: never)."""
    return next((t for t, r in curve[WINDOW - 1:] if r >= threshold), None)


def at_time(curve: list[tuple[float, float]], t: float) -> float | None:
    """The moving average at the last step logged by wall time ``t`` (None: no step yet)."""
    seen = [r for s, r in curve if s <= t]
    return seen[-1] if seen else None


def plot(runs: dict[str, list[list[dict]]], threshold: float, path: Path) -> None:
    """Reward (moving average) against wall time, every run of both systems, the threshold dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, rs), colour in zip(runs.items(), ("tab:blue", "tab:orange")):
        for i, rows in enumerate(rs):
            t, r = zip(*moving(rows))
            ax.plot(t, r, color=colour, lw=1.3, alpha=0.85, label=name if i == 0 else None)
    ax.axhline(threshold, color="grey", ls="--", lw=1, label="TRL's last-20% reward")
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel(f"training reward (moving average {WINDOW} steps)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(runs: dict[str, list[list[dict]]]) -> dict:
    """The figures of paired runs (``runs[TRL][r]`` and ``runs[OURS][r]`` ran side by side in round ``r``).

    Returns:
        ``{"threshold", "equal_time_s", "systems": {name: {figure: spread}}, "wall_ratio": spread,
        "time_to_threshold_ratio": spread, "reached": AstraFlow runs that reached the threshold, "rounds",
        "verdict": str}``; every spread is :func:`scripts.spread.spread` of one figure per run (seconds for
        times), a ratio is AstraFlow's over TRL's of the same round (below 1: AstraFlow took less time).
    """
    threshold = statistics.fmean(fifth_means(rows)[1] for rows in runs[TRL])
    equal_t = statistics.fmean(rows[-1]["t"] for rows in runs[TRL])
    systems, reach = {}, {}
    for name, rs in runs.items():
        reach[name] = [time_to(moving(rows), threshold) for rows in rs]
        firsts, lasts = zip(*(fifth_means(rows) for rows in rs))
        systems[name] = {"wall_s": spread([rows[-1]["t"] for rows in rs], 1),
                         "steps_per_s": spread([len(rows) / rows[-1]["t"] for rows in rs], 2),
                         "reward_first": spread(firsts), "reward_last": spread(lasts),
                         "gain": spread([b - a for a, b in zip(firsts, lasts)]),
                         "time_to_threshold_s": spread(reach[name], 1),
                         "reward_at_equal_time": spread([at_time(moving(rows), equal_t) for rows in rs])}
    wall = spread([o[-1]["t"] / t[-1]["t"] for t, o in zip(runs[TRL], runs[OURS])], 3)
    ratio = spread([None if o is None or not t else o / t for t, o in zip(reach[TRL], reach[OURS])], 3)
    rounds = len(runs[OURS])
    reached = sum(r is not None for r in reach[OURS])

    def versus(s: dict) -> str:
        if s["median"] is None:
            return "-"
        kind = "faster" if s["max"] < 1 else "slower" if s["min"] > 1 else "parity"
        return f"{s['min']:.2f}-{s['max']:.2f}x TRL's ({kind})"

    verdict = (f"equal-step wall time {versus(wall)}; time to TRL's final reward: "
               + (f"not met in {rounds - reached} of {rounds} runs" if reached < rounds else versus(ratio)))
    return {"threshold": round(threshold, 4), "equal_time_s": round(equal_t, 1), "systems": systems,
            "wall_ratio": wall, "time_to_threshold_ratio": ratio, "reached": reached, "rounds": rounds,
            "verdict": verdict}


def report(runs: dict[str, list[list[dict]]], steps: int, cpus: list[int], place: list[str], png: Path) -> None:
    """Print the figures of paired runs (:func:`summarize`): the table of medians and spreads, the round-by-round
    ratios, the verdict, the curves to ``png``, and the last line, one JSON object."""
    res = summarize(runs)
    placement = ", ".join(place) or "none (the OS schedules every process on the cpus, 1 thread each)"
    print(f"\narith-tiny, {steps} steps, {len(runs[OURS])} interleaved round(s), cpus {cpus}, our placement: "
          f"{placement}; threshold {res['threshold']:.3f} (TRL's last-20% reward, mean over its runs), equal time "
          f"{res['equal_time_s']:.1f} s (TRL's whole run, mean)")
    print("each cell: median [min, max] over the runs")
    print("| system | wall time (s) | steps/s | reward gain (first 20% -> last 20%) | time to threshold (s) "
          f"| reward at {res['equal_time_s']:.0f} s |")
    print("|---|---|---|---|---|---|")

    def cell(s: dict, fmt: str, none: str = "-") -> str:
        if s["median"] is None:
            return none
        gap = f"; {len(s['runs']) - s['n']} {none}" if s["n"] < len(s["runs"]) else ""
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}, {s['max']:{fmt}}{gap}]"

    for name, s in res["systems"].items():
        print(f"| {name} | {cell(s['wall_s'], '.1f')} | {cell(s['steps_per_s'], '.2f')} | {cell(s['gain'], '+.3f')} "
              f"| {cell(s['time_to_threshold_s'], '.1f', 'never')} | {cell(s['reward_at_equal_time'], '.3f')} |")
    print(f"AstraFlow / TRL, round by round: wall time {describe(res['wall_ratio'], '.2f')}; time to threshold "
          f"{describe(res['time_to_threshold_ratio'], '.2f')}")
    print(res["verdict"])
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, res["threshold"], png)
    print(f"reward curves: {png}")
    ours, base = res["systems"][OURS]["time_to_threshold_s"], res["systems"][TRL]["time_to_threshold_s"]
    every = res["reached"] == res["rounds"]
    print(json.dumps({"metric": "time_to_reward_vs_trl", "ours": ours["median"] if every else None,
                      "baseline": base["median"],
                      "ratio": res["time_to_threshold_ratio"]["median"] if every else None,
                      "steps": steps, "repeats": len(runs[OURS]), "cpus": cpus,
                      "placement": place, **res}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 steps, 3 rounds")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 400; --quick 200)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, each one run of both systems (default 3)")
    ap.add_argument("--cpus", default=None, help="CPU ids both systems get (default: all this process may use)")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "vs_trl.png")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for our run")
    ap.add_argument("--place", action="append", default=[], metavar="KIND=CPUS[:THREADS]",
                    help="our placement, e.g. --place trainer=0:1 --place raas=1 (default: the OS schedules our "
                         "processes on --cpus, 1 thread each)")
    ap.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    steps = args.steps or (200 if args.quick else 400)
    if args.trl_worker:
        trl_worker(steps, args.seed, args.trl_worker, float(os.environ["ASTRAFLOW_BENCH_T0"]))
        return
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    from astraflow.placement import placement_overrides

    ours_overrides = [*args.set, *placement_overrides(args.place)]
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else sorted(os.sched_getaffinity(0))
    runs: dict[str, list[list[dict]]] = {TRL: [], OURS: []}
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        for r, name in interleaved((TRL, OURS), args.repeats):
            rows = (run_trl(steps, r, cpus, Path(tmp)) if name == TRL
                    else run_ours(steps, r, cpus, ours_overrides, Path(tmp)))
            runs[name].append(rows)
            first, last = fifth_means(rows)
            print(f"round {r}: {name}: {len(rows)} steps in {rows[-1]['t']:.1f} s, reward {first:.3f} -> "
                  f"{last:.3f} ({last - first:+.3f})", flush=True)
    report(runs, steps, cpus, args.place, args.png)


if __name__ == "__main__":
    main()
