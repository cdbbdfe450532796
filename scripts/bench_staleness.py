#!/usr/bin/env python
"""Off-policy corrections against staleness: arith-tiny over staleness x correction, reward gain and stability.

Each cell is one ``astraflow run examples/arith-tiny.yaml`` (embedded bus, local store, the example's
workload: 16 prompts x G=16 per step, 4 new tokens, temperature 1.8, float32) with

* ``policies.actor.max_staleness=S`` and ``raas.max_inflight_groups=16 x max(S, 1)``: RaaS runs S batches
  ahead of the trainer, so (after the first S steps) the groups trained are about S versions stale; S=0 is
  on-policy (RaaS waits for each new version);
* ``policies.actor.trainer.correction=C``: ``none`` (PPO clip against the behaviour policy), ``tis``
  (decoupled PPO: clip against the policy before the step, times the behaviour importance weight capped at
  ``tis_cap``) or ``m2po`` (second-moment trust region: the tokens with the largest squared log-ratio are masked
  until the mean of the rest is below tau; Zheng et al. 2025, arXiv:2510.01161).

Repetition r of every cell uses ``seed=r`` and ``data.shuffle_seed=r``: the cells of one repetition see the
same prompts in the same order and start from the same model.

The **gain** of a run is the mean training reward over its last 20% of steps minus that over its first 20%
(:func:`astraflow.launcher.outputs.reward_summary`, the figure ``astraflow run`` prints). Per cell the table gives the
gain (mean and the spread over repetitions) and the stability figures the trainer writes every step (means
over the run): clipped or masked token fraction ``clipfrac``, importance ratio pi_theta/pi_behaviour
``is_ratio_mean/max/min``, KL to the behaviour policy ``behaviour_kl`` (k3 estimator), ``entropy``,
``reward_std`` and ``grad_norm``. The reward curves (a moving average of 20 steps, one panel per staleness)
go to ``--png``.

The last line is one JSON object: ``{"metric": "stale_gain_ratio", "value": gain of the default correction
at the largest staleness, "baseline": its gain at staleness 0, "ratio": value / baseline, "ratio_spread":
that ratio in each repetition ({"runs", "median", "min", "max"}), "none_at_max": gain of ``none`` at the
largest staleness, "cells": {cell: {"gain": mean, "gains": every repetition's, ...}}}``, where the default
correction is the one in ``examples/arith-tiny.yaml``. A run's gain spreads by about +-0.05 between
repetitions, so a ratio whose spread straddles 1 is parity.

Usage: ``scripts/bench_staleness.py [--quick] [--repeats N] [--steps N] [--staleness 0,2,4,8]
[--corrections none,tis,m2po] [--png PATH] [--set KEY=VALUE ...]``. ``--quick``: one repetition and
staleness {0, 8} (6 runs, ~5-8 minutes on 2 quiet cores, 14 on a busy one); the default is 2 repetitions of the
whole grid (24 runs, ~25 minutes; a third repetition would add ~12, so it is ``--repeats 3``, not the default).
Each repetition runs every cell once, so the cells are interleaved against the machine's drift.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.launcher.outputs import reward_summary  # noqa: E402
from scripts.spread import describe, spread  # noqa: E402

EXAMPLE = ROOT / "examples" / "arith-tiny.yaml"
STABILITY = ("clipfrac", "is_ratio_mean", "is_ratio_max", "is_ratio_min", "behaviour_kl", "entropy", "reward_std",
             "grad_norm", "staleness_mean")


def run_cell(staleness: int, correction: str, repeat: int, steps: int, extra: list[str], work: Path) -> dict:
    """One ``astraflow run``; returns {"gain", "wall_s", "rewards": [per step], <stability means>}.

    Raises:
        RuntimeError: the run failed (its stderr tail in the message).
    """
    run_dir = work / f"s{staleness}-{correction}-r{repeat}"
    cmd = [sys.executable, "-m", "astraflow", "run", str(EXAMPLE), f"run=stale{uuid.uuid4().hex[:8]}",
           f"run_dir={run_dir}", f"policies.actor.steps={steps}", f"policies.actor.max_staleness={staleness}",
           f"raas.max_inflight_groups={16 * max(staleness, 1)}", f"policies.actor.trainer.correction={correction}",
           f"seed={repeat}", f"data.shuffle_seed={repeat}", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} exited {done.returncode}:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "trainer.actor" / "metrics.jsonl").read_text().splitlines()]
    values = sorted((r for r in rows if "reward_mean" in r), key=lambda r: r["step"])
    rewards = [v["reward_mean"] for v in values]
    first, last, _ = reward_summary(list(enumerate(rewards)))
    out = {"gain": last - first, "wall_s": wall, "rewards": rewards}
    for key in STABILITY:
        xs = [v[key] for v in values if key in v]
        out[key] = statistics.fmean(xs) if xs else float("nan")
    return out


def moving_average(xs: list[float], k: int = 20) -> list[float]:
    """The mean of the last ``k`` values at each position (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def plot(cells: dict, staleness: list[int], corrections: list[str], path: Path) -> None:
    """One panel per staleness, one line per correction (each repetition's curve, moving average 20)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(staleness), figsize=(4 * len(staleness), 3.6), sharey=True, squeeze=False)
    colours = dict(zip(corrections, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for ax, s in zip(axes[0], staleness):
        for c in corrections:
            for i, run in enumerate(cells[(s, c)]):
                ax.plot(moving_average(run["rewards"]), color=colours[c], alpha=0.85, lw=1.2,
                        label=c if i == 0 else None)
        ax.set_title(f"staleness {s}")
        ax.set_xlabel("trainer step")
    axes[0][0].set_ylabel("training reward (moving average 20)")
    axes[0][-1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repetition, staleness 0 and 8 (6 runs)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--staleness", default=None, help="comma-separated (default 0,2,4,8; --quick 0,8)")
    ap.add_argument("--corrections", default="none,tis,m2po")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "staleness.png")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further config override for every run (e.g. policies.actor.trainer.tis_cap=2)")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    staleness = [int(s) for s in (args.staleness or ("0,8" if args.quick else "0,2,4,8")).split(",")]
    corrections = args.corrections.split(",")
    default = yaml.safe_load(EXAMPLE.read_text())["policies"]["actor"]["trainer"].get("correction", "tis")

    cells: dict[tuple[int, str], list[dict]] = {(s, c): [] for s in staleness for c in corrections}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-staleness-") as tmp:
        for r in range(repeats):
            for s in staleness:
                for c in corrections:
                    res = run_cell(s, c, r, args.steps, args.set, Path(tmp))
                    cells[(s, c)].append(res)
                    print(f"staleness {s} {c:5s} repeat {r}: gain {res['gain']:+.3f} in {res['wall_s']:.0f} s "
                          f"(clipfrac {res['clipfrac']:.3f}, is_ratio {res['is_ratio_min']:.2f}.."
                          f"{res['is_ratio_max']:.2f}, behaviour_kl {res['behaviour_kl']:.4f}, "
                          f"staleness {res['staleness_mean']:.1f})", flush=True)

    print(f"\narith-tiny, {args.steps} steps, {repeats} repetition(s), {time.perf_counter() - t0:.0f} s in all")
    head = "| staleness | correction | gain (mean) | gains | " + " | ".join(STABILITY) + " |"
    print(head)
    print("|" + "---|" * (4 + len(STABILITY)))
    summary = {}
    for (s, c), runs in cells.items():
        gains = [x["gain"] for x in runs]
        mean = statistics.fmean(gains)
        summary[f"{s}/{c}"] = {"gain": round(mean, 4), "gains": [round(g, 4) for g in gains],
                               **{k: round(statistics.fmean(x[k] for x in runs), 4) for k in STABILITY}}
        print(f"| {s} | {c} | {mean:+.3f} | {', '.join(f'{g:+.3f}' for g in gains)} | "
              + " | ".join(f"{summary[f'{s}/{c}'][k]:.3g}" for k in STABILITY) + " |")
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(cells, staleness, corrections, args.png)
    print(f"reward curves: {args.png}")
    top = max(staleness)
    value = summary.get(f"{top}/{default}", {}).get("gain")
    baseline = summary.get(f"{min(staleness)}/{default}", {}).get("gain")
    stale, fresh = (summary.get(f"{s}/{default}", {}).get("gains", []) for s in (top, min(staleness)))
    ratio = spread([v / b if b else None for v, b in zip(stale, fresh)], 3)
    print(f"{default} at staleness {top} over staleness {min(staleness)}, repetition by repetition: "
          f"{describe(ratio, '.2f')}")
    print(json.dumps({"metric": "stale_gain_ratio", "value": value, "baseline": baseline,
                      "ratio": None if not baseline or value is None else round(value / baseline, 3),
                      "ratio_spread": ratio,
                      "default_correction": default, "staleness": top,
                      "none_at_max": summary.get(f"{top}/none", {}).get("gain"), "steps": args.steps,
                      "repeats": repeats, "cells": summary}))


if __name__ == "__main__":
    main()
