"""Exactly-once audit of a run, read from its topics and its trainer's log.

Two questions, for one policy of a run:

- **lost**: prompts that the RaaS consumer group committed on ``prompts`` (so they will never be
  rolled out again) without a group of theirs on ``trajectories.<policy>``;
- **trained twice**: group ids that appear in more than one trained batch of the trainer's
  ``trained_groups.jsonl`` (replayed groups, listed apart as ``replayed_ids``, do not count).

Used by the fault tests and ``scripts/chaos.py``, with :func:`steps_logged` to follow a run's progress.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from topics.bus import Bus, read_topic
from topics.codec import decode
from topics.names import TopicNames
from topics.schemas import Prompt, TrajectoryGroup
from trainer.service import TRAINED_LOG


def steps_logged(run_dir: Path, policy: str) -> int:
    """Trainer steps of ``policy`` logged so far: lines of ``<run_dir>/trainer.<policy>/metrics.jsonl``."""
    path = run_dir / f"trainer.{policy}" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@dataclass
class RunAudit:
    """What :func:`audit_run` found.

    Attributes:
        versions: the versions in the trainer's log, in order (1..steps when each was trained once).
        committed_prompts: distinct prompt ids below the RaaS group's committed offsets.
        lost: prompt ids committed without a group on ``trajectories.<policy>`` (sorted).
        trained_twice: group ids trained in more than one step (sorted).
    """

    versions: list[int]
    committed_prompts: int
    lost: list[str]
    trained_twice: list[str]


def audit_run(bus: Bus, names: TopicNames, run_dir: Path, policy: str, workflow: str) -> RunAudit:
    """Audit ``policy`` of the run ``names.run`` whose directory is ``run_dir``.

    Raises:
        topics.bus.BusError: the topics cannot be read within 30 s.
        FileNotFoundError: the trainer wrote no ``trained_groups.jsonl``.
    """
    entries = [json.loads(line) for line in (run_dir / f"trainer.{policy}" / TRAINED_LOG).read_text().splitlines()]
    counts = Counter(gid for e in entries for gid in e["group_ids"])
    committed = bus.admin().group_offsets(names.raas_group(workflow), names.prompts)
    done = {decode(r.value, Prompt).prompt_id for r in read_topic(bus, names.prompts)
            if r.offset < (committed.get(r.partition) or 0)}
    grouped = {decode(r.value, TrajectoryGroup).prompt_id for r in read_topic(bus, names.trajectories(policy))}
    return RunAudit(versions=[e["version"] for e in entries], committed_prompts=len(done),
                    lost=sorted(done - grouped), trained_twice=sorted(g for g, n in counts.items() if n > 1))
