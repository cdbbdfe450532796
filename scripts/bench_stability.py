#!/usr/bin/env python
"""Whether RL runs stay learned: each CPU example over seeds, and how far each run's end falls below its peak.

Each run is one ``astraflow run examples/<example>.yaml`` (embedded bus, local store, the example's own
workload and steps) with ``seed=r`` and ``data.shuffle_seed=r`` for seed r: the runs of one seed start from
the same model and see the same prompts in the same order. The examples are :data:`EXAMPLES` (``--examples``);
the runs go seed by seed, every example once per seed, so the examples are interleaved against the machine's
drift.

The reward windows are those of :func:`astraflow.launcher.outputs.reward_summary`, which ``astraflow run``
prints in its summary line: over the run's trainer steps (k = 20% of them, at least one), ``reward_first`` is
the mean training reward of the first k steps, ``reward_last`` that of the last k, and ``reward_best`` the
best mean of any k consecutive steps. Per run:

* ``final_over_best`` = reward_last / reward_best: 1 when the run ends at its peak, less when it learned and
  then fell back (None when reward_best is None or <= 0);
* ``gain`` = reward_last - reward_first (what the run kept) and ``best_gain`` = reward_best - reward_first
  (what it had at its best);
* ``collapsed``: final_over_best < :data:`COLLAPSED_BELOW` (0.9; None when final_over_best is None);
* ``entropy``, ``clipfrac``, ``grad_norm``: their means over the last 20% of the trainer's steps (its
  ``trainer.<policy>/metrics.jsonl``; None when it does not log one);
* ``collapse_alerts``: the launcher records (``metrics.jsonl``) whose values hold ``collapse`` = 1, an alert
  the trainer may raise (0 when none);
* ``complete``, ``steps``, ``wall_s``: from the summary (wall_s: the launcher's, or the process's when the
  run printed no summary). A run that exits non-zero or prints no summary is reported with complete false.

Printed: a line per run as it ends (stderr), a table with a row per run, per example the spread
(:func:`scripts.spread.spread`) of final_over_best and gain over the seeds, and a last JSON line
``{"metric": "stability", "runs": N, "collapsed": K, "final_over_best": [per run], "gain": [per run],
"best_gain": [per run], "examples": {example: {"final_over_best": spread, "gain": spread, "best_gain":
spread, "collapsed": k}}, "per_run": [{...}], "command": argv, "commit": short HEAD, "machine": platform and
CPU count}``. Exits 1 when a run did not complete.

The goal: 0 collapsed, and every example's gain at least what it gained at its best (gain = best_gain,
final_over_best = 1: the runs end where they peak).

Usage: ``scripts/bench_stability.py [--quick] [--examples arith-tiny,search-tiny] [--seeds N] [--steps N]
[--set KEY=VALUE ...]``. The default is every example of :data:`EXAMPLES` over 3 seeds; ``--quick`` is the
first 2 examples over 3 seeds (today the same 6 runs as the default, since there are 2 examples; it stays at 2
if more are added). Cost on 2 quiet cores: arith-tiny ~2 minutes a run (400 steps), search-tiny ~5 (300
steps), so ~21 minutes for the default. ``--steps N`` sets the first policy's steps, for a smoke run.
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

from scripts.bench_record import git_commit, machine  # noqa: E402
from scripts.spread import describe, spread  # noqa: E402

#: the CPU examples that learn, examples/<name>.yaml (arith-tiny-vllm is arith-tiny's workload on a vLLM server;
#: gsm8k-tiny, solver-verifier-tiny and plan-execute-critique-tiny are pipeline checks of 3-5 steps)
EXAMPLES = ("arith-tiny", "search-tiny")
QUICK_EXAMPLES = 2  # --quick: the first 2 of EXAMPLES
SEEDS = 3
COLLAPSED_BELOW = 0.9  # a run whose final_over_best is below this collapsed
TAIL = ("entropy", "clipfrac", "grad_norm")  # trainer figures averaged over the last 20% of steps
DIGITS = 4


def first_policy(example: str) -> str:
    """The name of the first policy of ``examples/<example>.yaml`` (the one ``reward_summary`` follows)."""
    cfg = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    return next(iter(cfg["policies"]))


def run_overrides(seed: int, policy: str, steps: int | None, extra: list[str]) -> list[str]:
    """The config overrides of seed ``seed``: ``seed``, ``data.shuffle_seed``, the first policy's ``steps``
    when ``steps`` is given, then ``extra`` (``--set``, so it can override the others)."""
    out = [f"seed={seed}", f"data.shuffle_seed={seed}"]
    if steps is not None:
        out.append(f"policies.{policy}.steps={steps}")
    return out + list(extra)


def parse_summary(stdout: str) -> dict | None:
    """The summary ``astraflow run`` prints as its last stdout line (a JSON object with ``complete``), or None
    when the last non-empty line is not one."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        summary = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return summary if isinstance(summary, dict) and "complete" in summary else None


