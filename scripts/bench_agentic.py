#!/usr/bin/env python
"""Agentic RL with a slow tool: the synchronous loop, the lockstep pipeline, the episode-scheduling pipeline, TRL.

The workload is search-tiny's (``examples/search-tiny.yaml``): the built-in ``tiny-search`` model, the
``search`` source, the ``search_agent`` workflow (model turn 1 ``<search>name</search>``, the search tool's
answer as context, turn 2 the answer), ``batch_groups`` prompts x G = ``data.n_samples`` samples per trainer
step, and its trainer config, for every arm. The search tool is a :class:`~producers.search_server.SearchServer`
process (``astraflow search-server``) whose per-request latency is log-normal, median ``m`` and p99 ``10 m``
(the server's own latency model, seeded); the grid runs each arm at each median ``m`` of ``--latencies``
(default 0, 0.1, 0.3, 1.0 s). The client is :class:`~producers.search_tool.SearchTool` with the example's
``tools.search.timeout_s`` (a call slower than that is an ``error: ...`` observation, as in the pipeline).

Arms:

* ``sync``: one process (``--sync-threads`` torch threads) and a search-server process. Per step it rolls out
  one batch with ALL its episodes concurrent (one asyncio loop; the episodes' engine calls batched by an
  :class:`~producers.engine_batcher.EngineBatcher` over an :class:`~producers.hf_engine.HFEngine`), trains one
  step in memory (:class:`~trainer.loop.Trainer`), loads the new weights into the engine, and again. Staleness 0.
* ``pipeline-1``: ``astraflow run examples/search-tiny.yaml`` with ``raas.max_episodes`` = G: the RaaS worker
  rolls out one prompt's episodes at a time (the lockstep behaviour before episode scheduling).
* ``pipeline``: the same with the example's ``raas.max_episodes`` (episodes of many prompts in flight).
* ``trl``: the outside baseline, TRL's ``GRPOTrainer`` (one process, ``--sync-threads`` torch threads, and a
  search-server process) with ``tools=[search]``, ``search`` a typed async function calling the same search server
  (:func:`trl_child`). TRL's tool loop parses JSON function calls from a chat template, so this arm runs
  ``tiny-search-hermes`` (``scripts/make_tiny_hermes_model.py``: the same model and calibration, its episodes in
  the hermes chat format), while the other arms run the example's tag-format model: ``trl_note`` gives both
  models' tokens per episode. Its runs are capped by ``--trl-max-run-s`` (TRL calls the tool once per completion,
  one after another: ~1.5 min per step at 0.3 s). When trl is not installed (it is only in the ``bench`` install
  profile) or cannot call tools with the model, the arm is skipped and ``trl_why`` says why
  (:func:`trl_unavailable`); a failed run's error goes to ``trl_errors``.

Per arm and latency, each repetition reports:

* **steady steps/s**: full-batch trainer steps per second, from the end of step ``--warmup`` to the end of the
  last step (``--steps``): the groups trained in those steps over ``batch_groups``, over the wall time between
  them (start-up, imports, model load excluded). Groups, not steps, because the pipeline's trainer trains a
  short batch (what it has) when a full one takes longer than its poll timeout (5 s, ``trainer/service.py``),
  which a slow tool causes: ``trainer_steps_per_s`` (steps of any size) and ``short_batches`` are reported
  too. Pipeline step ends are the ``ts`` of the trainer's per-step records in ``<run_dir>/metrics.jsonl``.
  A run stopped by ``--max-run-s`` (``max_wall_s`` for the pipeline) is timed over the steps it finished
  (``window`` in the record; when it finished no more than ``--warmup`` steps, from the end of step 1: such a
  run is rollout-bound, so its trainer has no batches rolled out ahead to drain). ``--warmup`` must cover what
  the pipeline rolls out ahead before its trainer starts (up to ``raas.max_inflight_groups / batch_groups`` = 4
  batches in the example), else the trainer drains them in the timed window and overstates the pipeline's rate.
* **CPU busy**: user + system CPU seconds of every process of the arm (the sync process and its search server;
  the launcher and every component of the pipeline, sampled every 0.5 s with psutil) over the timed window,
  divided by (window wall seconds x cores), cores = the CPUs this process may run on.
* **stale dropped**: groups the pipeline's trainer dropped as stale over the run (its last
  ``dropped_stale_total``; 0 for sync).
* **time to reward**: seconds from the end of step 1 to the end of the first step whose trailing mean reward
  (``--window`` steps) reaches ``--reward-threshold`` (default: the start reward, the mean reward of the first
  ``--window`` steps over every run, + 0.1); null when no step does.

Rounds interleave the arms (latency by latency, the arms' order rotating per round), so that load from other
processes hits every arm alike; medians over the rounds are reported with every repetition and the spread
(min, max). Each pipeline run's logs are scanned for tracebacks and ERROR lines, which are printed. Per run it
also prints the tool's observed p50 latency, its errors (timeouts) and calls, and the engine's mean rows per call.

Defaults (20 steps, 5 warm-up, runs capped at 90 s, 2 rounds, 4 latencies: 24 runs) take ~30 minutes on 2
cores; ``--quick`` (16 steps, 4 warm-up, 80 s, 1 round, latencies 0 and 0.3) ~7 (plus, once, the build of
``tiny-search`` when it is not cached: ~4 minutes).

Ends with one JSON line ``{"metric": "agentic", "latency_hidden": pipeline steps/s at 0.3 s / at 0 s,
"vs_sync": pipeline / sync steps/s at 0.3 s, "vs_trl": pipeline / trl steps/s at 0.3 s (null when the trl arm
did not run there), "trl_why": null or why not, "trl_note": what differs between the arms, "steps_per_s": {arm:
{latency: median}}, "runs": ..., "spread": ..., "cpu_busy": ..., "stale_dropped": ..., "time_to_reward_s": ...,
...}``. The reward threshold of time to reward is from the runs of our arms (the trl arm's model is another).

Usage: ``scripts/bench_agentic.py [--quick] [--latencies 0,0.1,0.3,1] [--arms sync,pipeline-1,pipeline,trl]
[--rounds N] [--steps N] [--warmup K] [--max-run-s S] [--sync-threads T] [--reward-threshold R] [--window W]
[--place KIND=CPUS[:THREADS] ...] [--set KEY=VALUE ...] [--plot PATH] [--keep-runs DIR] [--trl-max-run-s S]
[--trl-model NAME]``; a smoke run:
``--steps 6 --warmup 2 --latencies 0,0.3 --rounds 1``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.placement import placement_overrides  # noqa: E402  (after sys.path gets the repository)
from scripts.bench_staleness import moving_average  # noqa: E402

CONFIG = ROOT / "examples" / "search-tiny.yaml"
ARMS = ("sync", "pipeline-1", "pipeline", "trl")
#: p99 of the tool's latency as a multiple of its median.
P99_FACTOR = 10.0
#: The latency (median, s) at which ``vs_sync`` and ``latency_hidden`` are read.
REF_LATENCY = 0.3
#: Seconds between two CPU samples of a pipeline's processes.
CPU_SAMPLE_S = 0.5
#: Log lines worth reporting from a pipeline run.
LOG_PROBLEM = re.compile(r"Traceback|\bERROR\b|\bCRITICAL\b|Exception:")


# -- config ------------------------------------------------------------------------------------
def the_policy(cfg) -> str:
    """The example's single policy.

    Raises:
        ValueError: the config has more than one policy (the bench times one trainer).
    """
    if len(cfg.policies) != 1:
        raise ValueError(f"the config has policies {sorted(cfg.policies)}; the bench expects one")
    return next(iter(cfg.policies))


def latency_overrides(median_s: float) -> list[str]:
    """``tools.search.latency`` at median ``median_s`` and p99 :data:`P99_FACTOR` x median (none at 0)."""
    return [f"tools.search.latency.median_s={median_s!r}", f"tools.search.latency.p99_s={median_s * P99_FACTOR!r}"]


def arm_overrides(args: argparse.Namespace, arm: str, median_s: float, policy: str, group: int) -> list[str]:
    """The overrides of the example for one run of ``arm`` at tool latency ``median_s``."""
    out = [f"policies.{policy}.steps={args.steps}",
           f"policies.{policy}.checkpoint_every={args.steps}",  # one checkpoint, after the timed window
           *latency_overrides(median_s)]
    if arm == "pipeline-1":
        out.append(f"raas.max_episodes={group}")
    return out + list(args.set)


# -- measurements --------------------------------------------------------------------------------
def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def interpolate(samples: list[tuple[float, float]], t: float) -> float:
    """The value at time ``t`` of a piecewise-linear series of ``(time, value)`` (clamped at its ends)."""
    if t <= samples[0][0]:
        return samples[0][1]
    for (t0, v0), (t1, v1) in zip(samples, samples[1:]):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return samples[-1][1]


class TreeCpu:
    """Cumulative user + system CPU seconds of a process and its descendants, sampled on a thread.

    A process keeps the last value seen while it lived, so the sum never goes down when one exits.

    Args:
        pid: the root process.
    """

    def __init__(self, pid: int):
        import psutil

        self._psutil = psutil
        self.root = psutil.Process(pid)
        self.seen: dict[tuple[int, float], float] = {}
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def sample(self) -> None:
        """Record ``(time.time(), CPU seconds so far)``."""
        ps = self._psutil
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except ps.Error:
            procs = []
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    self.seen[(p.pid, p.create_time())] = t.user + t.system
            except ps.Error:
                pass
        self.samples.append((time.time(), sum(self.seen.values())))

    def _loop(self) -> None:
        while not self._stop.wait(CPU_SAMPLE_S):
            self.sample()

    def start(self) -> "TreeCpu":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def summarise(run: dict, warmup: int, n_cores: int, batch_groups: int) -> dict:
    """Steady throughput and CPU busy fraction of one run. ``run`` has ``ends`` (step -> end time), ``groups``
    (step -> groups trained in it) and ``cpu`` ([(time, CPU s)]). Adds ``window`` ([first, last] step: from
    ``warmup``, or from 1 when no more steps finished), ``steps_per_s`` (groups trained in the window over
    ``batch_groups``, per second: full-batch steps), ``trainer_steps_per_s`` (trainer steps, full or short, per
    second), ``short_batches`` (steps in the window that trained fewer than ``batch_groups`` groups) and
    ``cpu_busy``; None when fewer than 2 steps finished."""
    ends, groups = run["ends"], run["groups"]
    last = max(ends, default=0)
    # a run stopped by --max-run-s before step warmup + 1 is slow, rollout-bound, so nothing was rolled out ahead
    # of its trainer: its steady state starts at step 1
    first = warmup if last > warmup else 1
    if last <= first or first not in ends or ends[last] <= ends[first]:
        return {**run, "window": None, "steps_per_s": None, "trainer_steps_per_s": None, "short_batches": None,
                "cpu_busy": None}
    wall = ends[last] - ends[first]
    trained = [groups.get(s, batch_groups) for s in range(first + 1, last + 1)]
    cpu = interpolate(run["cpu"], ends[last]) - interpolate(run["cpu"], ends[first]) if run["cpu"] else None
    return {**run, "window": [first, last], "steps_per_s": sum(trained) / batch_groups / wall,
            "trainer_steps_per_s": (last - first) / wall, "short_batches": sum(g < batch_groups for g in trained),
            "cpu_busy": None if cpu is None else cpu / (wall * n_cores)}


def time_to_reward(run: dict, threshold: float, window: int) -> tuple[int, float] | None:
    """``(step, seconds from the end of step 1)`` of the first step whose trailing mean reward over ``window``
    steps reaches ``threshold`` (only once ``window`` steps are in it); None when none does."""
    steps = sorted(s for s in run["rewards"] if s in run["ends"])
    if not steps or steps[0] != 1:
        return None
    trailing = moving_average([run["rewards"][s] for s in steps], window)
    for i, (s, r) in enumerate(zip(steps, trailing)):
        if i + 1 >= window and r >= threshold:
            return s, run["ends"][s] - run["ends"][1]
    return None


# -- the sync arm --------------------------------------------------------------------------------
def start_search_server(median_s: float, seed: int, corpus: Path | None) -> tuple[subprocess.Popen, Callable[[], str]]:
    """Start ``astraflow search-server`` on a free port at this latency; returns the process and a function that
    waits for its URL (so the caller can load its model meanwhile). It stops when this process is gone (it
    watches it as its launcher).

    The URL function raises RuntimeError when the server exited, or did not say it serves within 120 s.
    """
    from astraflow.launched import LAUNCHER_PID_ENV

    cmd = [sys.executable, "-m", "astraflow", "search-server", "--port", "0", "--median-s", repr(median_s),
           "--p99-s", repr(median_s * P99_FACTOR), "--seed", str(seed),
           *(["--corpus", str(corpus)] if corpus is not None else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                            env=dict(os.environ, **{LAUNCHER_PID_ENV: str(os.getpid())}, OMP_NUM_THREADS="1"))
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            m = re.search(r"serving (http://\S+)", line)
            if m:
                found.append(m.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def url() -> str:
        reader.join(120.0)
        if not found:
            proc.kill()
            raise RuntimeError(f"search server did not start (exit {proc.poll()})")
        return found[0]

    return proc, url


def stop_search_server(server: subprocess.Popen) -> None:
    """SIGTERM the search server, SIGKILL it when it has not exited 10 s later."""
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()


def own_cpu_s() -> float:
    """User + system CPU seconds of this process and its descendants so far (those alive now)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in (me, *me.children(recursive=True)):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def sync_child(args: argparse.Namespace) -> None:
    """Body of the sync arm at latency ``args.latency``: roll out a batch (all its episodes concurrent), train,
    load the weights, in turn; prints one JSON line ``{"ends", "rewards", "cpu", ...}`` (times ``time.time()``)."""
    t_launch = time.time()  # --max-run-s counts from here, imports and loading included
    import asyncio

    import torch

    torch.set_num_threads(args.sync_child)
    from astraflow.config import load_config
    from producers.engine_batcher import EngineBatcher
    from producers.engines import SamplingParams
    from producers.hf_engine import HFEngine
    from producers.search_tool import SearchTool
    from producers.sources import load_source
    from producers.workflows import get_workflow
    from trainer.loop import Trainer
    from weights.models import resolve_model

    base = load_config(args.config, args.set)
    policy = the_policy(base)
    group = base.data.n_samples
    cfg = load_config(args.config, arm_overrides(args, "sync", args.latency, policy, group))
    pc, search = cfg.policies[policy], cfg.tools.search
    server, server_url = start_search_server(args.latency, search.seed, search.corpus)  # starts while we load
    try:
        model_dir = resolve_model(pc.model)
        engine = HFEngine(model_dir)
        trainer = Trainer(cfg.trainer_config(policy), model_dir)
        workflow = get_workflow(cfg.workflow.name, policies=cfg.workflow.roles or None, **cfg.workflow.options)
        src = cfg.data.sources[0]
        source = load_source(src.name, adapter=src.adapter, split=src.split, seed=cfg.seed,
                             max_prompt_chars=cfg.data.max_prompt_chars)
        sampling = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
                                  top_p=cfg.sampling.top_p)
        tool = SearchTool(server_url(), timeout_s=search.timeout_s, top_k=search.top_k)
        batcher = EngineBatcher(engine, name=policy)
        engines, tools = {p: batcher for p in set(workflow.policies.values())}, {"search": tool}
        loop = asyncio.new_event_loop()

        async def rollout(prompts: list) -> list:
            per_prompt = await asyncio.gather(*(workflow.rollout(p, engines, sampling, tools) for p in prompts))
            return [g for groups in per_prompt for g in groups if g.policy == policy]

        index, ends, rewards, trained, cpu = 0, {}, {}, {}, [(time.time(), own_cpu_s())]
        for step in range(1, args.steps + 1):
            prompts = []
            for _ in range(pc.batch_groups):
                prompts.append(source[index % len(source)].model_copy(update={"n_samples": group}))
                index += 1
            groups = loop.run_until_complete(rollout(prompts))
            metrics = trainer.train_step(groups).metrics
            engine.load_weights(trainer.publish_state(), trainer.version)
            ends[step], rewards[step], trained[step] = time.time(), float(metrics["reward_mean"]), len(groups)
            cpu.append((ends[step], own_cpu_s()))
            if time.time() - t_launch > args.max_run_s:
                break
        out = {"ends": ends, "rewards": rewards, "groups": trained, "cpu": cpu, "stale_dropped": 0,
               "capped": step < args.steps,
               "tool_p50_s": tool.percentiles().get("p50"), "tool_errors": sum(tool.errors.values()),
               "tool_calls": tool.calls, "engine_batch": batcher.rows / batcher.calls if batcher.calls else None}
        loop.run_until_complete(tool.close())
        batcher.close()
    finally:
        stop_search_server(server)
    print(json.dumps(out))


