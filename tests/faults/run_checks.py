"""Checks on an ``astraflow run`` directory shared by the fault tests."""
import json
import os
import signal
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
        assert time.monotonic() < deadline, f"{steps_trained(run_dir)} of {steps} steps by the deadline\n" \
                                            f"{log_tails(run_dir)}"
        time.sleep(0.2)


def assert_exactly_once(run: str, run_dir: Path, steps: int, bus_url: str | None = None) -> None:
    """``steps`` versions were each trained once on the lineage (1..``steps``, with a jump where a resumed
    trainer renumbered its checkpoint's weights), no group was trained twice, and every prompt the RaaS
    group committed has its group (:func:`astraflow.audit.audit_run`; ``bus_url`` defaults to the run's
    embedded bus)."""
    audit = audit_run(connect(bus_url or f"local://{run_dir / 'bus'}"), TopicNames(run), "actor", "single_turn")
    trained = [v for v in audit.versions if v not in audit.renumbered]
    assert len(trained) == steps and audit.versions == sorted(set(audit.versions)), audit.versions
    assert all(b == a + 1 or b in audit.renumbered for a, b in zip([0, *audit.versions], audit.versions)), \
        audit.versions
    assert not audit.trained_twice, f"groups trained twice: {audit.trained_twice[:5]}"
    assert audit.committed_prompts > 0 and not audit.lost, f"committed prompts without a group: {audit.lost[:5]}"


def log_tails(run_dir: Path, chars: int = 1500) -> str:
    """The last ``chars`` characters of each component log under ``run_dir/logs``, one block per log."""
    logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}" for log in logs)


def dump_stacks(run_dir: Path) -> None:
    """SIGUSR1 every live component of the run (``components.json``): each writes its threads' stacks to its log."""
    try:
        components = json.loads((run_dir / "components.json").read_text())
    except (OSError, ValueError):
        return
    for c in components.values():
        if c.get("exit_code") is not None:
            continue  # exited: its pid may be another process's by now
        try:
            os.kill(c["pid"], signal.SIGUSR1)
        except (ProcessLookupError, PermissionError, KeyError, TypeError):
            pass
    time.sleep(2.0)


def finish(launcher: subprocess.Popen, run_dir: Path, steps: int, timeout_s: float) -> tuple[dict, str]:
    """Wait up to ``timeout_s`` for the launcher to exit and check that it completed policy ``actor``'s
    ``steps`` steps (its final version is higher by the versions a trainer resume skipped). Returns (the run summary, the launcher's stderr). On a timeout or a failed run the
    assertion carries the launcher's stderr tail and every component log's tail (on a timeout, with the stacks of
    every thread of the components: what was blocked)."""
    try:
        out, err = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        dump_stacks(run_dir)
        launcher.kill()
        out, err = launcher.communicate()
        raise AssertionError(f"the run did not finish in {timeout_s} s\n{err[-3000:]}\n{log_tails(run_dir)}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, f"{err[-3000:]}\n{log_tails(run_dir)}"
    summary = json.loads(out.strip().splitlines()[-1])
    # steps counts the lineage's steps, whatever versions a resumed trainer skipped
    assert summary["complete"] is True and summary["versions"]["actor"] >= steps and summary["steps"] == steps, summary
    return summary, err
