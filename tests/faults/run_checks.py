"""Checks on an ``astraflow run`` directory shared by the fault tests."""
import json
from pathlib import Path

from topics.bus import connect, read_topic
from topics.codec import decode
from topics.names import TopicNames
from topics.schemas import Prompt, TrajectoryGroup


def steps_trained(run_dir: Path) -> int:
    """Trainer steps of policy ``actor`` logged so far (lines of its ``metrics.jsonl``)."""
    path = run_dir / "trainer.actor" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def assert_trained_once(run_dir: Path, steps: int) -> None:
    """Versions 1..``steps`` were each trained once, and no group was trained twice."""
    log = run_dir / "trainer.actor" / "trained_groups.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    trained = [gid for e in entries for gid in e["group_ids"]]
    assert [e["version"] for e in entries] == list(range(1, steps + 1))
    assert len(trained) == len(set(trained)), "a group was trained twice"


def assert_committed_prompts_grouped(bus_url: str, run: str, workflow: str = "single_turn") -> None:
    """Every prompt the RaaS group committed on ``prompts`` has its group on ``trajectories.actor``."""
    bus, names = connect(bus_url), TopicNames(run)
    committed = bus.admin().group_offsets(names.raas_group(workflow), names.prompts)
    done = {decode(r.value, Prompt).prompt_id for r in read_topic(bus, names.prompts)
            if r.offset < (committed[r.partition] or 0)}
    grouped = {decode(r.value, TrajectoryGroup).prompt_id for r in read_topic(bus, names.trajectories("actor"))}
    assert done and done <= grouped, sorted(done - grouped)[:5]
