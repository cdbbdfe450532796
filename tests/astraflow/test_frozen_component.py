"""A component frozen whole (a C call that holds the interpreter lock: no thread of it runs, not even its watch on
the launcher) is killed by the launcher once its heartbeat file goes stale, after writing its stacks to its log, and
is restarted; a component that only sleeps keeps beating and is left alone. Real processes: the frozen one sleeps
in libc's ``sleep`` called through ``ctypes.PyDLL``, which keeps the interpreter lock (called again when a signal
ends it)."""
import io
import os
import signal
import sys
import time
from pathlib import Path

from rich.console import Console

from astraflow.config import load_config
from astraflow.launcher import supervision
from astraflow.launcher.plan import Component
from astraflow.launcher.supervision import Supervisor

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = """
import ctypes, faulthandler, signal, threading, time
from astraflow.launched import watch_launcher
faulthandler.register(signal.SIGUSR1, all_threads=True)
watch_launcher("stand-in", threading.Event())
time.sleep(1.5)
print("ready", flush=True)
{wait}
"""


def test_a_frozen_component_is_killed_with_its_stacks_and_restarted_and_a_sleeping_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(supervision, "FROZEN_S", 8.0)
    cfg = load_config(ROOT / "examples" / "arith-tiny.yaml", [f"run_dir={tmp_path}"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    frozen_wait = "while True: ctypes.PyDLL(None).sleep(300)"
    frozen = Component("raas-0", [sys.executable, "-c", STAND_IN.format(wait=frozen_wait)],
                       tmp_path / "logs" / "raas-0.log", env=env)
    sleeping = Component("acquire", [sys.executable, "-c", STAND_IN.format(wait="time.sleep(300)")],
                         tmp_path / "logs" / "acquire.log", env=env)
    out = io.StringIO()
    supervisor = Supervisor(cfg, [frozen, sleeping], Console(file=out, width=400))
    for c in (frozen, sleeping):
        supervisor.start(c)
    try:
        deadline = time.monotonic() + 60
        while not all("ready" in c.log.read_text() for c in (frozen, sleeping)):
            assert time.monotonic() < deadline and frozen.proc.poll() is None, "the stand-ins did not start"
            time.sleep(0.05)
        assert supervision.heartbeat_file(frozen).exists() and supervision.heartbeat_file(sleeping).exists()

        first = frozen.proc
        deadline = time.monotonic() + 60
        while first.poll() is None:
            assert time.monotonic() < deadline, f"the frozen stand-in was not killed\n{out.getvalue()}"
            supervisor.supervise()
            time.sleep(0.2)
        assert first.returncode == -signal.SIGKILL
        assert sleeping.proc.poll() is None, "the sleeping stand-in was killed"
        flat = " ".join(out.getvalue().split())
        assert "watchdog: raas-0 has run no Python for" in flat and "acquire" not in flat, flat
        assert 'File "<string>", line 8 in <module>' in frozen.log.read_text()  # its stack, from SIGUSR1

        supervisor.supervise()  # the kill is reported and a restart is due
        assert "component raas-0 was killed by SIGKILL" in " ".join(out.getvalue().split())
        assert frozen.restart_at is not None and frozen.restarts == 1
    finally:
        for c in (frozen, sleeping):
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
