"""Checks on an ``astraflow run`` directory shared by the fault tests."""
import json
from pathlib import Path


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
