#!/usr/bin/env python
"""Chaos run: ``examples/arith-tiny.yaml`` on Kafka while components are killed and the broker bounces.

The run gets its own one-node broker (``scripts/kafka-local.sh`` on ``--port``), so bouncing it
disturbs nothing else. While the run trains, every ``--kill-every`` seconds (+-25%, seeded) a random
live component (the RaaS worker, acquisition, the filter processor or the trainer, found through the
launcher's ``components.json``) gets SIGKILL; once, when half of the steps are trained, the broker is
stopped for ``--outage-s`` seconds and started again. Kills stop once 90% of the steps are trained, so
the run can finish. Then the run is audited (:mod:`astraflow.audit`): committed prompts without their
group (``lost``) and groups trained twice.

Prints each fault as it happens and ends with one JSON line::

    {"metric": "chaos", "steps": ..., "complete": ..., "kills": ..., "killed": [...], "broker_bounces": ...,
     "restarts": ..., "lost": ..., "trained_twice": ..., "committed_prompts": ..., "reward_first": ...,
     "reward_last": ..., "wall_s": ...}

(``restarts``: the launcher's restarts of all components, from ``components.json``, so also for a failed run.)

and exits 1 when the run did not complete, lost a committed prompt, trained a group twice, or its
reward did not rise (``reward_last`` <= ``reward_first``: the mean training reward over the last and the
first 20% of steps).

Usage: ``scripts/chaos.py [--quick] [--steps N] [--kill-every S] [--outage-s S] [--seed N] [--port P]
[--run-dir DIR] [--timeout-s S]``. ``--quick``: 150 steps, a kill every ~15 s, a 15 s outage.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.audit import audit_run, steps_logged  # noqa: E402
from topics.bus import connect  # noqa: E402
from topics.names import TopicNames  # noqa: E402

KILLABLE = ("raas-0", "acquire", "policy.actor", "trainer.actor")


def broker(action: str, port: int) -> None:
    """``scripts/kafka-local.sh <action>`` for the broker on ``port``."""
    subprocess.run(["scripts/kafka-local.sh", action], cwd=ROOT, check=True, timeout=300,
                   env=dict(os.environ, KAFKA_PORT=str(port)), stdout=subprocess.DEVNULL)


def restarts(run_dir: Path) -> int | None:
    """Restarts of every component, from the launcher's ``components.json`` (written at each start and exit, so it
    holds them also when the run failed and printed no summary); None when it cannot be read."""
    try:
        return sum(e["restarts"] for e in json.loads((run_dir / "components.json").read_text()).values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def live_components(run_dir: Path) -> dict[str, int]:
    """Killable component name -> pid, for those running now (``components.json``)."""
    try:
        entries = json.loads((run_dir / "components.json").read_text())
    except (OSError, ValueError):
        return {}
    return {n: e["pid"] for n, e in entries.items() if n in KILLABLE and e["exit_code"] is None and e["pid"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="150 steps, a kill every ~15 s, a 15 s outage")
    ap.add_argument("--steps", type=int, help="trainer steps of the run (default 400; 150 quick)")
    ap.add_argument("--kill-every", type=float, help="mean seconds between SIGKILLs, +-25%% (default 20; 15 quick)")
    ap.add_argument("--outage-s", type=float, help="seconds the broker stays down, once, at half the steps (default 30; 15 quick)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill times and victims")
    ap.add_argument("--port", type=int, default=19392, help="the private broker's port (the next one is its controller's)")
    ap.add_argument("--run-dir", type=Path, help="parent of the run directory (default: a new temp dir)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="stop the run (SIGINT) after this many seconds")
    a = ap.parse_args()
    steps = a.steps or (150 if a.quick else 400)
    kill_every = a.kill_every or (15.0 if a.quick else 20.0)
    outage_s = a.outage_s or (15.0 if a.quick else 30.0)
    rng = random.Random(a.seed)
    run = f"chaos{uuid.uuid4().hex[:8]}"
    run_dir = (a.run_dir or Path(tempfile.mkdtemp(prefix="chaos-"))).absolute() / run
    run_dir.mkdir(parents=True)
    bus_url = f"kafka://127.0.0.1:{a.port}"

    broker("start", a.port)
    kills, bounces = [], 0
    t0 = time.monotonic()
    try:
        with open(run_dir / "launcher.out", "w") as out, open(run_dir / "launcher.err", "w") as err:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml", f"run={run}",
                 f"run_dir={run_dir}", f"bus={bus_url}", f"policies.actor.steps={steps}",
                 "policies.actor.checkpoint_every=10"],
                cwd=ROOT, stdout=out, stderr=err, env=dict(os.environ, COLUMNS="160"))
        print(f"chaos: run {run} in {run_dir} on {bus_url}: {steps} steps, a kill every ~{kill_every:.0f} s, "
              f"one {outage_s:.0f} s broker outage", flush=True)
        next_kill = time.monotonic() + kill_every
        while launcher.poll() is None:
            if time.monotonic() - t0 > a.timeout_s:
                print(f"chaos: no end after {a.timeout_s:.0f} s; stopping the run", flush=True)
                launcher.send_signal(signal.SIGINT)
                launcher.wait(300)
                break
            done = steps_logged(run_dir, "actor")
            if not bounces and done >= steps // 2:
                print(f"chaos: {time.monotonic() - t0:.0f} s, step {done}: broker down for {outage_s:.0f} s",
                      flush=True)
                broker("stop", a.port)
                time.sleep(outage_s)
                broker("start", a.port)
                bounces += 1
                next_kill = time.monotonic() + kill_every
            elif time.monotonic() >= next_kill and done < 0.9 * steps:
                live = live_components(run_dir)
                if live:
                    name = rng.choice(sorted(live))
                    try:
                        os.kill(live[name], signal.SIGKILL)
                        kills.append(name)
                        print(f"chaos: {time.monotonic() - t0:.0f} s, step {done}: SIGKILL {name} "
                              f"(pid {live[name]})", flush=True)
                    except ProcessLookupError:
                        pass
                next_kill = time.monotonic() + kill_every * rng.uniform(0.75, 1.25)
            time.sleep(0.2)
        lines = (run_dir / "launcher.out").read_text().strip().splitlines()
        try:
            summary = json.loads(lines[-1]) if lines else {}
        except ValueError:
            summary = {}
        audit = audit_run(connect(bus_url), TopicNames(run), "actor", "single_turn")
    finally:
        broker("stop", a.port)
    complete = bool(summary.get("complete")) and launcher.returncode == 0
    # steps trained on the lineage (a trainer resume that renumbered its checkpoint's weights skips versions)
    result = {"metric": "chaos", "steps": len(audit.versions) - len(audit.renumbered), "complete": complete,
              "kills": len(kills), "killed": sorted(set(kills)), "broker_bounces": bounces,
              "restarts": restarts(run_dir), "lost": len(audit.lost), "trained_twice": len(audit.trained_twice),
              "committed_prompts": audit.committed_prompts, "reward_first": summary.get("reward_first"),
              "reward_last": summary.get("reward_last"), "wall_s": round(time.monotonic() - t0, 1)}
    if not complete:
        print(f"chaos: the run did not complete (exit code {launcher.returncode}); see {run_dir / 'launcher.err'}")
    rises = None not in (result["reward_first"], result["reward_last"]) and \
        result["reward_last"] > result["reward_first"]
    print(json.dumps(result))
    return 0 if complete and rises and not audit.lost and not audit.trained_twice else 1


if __name__ == "__main__":
    sys.exit(main())