# -- the pipeline arms ---------------------------------------------------------------------------
def read_metrics(path: Path) -> dict:
    """Trainer step ends, rewards and groups trained, stale drops and the RaaS worker's last figures from a run's
    metrics.jsonl."""
    ends, rewards, groups, stale, raas = {}, {}, {}, 0, {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        values = rec.get("values") or {}
        if rec["kind"] == "trainer" and rec.get("step") is not None:
            step = int(rec["step"])
            if step not in ends:
                ends[step] = float(rec["ts"])
                if "reward_mean" in values:
                    rewards[step] = float(values["reward_mean"])
                if "groups" in values:
                    groups[step] = int(values["groups"])
            stale = max(stale, int(values.get("dropped_stale_total", 0)))
        elif rec["kind"] == "raas":
            raas = values
    return {"ends": ends, "rewards": rewards, "groups": groups, "stale_dropped": stale,
            "tool_p50_s": raas.get("tool.search.p50_s"), "tool_errors": raas.get("tool.search.errors_total"),
            "tool_calls": raas.get("tool.search.calls_total"),
            "engine_batch": next((v for k, v in raas.items() if k.startswith("engine_batch.")), None),
            "raas_paused_frac": raas.get("paused_frac")}


def log_problems(logs: Path, limit: int = 6) -> list[str]:
    """``<component>: <line>`` for the first lines of a run's logs that look like errors (tracebacks, ERROR)."""
    found = []
    for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        for line in log.read_text(errors="replace").splitlines():
            if LOG_PROBLEM.search(line):
                found.append(f"{log.stem}: {line.strip()[:240]}")
                if len(found) >= limit:
                    return found
    return found


def run_pipeline(args: argparse.Namespace, arm: str, median_s: float, policy: str, group: int) -> dict:
    """One ``astraflow run`` of ``arm`` in a fresh run directory (kept under ``--keep-runs``); returns its record.

    Raises:
        RuntimeError: the run failed (not merely stopped by ``max_wall_s``) or logged no trainer step.
    """
    keep = args.keep_runs
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="bench_agentic_")
    base = Path(keep) if keep else Path(tmp.name)
    base.mkdir(parents=True, exist_ok=True)
    run = f"bench-agentic-{arm}-{median_s:g}-{uuid.uuid4().hex[:6]}"
    run_dir = base / run
    try:
        cmd = [sys.executable, "-m", "astraflow", "run", str(args.config),
               *arm_overrides(args, arm, median_s, policy, group), *placement_overrides(args.place),
               f"max_wall_s={args.max_run_s}", f"run={run}", f"run_dir={run_dir}"]
        run_dir.mkdir(parents=True)
        with open(run_dir / "bench.stdout", "w") as so, open(run_dir / "bench.stderr", "w") as se:
            proc = subprocess.Popen(cmd, stdout=so, stderr=se, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
            sampler = TreeCpu(proc.pid).start()
            rc = proc.wait()
            sampler.stop()
        err = (run_dir / "bench.stderr").read_text(errors="replace")
        capped = "max_wall_s=" in err and "reached" in err
        metrics = run_dir / "metrics.jsonl"
        if (rc != 0 and not capped) or not metrics.is_file():
            raise RuntimeError(f"{arm} at {median_s:g} s failed (exit {rc}):\n{err[-3000:]}\n"
                               + "\n".join(log_problems(run_dir / "logs", 20)))
        rec = read_metrics(metrics)
        if not rec["ends"]:
            raise RuntimeError(f"{arm} at {median_s:g} s logged no trainer step in {args.max_run_s} s:\n{err[-2000:]}")
        rec.update(cpu=sampler.samples, capped=capped, problems=log_problems(run_dir / "logs"),
                   run_dir=str(run_dir) if keep else None)
        return rec
    finally:
        if tmp is not None:
            tmp.cleanup()


# -- TRL -----------------------------------------------------------------------------------------
#: The model of the TRL arm: the tiny search model that calls its tool in the hermes format (TRL's tool loop parses
#: JSON function calls from the chat format; the tag model's ``<search>name</search>`` is not one).
TRL_MODEL = "tiny-search-hermes"


def trl_child(args: argparse.Namespace) -> None:
    """Body of the trl arm at latency ``args.latency``: TRL's ``GRPOTrainer`` with ``tools=[search]`` on
    :data:`TRL_MODEL`, the workload's questions, G, batch, step count, learning rate, KL coefficient and
    temperature; ``search`` is a typed async function that calls the same seeded search server through
    :class:`~producers.search_tool.SearchTool`. One tool-calling iteration (search, then the answer, as the
    workflow's ``max_turns: 2``); reward 1 when the last assistant message, stripped, is the code. Prints one JSON
    line ``{"ends", "rewards", "cpu", ...}`` (times ``time.time()``) as :func:`sync_child`."""
    t_launch = time.time()
    import torch

    torch.set_num_threads(args.trl_child)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from astraflow.config import load_config
    from producers.search_tool import SearchTool
    from producers.sources import load_source
    from weights.models import resolve_model

    base = load_config(args.config, args.set)
    policy = the_policy(base)
    group = base.data.n_samples
    cfg = load_config(args.config, arm_overrides(args, "trl", args.latency, policy, group))
    pc, search_cfg = cfg.policies[policy], cfg.tools.search
    tc = cfg.trainer_config(policy)
    server, server_url = start_search_server(args.latency, search_cfg.seed, search_cfg.corpus)
    try:
        model_dir = resolve_model(args.trl_model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        src = cfg.data.sources[0]
        source = load_source(src.name, adapter=src.adapter, split=src.split, seed=cfg.seed,
                             max_prompt_chars=cfg.data.max_prompt_chars)
        n_prompts = pc.batch_groups * args.steps
        rows = [source[i % len(source)] for i in range(n_prompts)]  # the sync arm's prompts, in its order
        dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p.text.strip()}],
                                      "answer": p.answer} for p in rows])
        tool = SearchTool(server_url(), timeout_s=search_cfg.timeout_s, top_k=search_cfg.top_k)

        async def search(query: str) -> str:
            """Search the knowledge base.

            Args:
                query: what to look up
            """
            return await tool(query)

        def correct(completions: list, answer: list, **_) -> list[float]:
            """1.0 when the last assistant message of a completion, stripped, is the answer, else 0.0."""
            out = []
            for messages, want in zip(completions, answer):
                said = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
                out.append(float(bool(said) and said[-1].strip() == want))
            return out

        ends, rewards, cpu = {}, {}, [(time.time(), own_cpu_s())]

        class Clock(TrainerCallback):
            """Records each optimiser step's end and reward; stops the run after ``--max-run-s``."""

            def on_log(self, _args, state, control, logs=None, **_):
                if logs and "reward" in logs:
                    rewards[state.global_step] = float(logs["reward"])

            def on_step_end(self, _args, state, control, **_):
                ends[state.global_step] = time.time()
                cpu.append((ends[state.global_step], own_cpu_s()))
                if time.time() - t_launch > args.max_run_s:
                    control.should_training_stop = True

        out_dir = tempfile.mkdtemp(prefix="bench_agentic_trl_")
        config = GRPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, seed=cfg.seed, report_to=[], save_strategy="no",
            logging_steps=1, disable_tqdm=True, max_steps=args.steps, learning_rate=tc.lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=tc.weight_decay,
            adam_beta1=tc.betas[0], adam_beta2=tc.betas[1], max_grad_norm=tc.max_grad_norm, beta=tc.kl_coef,
            epsilon=tc.clip_low, num_generations=group, per_device_train_batch_size=pc.batch_groups * group,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=0,
            max_completion_length=TRL_COMPLETION_TOKENS, max_tool_calling_iterations=1, shuffle_dataset=False,
            generation_kwargs={"max_new_tokens": cfg.sampling.max_new_tokens},  # per turn, as the workflow's
            gradient_checkpointing=False, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=correct, args=config,
                              train_dataset=dataset, tools=[search], callbacks=[Clock()])
        trainer.train()
        done = max(ends, default=0)
        out = {"ends": ends, "rewards": rewards, "groups": {}, "cpu": cpu, "stale_dropped": 0,
               "capped": done < args.steps, "tool_p50_s": tool.percentiles().get("p50"),
               "tool_errors": sum(tool.errors.values()), "tool_calls": tool.calls, "engine_batch": None}
    finally:
        stop_search_server(server)
    print(json.dumps(out))


