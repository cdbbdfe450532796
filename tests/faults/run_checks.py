"""Checks on an ``astraflow run`` directory shared by the fault tests."""
import subprocess
import time
from pathlib import Path

from astraflow.audit import audit_run, steps_logged
from topics.bus import connect
from topics.names import TopicNames


def steps_trained(run_dir: Path) -> int:
    """Trainer steps of policy ``actor`` logged so far."""
    return steps_logged(run_dir, "actor")


def wait_for_steps(launcher: subprocess.Popen, run_dir: Path, steps: int, deadline: float) -> None:
    """Wait until policy ``actor`` logged ``steps`` steps; fails (with the launcher's stderr tail) if the
    launcher exits first, or at ``deadline`` (``time.monotonic()``)."""
    while steps_trained(run_dir) < steps:
        assert launcher.poll() is None, launcher.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "no training progress"
        time.sleep(0.2)


def assert_exactly_once(run: str, run_dir: Path, steps: int, bus_url: str | None = None) -> None:
    """Versions 1..``steps`` were each trained once, no group was trained twice, and every prompt the RaaS
    group committed has its group (:func:`astraflow.audit.audit_run`; ``bus_url`` defaults to the run's
    embedded bus)."""
    audit = audit_run(connect(bus_url or f"local://{run_dir / 'bus'}"), TopicNames(run), run_dir, "actor",
                      "single_turn")
    assert audit.versions == list(range(1, steps + 1)), audit.versions
    assert not audit.trained_twice, f"groups trained twice: {audit.trained_twice[:5]}"
    assert audit.committed_prompts > 0 and not audit.lost, f"committed prompts without a group: {audit.lost[:5]}"