def is_collapsed(ratio: float | None) -> bool | None:
    """Whether a run with this ``final_over_best`` collapsed (below :data:`COLLAPSED_BELOW`); None for None."""
    return None if ratio is None else ratio < COLLAPSED_BELOW


def tail_means(rows: list[dict], keys: tuple[str, ...] = TAIL) -> dict[str, float | None]:
    """Per key, its mean over the last 20% of the trainer's steps (k = max(1, steps // 5), as in
    ``reward_summary``; rows without ``step`` are skipped, and a step logged twice counts once, its newest row);
    None for a key no row of those steps has (or no rows)."""
    by_step = {r["step"]: r for r in rows if isinstance(r.get("step"), int)}
    ordered = [by_step[s] for s in sorted(by_step)]
    last = ordered[-max(1, len(ordered) // 5):] if ordered else []
    out: dict[str, float | None] = {}
    for key in keys:
        xs = [r[key] for r in last if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        out[key] = statistics.fmean(xs) if xs else None
    return out


def collapse_alerts(records: list[dict]) -> int:
    """The launcher records (``metrics.jsonl``: component, kind, policy, step, values) whose ``values`` hold
    ``collapse`` equal to 1."""
    return sum(1 for r in records if (r.get("values") or {}).get("collapse") == 1)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, DIGITS)


def run_figures(example: str, seed: int, summary: dict | None, trainer_rows: list[dict], records: list[dict],
                wall_s: float, exit_code: int | None = 0) -> dict:
    """One run's row: example, seed, exit_code, complete, steps, reward_first / reward_best / reward_last,
    final_over_best, gain, best_gain, collapsed, wall_s, collapse_alerts and the :data:`TAIL` means.

    Args:
        summary: the run's summary line (:func:`parse_summary`); None when it printed none (then complete is
            false and the reward figures are None).
        trainer_rows: the rows of ``trainer.<policy>/metrics.jsonl`` (empty when missing).
        records: the rows of the run's ``metrics.jsonl`` (empty when missing).
        wall_s: the process's wall time, used when the summary has none.
        exit_code: the process's exit status (None: it did not end, e.g. timed out); non-zero makes the run
            incomplete whatever its summary says.
    """
    s = summary or {}
    first, last, best = s.get("reward_first"), s.get("reward_last"), s.get("reward_best")
    ratio = s.get("final_over_best")  # the run summary's reward_last / reward_best
    return {
        "example": example, "seed": seed, "exit_code": exit_code,
        "complete": bool(s.get("complete")) and exit_code == 0,
        "steps": s.get("steps"),
        "reward_first": first, "reward_best": best, "reward_last": last,
        "final_over_best": _round(ratio),
        "gain": None if first is None or last is None else _round(last - first),
        "best_gain": None if first is None or best is None else _round(best - first),
        "collapsed": is_collapsed(ratio),
        "wall_s": s.get("wall_s", round(wall_s, 1)),
        "collapse_alerts": collapse_alerts(records),
        **{k: _round(v) for k, v in tail_means(trainer_rows).items()},
    }


def _jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file, skipping lines that do not parse; empty when the file is missing."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def run_one(example: str, seed: int, steps: int | None, extra: list[str], work: Path) -> dict:
    """One ``astraflow run examples/<example>.yaml`` of seed ``seed`` in a run dir under ``work``; its row
    (:func:`run_figures`). A failed run (non-zero exit, no summary, timeout) is a row with complete false, its
    stderr tail printed to stderr."""
    policy = first_policy(example)
    run_dir = work / f"{example}-s{seed}"
    cmd = [sys.executable, "-m", "astraflow", "run", str(ROOT / "examples" / f"{example}.yaml"),
           f"run=stab-{example}-s{seed}-{uuid.uuid4().hex[:8]}", f"run_dir={run_dir}",
           *run_overrides(seed, policy, steps, extra)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = None, _text(e.stdout), _text(e.stderr) + "\n(timed out after 3600 s)"
    wall = time.perf_counter() - t0
    summary = parse_summary(stdout)
    if code != 0 or summary is None:
        print(f"{example} seed {seed}: {' '.join(cmd[3:])} exited {code}"
              f"{'' if summary else ', no summary'}:\n{stderr[-3000:]}", file=sys.stderr, flush=True)
    return run_figures(example, seed, summary, _jsonl(run_dir / f"trainer.{policy}" / "metrics.jsonl"),
                       _jsonl(run_dir / "metrics.jsonl"), wall, code)


def _text(x: bytes | str | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def _fmt(x, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec)


COLUMNS = (("example", "s"), ("seed", "d"), ("complete", ""), ("steps", "d"), ("reward_first", ".3f"),
           ("reward_best", ".3f"), ("reward_last", ".3f"), ("final_over_best", ".3f"), ("gain", "+.3f"),
           ("best_gain", "+.3f"), ("collapsed", ""), ("collapse_alerts", "d"), ("entropy", ".3g"),
           ("clipfrac", ".3g"), ("grad_norm", ".3g"), ("wall_s", ".0f"))


def table(rows: list[dict]) -> str:
    """A markdown table with a row per run (:data:`COLUMNS`; ``-`` for None)."""
    out = ["| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c), spec) for c, spec in COLUMNS) + " |")
    return "\n".join(out)


def per_example(rows: list[dict]) -> dict[str, dict]:
    """Per example (in the order first run): the spread of final_over_best, gain and best_gain over its runs
    and how many of them collapsed."""
    out: dict[str, dict] = {}
    for ex in dict.fromkeys(r["example"] for r in rows):
        runs = [r for r in rows if r["example"] == ex]
        out[ex] = {k: spread([r[k] for r in runs], DIGITS) for k in ("final_over_best", "gain", "best_gain")}
        out[ex]["collapsed"] = sum(1 for r in runs if r["collapsed"] is True)
    return out


def result_line(rows: list[dict], command: list[str], commit: str | None, machine: str) -> dict:
    """The bench's last line (module docstring) from the rows of every run, in the order run."""
    return {"metric": "stability", "runs": len(rows), "collapsed": sum(1 for r in rows if r["collapsed"] is True),
            "final_over_best": [r["final_over_best"] for r in rows], "gain": [r["gain"] for r in rows],
            "best_gain": [r["best_gain"] for r in rows], "examples": per_example(rows), "per_run": rows,
            "command": list(command), "commit": commit, "machine": machine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"the first {QUICK_EXAMPLES} examples over {SEEDS} seeds")
    ap.add_argument("--examples", default=None, help=f"comma-separated (default {','.join(EXAMPLES)})")
    ap.add_argument("--seeds", type=int, default=SEEDS, help="seeds 0..N-1 (default %(default)s)")
    ap.add_argument("--steps", type=int, default=None, help="the first policy's steps (default: the example's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further config override for every run (e.g. policies.actor.trainer.lr=3e-4)")
    args = ap.parse_args()
    if args.examples:
        examples = args.examples.split(",")
    else:
        examples = list(EXAMPLES[:QUICK_EXAMPLES] if args.quick else EXAMPLES)
    missing = [ex for ex in examples if not (ROOT / "examples" / f"{ex}.yaml").exists()]
    if missing:
        ap.error(f"no examples/<name>.yaml for {', '.join(missing)}")

    rows: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-stability-") as tmp:
        for seed in range(args.seeds):
            for ex in examples:
                r = run_one(ex, seed, args.steps, args.set, Path(tmp))
                rows.append(r)
                print(f"{ex} seed {seed}: complete {_fmt(r['complete'])}, first {_fmt(r['reward_first'])} "
                      f"best {_fmt(r['reward_best'])} last {_fmt(r['reward_last'])}, final/best "
                      f"{_fmt(r['final_over_best'])}, gain {_fmt(r['gain'], '+.3f')}, collapsed "
                      f"{_fmt(r['collapsed'])}, {_fmt(r['wall_s'], '.0f')} s", file=sys.stderr, flush=True)

    print(f"\n{len(rows)} runs ({', '.join(examples)} x {args.seeds} seeds"
          f"{f', {args.steps} steps' if args.steps else ''}), {time.perf_counter() - t0:.0f} s in all")
    print(table(rows))
    line = result_line(rows, sys.argv, git_commit(), machine())
    for ex, s in line["examples"].items():
        print(f"{ex}: final/best {describe(s['final_over_best'])}; gain {describe(s['gain'], '+.3f')}; "
              f"best gain {describe(s['best_gain'], '+.3f')}; collapsed {s['collapsed']}")
    print(json.dumps(line), flush=True)
    if not all(r["complete"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