#: TRL's ``max_completion_length``: the most tokens of a completion, its call turn, the tool's response turn (37
#: tokens for a one-line result) and the answer (each generation is capped at ``sampling.max_new_tokens``).
TRL_COMPLETION_TOKENS = 96


def run_child(args: argparse.Namespace, arm: str, median_s: float) -> dict:
    """The sync or trl arm in a child process; returns its record (``ends``/``rewards``/``groups`` keyed by int step).

    Raises:
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    flag = "--_sync-child" if arm == "sync" else "--_trl-child"
    cmd = [sys.executable, str(Path(__file__).resolve()), flag, str(args.sync_threads),
           "--_latency", repr(median_s), f"--config={args.config}", f"--steps={args.steps}", f"--warmup={args.warmup}",
           f"--max-run-s={args.trl_max_run_s if arm == 'trl' else args.max_run_s}", f"--trl-model={args.trl_model}",
           *(f"--set={o}" for o in args.set)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS=str(args.sync_threads)))
    if out.returncode != 0:
        raise RuntimeError(f"{arm} arm failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("ends", "rewards", "groups"):
        rec[key] = {int(k): v for k, v in rec[key].items()}
    return rec


def trl_unavailable(model: str) -> str | None:
    """Why TRL's GRPOTrainer cannot run its tool loop on ``model`` here (trl not installed, or the model's chat
    template not one it can call tools with: ``trl.chat_template_utils.supports_tool_calling``), or None."""
    if importlib.util.find_spec("trl") is None:
        return (f"trl is not installed in this environment ({sys.prefix}); it is only in the `bench` install "
                "profile (scripts/install.sh bench, requirements/bench.lock)")
    try:
        import trl
        from transformers import AutoTokenizer
        from trl.chat_template_utils import supports_tool_calling

        from weights.models import resolve_model

        with contextlib.redirect_stdout(sys.stderr):
            tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
        ok = supports_tool_calling(tokenizer)
    except Exception as e:  # noqa: BLE001 - only a reason string is made here
        return f"trl imports, but its tool support could not be checked on {model} ({type(e).__name__}: {e})"
    if not ok:
        return (f"trl {trl.__version__}: GRPOTrainer(tools=...) needs a chat template that renders a tool-calling "
                f"conversation, and trl.chat_template_utils.supports_tool_calling is False for {model}'s")
    return None


def episode_tokens(model: str) -> int:
    """Tokens of one whole episode of ``model`` (the first knowledge-base entity): the tag model's
    ``<bos>question<search>name</search><result>...</result>code<eos>``, the hermes model's rendered chat
    (``calibration.json``'s ``episode_tokens``)."""
    from weights.models import resolve_model

    calibration = json.loads((resolve_model(model) / "calibration.json").read_text())
    if "episode_tokens" in calibration:
        return int(calibration["episode_tokens"])
    spec = importlib.util.spec_from_file_location("make_tiny_search_model",
                                                  ROOT / "scripts" / "make_tiny_search_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    name, text = next(iter(script.load_kb().items()))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    parts = script.episode_parts(name, text, text.rsplit(" ", 1)[1])
    return 2 + sum(len(tokenizer.encode(t, add_special_tokens=False)) for t, _ in parts)  # + <bos>, <eos>


# -- report --------------------------------------------------------------------------------------
def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def plot(results: dict, latencies: list[float], path: Path) -> None:
    """Steps/s against the tool's median latency, one line (medians) and dots (repetitions) per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, colour in zip(results, ("tab:grey", "tab:orange", "tab:blue", "tab:green")):
        meds = [median_or_none([r["steps_per_s"] for r in results[arm][m]]) for m in latencies]
        ax.plot([m for m, v in zip(latencies, meds) if v is not None], [v for v in meds if v is not None],
                "-o", color=colour, label=arm)
        for m in latencies:
            ys = [r["steps_per_s"] for r in results[arm][m] if r["steps_per_s"] is not None]
            ax.scatter([m] * len(ys), ys, color=colour, s=12, alpha=0.5)
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel(f"search tool latency, median (s; p99 = {P99_FACTOR:g} x median)")
    ax.set_ylabel("steady steps/s (full batches)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="latencies 0,0.3, 16 steps (4 warm-up), 1 round, "
                        "runs capped at 80 s")
    parser.add_argument("--latencies", default=None,
                        help="comma-separated median tool latencies, s (default 0,0.1,0.3,1; quick 0,0.3)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2; 1 quick)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 20; 16 quick: "
                        "a window of 6 steps, ~6 s, moved latency_hidden by +-0.05 between runs)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the timed window (default 5; 4 quick)")
    parser.add_argument("--max-run-s", type=float, default=None,
                        help="stop a run after this many seconds, start-up included, and time the steps it finished "
                             "(default 90; 80 quick)")
    parser.add_argument("--sync-threads", type=int, default=min(2, cores()), help="torch threads of the sync arm")
    parser.add_argument("--reward-threshold", type=float, default=None,
                        help="reward for the time-to-reward figure (default: start reward + 0.1)")
    parser.add_argument("--window", type=int, default=5, help="steps in the trailing mean reward")
    parser.add_argument("--place", action="append", default=[], metavar="KIND=CPUS[:THREADS]",
                        help="the pipeline's placement, e.g. --place trainer=0 --place raas=1")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the example for every arm (e.g. tools.search.timeout_s=2)")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of steps/s against tool latency")
    parser.add_argument("--keep-runs", type=Path, default=None, help="keep the pipeline run directories here")
    parser.add_argument("--config", type=Path, default=CONFIG,
                        help="the workload (default: examples/search-tiny.yaml); read once, at the start")
    parser.add_argument("--trl-max-run-s", type=float, default=None,
                        help="the trl arm's cap, start-up included (default 360: its tool calls run one after "
                             "another, ~1.5 min per step at 0.3 s on 2 busy cores)")
    parser.add_argument("--trl-model", default=TRL_MODEL, help="the trl arm's model (a hermes-format tool caller)")
    parser.add_argument("--_sync-child", dest="sync_child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_trl-child", dest="trl_child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_latency", dest="latency", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    q = args.quick
    args.steps = args.steps or (16 if q else 20)
    args.warmup = args.warmup if args.warmup is not None else (4 if q else 5)
    args.max_run_s = args.max_run_s or (80.0 if q else 90.0)
    args.trl_max_run_s = args.trl_max_run_s or 360.0
    if args.sync_child is not None:
        sync_child(args)
        return
    if args.trl_child is not None:
        trl_child(args)
        return
    if not args.config.is_file():
        parser.error(f"{args.config} does not exist")
    if not 0 < args.warmup < args.steps:
        parser.error(f"--warmup must be in [1, --steps), got {args.warmup} with --steps {args.steps}")
    try:
        args.latencies = [float(x) for x in (args.latencies or ("0,0.3" if q else "0,0.1,0.3,1")).split(",")]
    except ValueError:
        parser.error(f"--latencies: want comma-separated seconds, got {args.latencies!r}")
    if any(m < 0 for m in args.latencies):
        parser.error("--latencies must not be negative")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - set(ARMS):
        parser.error(f"--arms: want a subset of {','.join(ARMS)}, got {args.arms!r}")
    args.arms = [a for a in ARMS if a in arms]
    args.rounds = args.rounds or (1 if q else 2)
    # every run reads one snapshot of the config: an edit of the example while the bench runs changes no arm
    snapshot = tempfile.NamedTemporaryFile("w", prefix="bench_agentic_", suffix=".yaml", delete=False)
    snapshot.write(args.config.read_text())
    snapshot.close()
    source, args.config = args.config, Path(snapshot.name)
    try:
        bench(args, source)
    finally:
        os.unlink(snapshot.name)


def bench(args: argparse.Namespace, source: Path) -> None:
    """The grid: every arm at every latency, ``--rounds`` times, interleaved; prints the report."""
    from astraflow.config import load_config
    from weights.models import resolve_model

    latencies, arms, rounds = args.latencies, args.arms, args.rounds
    cfg = load_config(args.config, args.set)
    policy, group = the_policy(cfg), cfg.data.n_samples
    pc = cfg.policies[policy]
    n_cores = cores()
    print(f"workload: {source.name} (read once): model {pc.model}, workflow {cfg.workflow.name}, {pc.batch_groups} "
          f"prompts x G={group} per step, max_new_tokens={cfg.sampling.max_new_tokens}, "
          f"max_staleness={pc.max_staleness}, raas.max_episodes={cfg.raas.max_episodes} (pipeline-1: {group}), "
          f"tool timeout {cfg.tools.search.timeout_s} s; {args.steps} steps per run, timed after {args.warmup}, "
          f"runs capped at {args.max_run_s:g} s; latencies (median s, p99 = {P99_FACTOR:g}x) {latencies}; arms {arms}; "
          f"{rounds} round(s); {n_cores} cores; sync threads {args.sync_threads}", flush=True)
    with contextlib.redirect_stdout(sys.stderr):  # its build log (tiny-search: a few minutes, once) stays off stdout
        resolve_model(pc.model)  # built here, not inside a timed run
        # (resolving the trl arm's model, built here when missing)
        trl_why = trl_unavailable(args.trl_model) if "trl" in arms else "the trl arm was not asked for (--arms)"
    if "trl" in arms and trl_why is not None:
        print(f"trl arm not run: {trl_why}", flush=True)
        arms = [a for a in arms if a != "trl"]
    trl_errors: list[str] = []

    results: dict[str, dict[float, list[dict]]] = {a: {m: [] for m in latencies} for a in arms}
    t_bench = time.monotonic()
    for r in range(rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for m in latencies:
            for arm in order:
                t0 = time.monotonic()
                try:
                    rec = (run_child(args, arm, m) if arm in ("sync", "trl")
                           else run_pipeline(args, arm, m, policy, group))
                except RuntimeError as e:
                    if arm != "trl":
                        raise
                    trl_errors.append(f"latency {m:g} s: {e}")
                    print(f"round {r + 1}: trl        latency {m:g} s failed: {e}", flush=True)
                    continue
                rec = summarise(rec, args.warmup, n_cores, pc.batch_groups)
                results[arm][m].append(rec)
                print(f"round {r + 1}: {arm:<10} latency {m:g} s: {fmt(rec['steps_per_s'])} steps/s (trainer steps/s "
                      f"{fmt(rec['trainer_steps_per_s'])}, {rec['short_batches']} short; steps {rec['window']}"
                      f"{', capped' if rec['capped'] else ''}), cpu busy "
                      f"{fmt(rec['cpu_busy'], '.2f')}, stale dropped {rec['stale_dropped']}, tool p50 "
                      f"{fmt(rec['tool_p50_s'])} s, errors {rec['tool_errors']}/{rec['tool_calls']}, engine batch "
                      f"{fmt(rec['engine_batch'], '.1f')}; {time.monotonic() - t0:.0f} s", flush=True)
                for line in rec.get("problems") or []:
                    print(f"    log: {line}", flush=True)

    # the reward threshold: the start reward (first --window steps, every run of our arms: the trl arm's model is
    # another one) + 0.1, unless given
    firsts = [rec["rewards"][s] for a in arms if a != "trl" for m in latencies for rec in results[a][m]
              for s in range(1, args.window + 1) if s in rec["rewards"]]
    start_reward = statistics.fmean(firsts) if firsts else None
    threshold = args.reward_threshold if args.reward_threshold is not None else (
        None if start_reward is None else start_reward + 0.1)
    for a in arms:
        for m in latencies:
            for rec in results[a][m]:
                hit = time_to_reward(rec, threshold, args.window) if threshold is not None else None
                rec["reward_step"], rec["time_to_reward_s"] = hit if hit else (None, None)

    def table(key: str) -> dict:
        return {a: {f"{m:g}": [None if rec[key] is None else round(rec[key], 4) for rec in results[a][m]]
                    for m in latencies} for a in arms}

    runs = table("steps_per_s")
    med = {a: {k: median_or_none(v) for k, v in runs[a].items()} for a in arms}
    spread = {a: {k: [min(x for x in v if x is not None), max(x for x in v if x is not None)]
                  if any(x is not None for x in v) else None for k, v in runs[a].items()} for a in arms}
    cpu = table("cpu_busy")
    raw = table("trainer_steps_per_s")
    short = {a: {f"{m:g}": [rec["short_batches"] for rec in results[a][m]] for m in latencies} for a in arms}
    ttr = table("time_to_reward_s")
    stale = {a: {f"{m:g}": [rec["stale_dropped"] for rec in results[a][m]] for m in latencies} for a in arms}

    print(f"\nsteady steps/s (full batches: groups trained / {pc.batch_groups}), median over {rounds} round(s) "
          f"[min, max]; trainer steps/s (median); short batches; cpu busy (median); stale dropped; time to reward "
          f"{fmt(threshold)} (s after step 1):")
    for a in arms:
        for m in latencies:
            k = f"{m:g}"
            print(f"  {a:<10} {m:>5g} s: {fmt(med[a][k]):>7} {spread[a][k]}  trainer {fmt(median_or_none(raw[a][k]))}"
                  f"  short {short[a][k]}  cpu {fmt(median_or_none(cpu[a][k]), '.2f')}  stale {stale[a][k]}"
                  f"  to reward {ttr[a][k]}")
    ref, zero = f"{REF_LATENCY:g}", "0"

    def ratio(x: float | None, y: float | None) -> float | None:
        return round(x / y, 3) if x is not None and y else None

    pipe = med.get("pipeline", {})
    latency_hidden = ratio(pipe.get(ref), pipe.get(zero))
    vs_sync = ratio(pipe.get(ref), med.get("sync", {}).get(ref))
    vs_lockstep = ratio(pipe.get(ref), med.get("pipeline-1", {}).get(ref))
    vs_trl = ratio(pipe.get(ref), med.get("trl", {}).get(ref))
    if trl_why is None and vs_trl is None:
        trl_why = ("the trl arm ran but gave no steps/s at the reference latency"
                   + (": " + " | ".join(trl_errors) if trl_errors else " (fewer than 2 steps in --trl-max-run-s)"))
    trl_note = None
    if "trl" in arms:
        tokens = {pc.model: episode_tokens(pc.model), args.trl_model: episode_tokens(args.trl_model)}
        if pc.model == args.trl_model:
            models = (f"every arm runs {pc.model} ({tokens[pc.model]} tokens per episode; the pipeline through "
                      f"the workflow {cfg.workflow.name})")
        else:
            models = (f"the pipeline arms run {pc.model} ({tokens[pc.model]} tokens per episode); the trl arm runs "
                      f"{args.trl_model} (hermes <tool_call> JSON in a chat template, {tokens[args.trl_model]} tokens "
                      f"per episode, {tokens[args.trl_model] / tokens[pc.model]:.2f}x)")
        trl_note = (models + ". Same questions, G, batch, steps, lr, KL coefficient, temperature, search server and "
                    "latency; TRL's GRPOTrainer calls the tools of one completion after another "
                    "(trl/trainer/grpo_trainer.py, _tool_call_loop), so at latency m a step waits ~batch x mean "
                    "latency on the tool")
    print(f"latency_hidden (pipeline at {ref} s / at 0 s): {latency_hidden}; vs_sync at {ref} s: {vs_sync}; "
          f"vs pipeline-1 at {ref} s: {vs_lockstep}; vs_trl at {ref} s: {vs_trl}"
          + (f" ({trl_note})" if trl_note else "") + (f"\ntrl: {trl_why}" if trl_why else ""), flush=True)
    if args.plot is not None:
        plot(results, latencies, args.plot)
        print(f"plot: {args.plot}", flush=True)
    print(json.dumps({
        "metric": "agentic", "unit": "steps/s", "value": pipe.get(ref), "latency_hidden": latency_hidden,
        "vs_sync": vs_sync, "vs_pipeline_1": vs_lockstep, "vs_trl": vs_trl, "trl_why": trl_why,
        "trl_note": trl_note, "trl_errors": trl_errors,
        "ref_latency_s": REF_LATENCY, "latencies_s": latencies, "p99_factor": P99_FACTOR, "arms": arms,
        "steps_per_s": med, "runs": runs, "spread": spread, "trainer_steps_per_s": raw, "short_batches": short,
        "cpu_busy": cpu,
        "cpu_busy_median": {a: {k: median_or_none(v) for k, v in cpu[a].items()} for a in arms},
        "stale_dropped": stale, "time_to_reward_s": ttr,
        "reward_step": {a: {f"{m:g}": [rec["reward_step"] for rec in results[a][m]] for m in latencies} for a in arms},
        "reward_threshold": None if threshold is None else round(threshold, 4),
        "start_reward": None if start_reward is None else round(start_reward, 4),
        "windows": {a: {f"{m:g}": [rec["window"] for rec in results[a][m]] for m in latencies} for a in arms},
        "capped": {a: {f"{m:g}": [rec["capped"] for rec in results[a][m]] for m in latencies} for a in arms},
        "tool_p50_s": table("tool_p50_s"), "engine_batch": table("engine_batch"),
        "rounds": rounds, "steps": args.steps, "warmup": args.warmup, "max_run_s": args.max_run_s,
        "batch_groups": pc.batch_groups, "group": group, "max_episodes": cfg.raas.max_episodes,
        "config": str(source), "sync_threads": args.sync_threads, "cores": n_cores, "placement": args.place,
        "model": pc.model, "trl_model": args.trl_model if "trl" in arms else None,
        "trl_max_run_s": args.trl_max_run_s,
        "bench_wall_s": round(time.monotonic() - t_bench, 1)}))


if __name__ == "__main__":
    main()
