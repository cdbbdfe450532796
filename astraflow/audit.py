"""Exactly-once audit of a run, read from its topics.

Two questions, for one policy of a run:

- **lost**: prompts that the RaaS consumer group committed on ``prompts`` (so they will never be
  rolled out again) without a group of theirs on ``trajectories.<policy>``;
- **trained twice**: group ids that appear in more than one trained batch on ``trained``
  (:func:`trainer.service.trained_batches`; replayed groups, listed apart as ``replayed_ids``,
  do not count).

Used by the fault tests and ``scripts/chaos.py``, with :func:`steps_logged` to follow a run's progress.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from topics.bus import Bus, Record, read_topic
from topics.codec import MessageError, decode
from topics.names import TopicNames
from topics.schemas import Prompt, TrajectoryGroup
from trainer.service import trained_batches


def steps_logged(run_dir: Path, policy: str) -> int:
    """Trainer steps of ``policy`` logged so far: lines of ``<run_dir>/trainer.<policy>/metrics.jsonl``."""
    path = run_dir / f"trainer.{policy}" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@dataclass
class RunAudit:
    """What :func:`audit_run` found.

    Attributes:
        versions: the versions of the trained batches on the lineage, in order (1..steps when the run completed
            and no trainer resume skipped versions).
        renumbered: those of them that gave a resumed checkpoint's weights a new version (no training; see
            :mod:`trainer.service`): ``len(versions) - len(renumbered)`` steps were trained.
        committed_prompts: distinct prompt ids below the RaaS group's committed offsets.
        lost: prompt ids committed without a group on ``trajectories.<policy>`` (sorted).
        trained_twice: group ids trained in more than one step (sorted).
    """

    versions: list[int]
    renumbered: list[int]
    committed_prompts: int
    lost: list[str]
    trained_twice: list[str]


def _decoded(records: list[Record], kind: type, committed: dict[int, int | None] | None = None) -> list:
    """The records' messages of ``kind``, only those below ``committed`` (per partition) when given; a record that
    does not decode is left out, as the run's components dead-lettered it (a bad record is no prompt to account
    for)."""
    out = []
    for r in records:
        if committed is not None and r.offset >= (committed.get(r.partition) or 0):
            continue
        try:
            out.append(decode(r.value, kind, topic=r.topic, partition=r.partition, offset=r.offset))
        except MessageError:
            continue
    return out


def audit_run(bus: Bus, names: TopicNames, policy: str, workflow: str) -> RunAudit:
    """Audit ``policy`` of the run ``names.run`` (its RaaS group is ``raas.<workflow>``).

    Raises:
        topics.bus.BusError: the topics cannot be read within 30 s.
    """
    batches = trained_batches(bus, names, policy)
    counts = Counter(gid for b in batches for gid in b.group_ids)
    committed = bus.admin().group_offsets(names.raas_group(workflow), names.prompts)
    done = {p.prompt_id for p in _decoded(read_topic(bus, names.prompts), Prompt, committed)}
    grouped = {g.prompt_id for g in _decoded(read_topic(bus, names.trajectories(policy)), TrajectoryGroup)}
    return RunAudit(versions=[b.version for b in batches],
                    renumbered=[b.version for b in batches if b.base_version is not None], committed_prompts=len(done),
                    lost=sorted(done - grouped), trained_twice=sorted(g for g, n in counts.items() if n > 1))
