"""A component that dies leaves nothing running: the launcher SIGKILLs what is left of its process group (each
component leads its own session) before restarting it, as with the ranks of a SIGKILLed ``torchrun``. Real
processes: a shell that starts two children, killed with SIGKILL."""
import os
import signal
import time
from pathlib import Path

from astraflow.config import load_config
from astraflow.launcher import Component, Launcher

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_the_children_of_a_dead_component_are_killed_before_its_restart(tmp_path):
    example = ROOT / "examples" / "arith-tiny.yaml"
    cfg = load_config(example, [f"run_dir={tmp_path}"])
    launcher = Launcher(cfg, example, [])
    pids = tmp_path / "children"
    script = f"sleep 300 & echo $! > {pids}; sleep 300 & echo $! >> {pids}; wait"
    comp = Component("trainer.actor", ["bash", "-c", script], tmp_path / "trainer.log")
    launcher.components = [comp]
    launcher._start(comp)
    deadline = time.monotonic() + 10
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline, "the shell did not start its children"
        time.sleep(0.05)
    children = [int(p) for p in pids.read_text().split()]
    assert all(_alive(p) for p in children)
    os.kill(comp.proc.pid, signal.SIGKILL)  # the leader only, as a SIGKILL of torchrun is
    comp.proc.wait(timeout=10)
    assert all(_alive(p) for p in children)  # orphans: still running
    assert launcher._supervise() == []  # reports the death, schedules the restart, kills the group
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children):
        assert time.monotonic() < deadline, f"children {children} outlived their component"
        time.sleep(0.05)
    assert comp.restart_at is not None and comp.restarts == 1
