"""A component that dies leaves nothing running: the launcher SIGKILLs what is left of its process group (each
component leads its own session) before restarting it, as with the ranks of a SIGKILLed ``torchrun``. Real
processes: a shell that starts two children, killed with SIGKILL."""
import os
import signal
import sys
import time
from pathlib import Path

from rich.console import Console

from astraflow.config import load_config
from astraflow.launcher.plan import Component
from astraflow.launcher.run import Launcher
from astraflow.launcher.supervision import Supervisor
from topics.layout import ensure_run_topics

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
    pids = tmp_path / "children"
    script = f"sleep 300 & echo $! > {pids}; sleep 300 & echo $! >> {pids}; wait"
    comp = Component("trainer.actor", ["bash", "-c", script], tmp_path / "trainer.log")
    supervisor = Supervisor(cfg, [comp], Console(stderr=True))
    supervisor.start(comp)
    deadline = time.monotonic() + 10
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline, "the shell did not start its children"
        time.sleep(0.05)
    children = [int(p) for p in pids.read_text().split()]
    assert all(_alive(p) for p in children)
    os.kill(comp.proc.pid, signal.SIGKILL)  # the leader only, as a SIGKILL of torchrun is
    comp.proc.wait(timeout=10)
    assert all(_alive(p) for p in children)  # orphans: still running
    assert supervisor.supervise() == []  # reports the death, schedules the restart, kills the group
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children):
        assert time.monotonic() < deadline, f"children {children} outlived their component"
        time.sleep(0.05)
    assert comp.restart_at is not None and comp.restarts == 1


def test_the_watchdog_names_workers_held_by_an_operators_pause_or_throttle(tmp_path):
    """A trainer stalled because ``astraflow control`` paused or throttled the workers: the watchdog line names
    them (it said "no RaaS worker reports a pause", since ``paused`` is backpressure alone)."""
    import io

    from astraflow.monitor import RunMonitor
    from topics.bus import connect
    from topics.codec import encode, headers_for
    from topics.names import TopicNames
    from topics.schemas import Metric

    example = ROOT / "examples" / "arith-tiny.yaml"
    cfg = load_config(example, [f"run_dir={tmp_path}", f"bus=local://{tmp_path / 'bus'}", "watchdog_s=1"])
    bus, names = connect(cfg.bus), TopicNames(cfg.run)
    ensure_run_topics(bus.admin(), names, list(cfg.policies))
    producer = bus.producer()
    for worker, values in (("raas-0", {"paused": 0.0, "paused_by_control": 1.0, "throttled": 0.0}),
                           ("raas-1", {"paused": 1.0, "paused_by_control": 0.0, "throttled": 1.0}),
                           ("raas-2", {"paused": 0.0, "paused_by_control": 0.0, "throttled": 0.0})):
        m = Metric(component=worker, kind="raas", values=values)
        producer.send(names.metrics, encode(m), key=worker, headers=headers_for(m))
    producer.flush()
    monitor = RunMonitor(bus, names, list(cfg.policies), cfg.workflow.name)
    try:
        deadline = time.monotonic() + 10
        while len(monitor.components) < 3:
            assert time.monotonic() < deadline, "the metrics were not read"
            monitor.poll(0.5)
        assert monitor.controlled_workers() == {"raas-0": "paused", "raas-1": "throttled"}
        out = io.StringIO()
        watchdog = Launcher(cfg, example, [], Console(file=out, width=400)).watchdog
        watchdog.look(monitor)  # the version is seen
        watchdog._stall = {p: (v, s - 5, t - 5) for p, (v, s, t) in watchdog._stall.items()}
        watchdog.look(monitor)  # 5 s later, past watchdog_s
    finally:
        monitor.close()
    line = out.getvalue()
    assert "watchdog: trainer.actor has been at version" in line
    assert "paused: raas-1 (reason in their logs); held by astraflow control: raas-0 (paused), raas-1 (throttled)" \
        in line, line
