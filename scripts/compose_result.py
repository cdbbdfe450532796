#!/usr/bin/env python
"""Read a docker-compose run of ``examples/arith-tiny.yaml`` from the host, through the ports it publishes
(scripts/compose_check.sh; docs/guides/compose.md).

Three reads, each of a different way in:

* the S3 store (``--s3``, the SeaweedFS gateway): the run's weight versions (:class:`weights.store.WeightStore`)
  and the size of the newest stored object, fetched;
* the metrics endpoint (``--metrics``, the exporter): its ``astraflow_*`` sample lines about reward and version;
* Kafka (``--bootstrap``), as a consumer group of its own (``--group``) attached from the host: the trainer's
  reward per step on ``metrics`` (:class:`astraflow.monitor.RunMonitor`) and the offsets the broker then holds
  for the group (``group_committed``: records of ``metrics`` committed), ``reward_first`` / ``reward_last`` (:func:`astraflow.launcher.outputs.reward_summary`:
  the mean over the first and the last 20% of steps) and the exactly-once audit (:func:`astraflow.audit.audit_run`:
  ``lost``, committed prompts without a group, and groups trained twice).

Prints the findings and ends with one JSON line: ``{"versions": [first, last, count], "newest_object_bytes": ...,
"metrics_lines": ..., "steps_read": ..., "reward_first": ..., "reward_last": ..., "lost": ..., "trained_twice": ...,
"committed_prompts": ..., "group": ...}``. Exits 1 when a read fails.

Usage: ``scripts/compose_result.py --bootstrap HOST:PORT --s3 URL --metrics URL [--group NAME] [--steps N]``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astraflow.audit import audit_run  # noqa: E402
from astraflow.launcher.outputs import reward_summary  # noqa: E402
from astraflow.monitor import RunMonitor  # noqa: E402
from topics.bus import connect  # noqa: E402
from topics.names import TopicNames  # noqa: E402
from weights.store import WeightStore  # noqa: E402

RUN, POLICY, WORKFLOW = "arith-tiny", "actor", "single_turn"  # examples/arith-tiny.yaml


def store_result(s3: str) -> dict:
    """The run's weight versions in the S3 store at endpoint ``s3`` (credentials from the environment) and the
    size in bytes of the newest version's object, read back."""
    store = WeightStore("s3://astraflow/weights", RUN, endpoint=s3, region="us-east-1")
    versions = store.versions(POLICY)
    if not versions:
        raise RuntimeError(f"no weight version of {RUN}/{POLICY} in s3://astraflow/weights at {s3}")
    newest = max(versions)
    obj = next(iter(versions[newest].values()))
    data = store.get(obj.key)
    print(f"S3 {s3}: {len(versions)} versions kept, {min(versions)}..{newest}; newest {obj.key}: {len(data)} bytes")
    return {"versions": [min(versions), newest, len(versions)], "newest_object_bytes": len(data)}


def metrics_result(url: str) -> dict:
    """The exporter's sample lines at ``url`` that name a reward or a version."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("astraflow_") and ("reward" in ln or "version" in ln)]
    print(f"metrics {url}:")
    for line in lines[:12]:
        print(f"  {line}")
    return {"metrics_lines": len(lines)}


def kafka_result(bootstrap: str, group: str, steps: int, timeout_s: float) -> dict:
    """The run's reward per trainer step read by consumer group ``group`` (until ``steps`` steps or ``timeout_s``),
    its reward_first / reward_last, and the audit of the run's topics."""
    bus = connect(f"kafka://{bootstrap}")
    names = TopicNames(RUN)
    monitor = RunMonitor(bus, names, [POLICY], WORKFLOW, group=group)
    try:
        deadline = time.monotonic() + timeout_s
        while len(dict(monitor.views[POLICY].history)) < steps and time.monotonic() < deadline:
            monitor.poll(1.0)
        monitor.commit()
        history = monitor.views[POLICY].history
    finally:
        monitor.close()
    first, last, _ = reward_summary(history)
    # the broker's record of the group: its committed offsets on `metrics`
    committed = sum(o for o in bus.admin().group_offsets(group, names.metrics).values() if o is not None)
    audit = audit_run(bus, names, POLICY, WORKFLOW)
    print(f"Kafka {bootstrap}, group {group}: {len(dict(history))} trainer steps read, {committed} records of "
          f"{names.metrics} committed; reward_first {first}, reward_last {last}; {audit.committed_prompts} prompts "
          f"committed by the RaaS group, {len(audit.lost)} lost, {len(audit.trained_twice)} groups trained twice")
    return {"steps_read": len(dict(history)), "group_committed": committed,
            "reward_first": None if first is None else round(first, 4),
            "reward_last": None if last is None else round(last, 4), "lost": len(audit.lost),
            "trained_twice": len(audit.trained_twice), "committed_prompts": audit.committed_prompts, "group": group}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True, help="Kafka's published listener, HOST:PORT")
    ap.add_argument("--s3", required=True, help="the S3 endpoint, http://HOST:PORT")
    ap.add_argument("--metrics", required=True, help="the exporter's metrics URL")
    ap.add_argument("--group", default=f"compose-check.{int(time.time())}", help="the host's consumer group")
    ap.add_argument("--steps", type=int, default=400, help="trainer steps to read (the config's steps)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="seconds to read them in")
    a = ap.parse_args()
    result: dict = {}
    try:
        result |= store_result(a.s3)
        result |= metrics_result(a.metrics)
        result |= kafka_result(a.bootstrap, a.group, a.steps, a.timeout_s)
    except Exception as e:  # one line naming the read that failed
        print(f"compose_result: {type(e).__name__}: {e}", file=sys.stderr)
        print(json.dumps(result))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
