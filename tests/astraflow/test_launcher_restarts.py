"""The launcher's restart policy (CrashLoopBackOff): a component killed from outside is restarted however often it
is killed, with a doubling, capped back-off; a component that exits on its own before it ever got going fails the
run after ``MAX_START_FAILURES`` tries, naming it. Real processes, real SIGKILLs; the back-off is shortened."""
import io
import os
import signal
import sys
import time
from pathlib import Path

from rich.console import Console

import astraflow.launcher.supervision as supervision
from astraflow.config import load_config
from astraflow.launcher.plan import Component
from astraflow.launcher.supervision import Supervisor

ROOT = Path(__file__).resolve().parents[2]


def _supervisor(tmp_path, monkeypatch, *components: Component) -> tuple[Supervisor, io.StringIO]:
    example = ROOT / "examples" / "arith-tiny.yaml"
    out = io.StringIO()
    supervisor = Supervisor(load_config(example, [f"run_dir={tmp_path}"]), list(components),
                            Console(file=out, width=200))
    monkeypatch.setattr(supervision, "RESTART_BACKOFF_S", (0.05, 0.4))
    for c in components:
        supervisor.start(c)
    return supervisor, out


def _supervise_until(supervisor: Supervisor, done, timeout_s: float = 30.0) -> list[Component]:
    deadline = time.monotonic() + timeout_s
    while not done():
        failed = supervisor.supervise()
        if failed:
            return failed
        assert time.monotonic() < deadline, "supervision did not get there"
        time.sleep(0.02)
    return []


def test_a_component_killed_right_after_each_restart_is_restarted_every_time(tmp_path, monkeypatch):
    # 8 SIGKILLs, each as soon as the new process is up (it never got going): more than the old budget of
    # 5 restarts in a row, which failed the run ("used its 5 restarts in a row")
    comp = Component("raas-0", [sys.executable, "-c", "import time; time.sleep(300)"], tmp_path / "raas-0.log")
    supervisor, out = _supervisor(tmp_path, monkeypatch, comp)
    gaps = []  # seconds from each SIGKILL to the new process
    try:
        for kill in range(8):
            pid, killed = comp.proc.pid, time.monotonic()
            os.kill(pid, signal.SIGKILL)
            assert _supervise_until(supervisor, lambda: comp.proc.pid != pid) == []
            gaps.append(time.monotonic() - killed)
    finally:
        comp.proc.kill()
        comp.proc.wait()
    assert comp.restarts == 8 and comp.start_failures == 0, (comp.restarts, comp.start_failures)
    # the back-off doubles from 0.05 s up to its cap, 0.4 s
    backoff = [0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4, 0.4]
    assert all(b <= g < b + 1.0 for b, g in zip(backoff, gaps)), gaps
    assert out.getvalue().count("was killed by SIGKILL") == 8 and "restarted raas-0 (restart 8)" in out.getvalue()


def test_a_component_that_cannot_start_fails_the_run_naming_it(tmp_path, monkeypatch):
    comp = Component("exporter", [sys.executable, "-c", "import sys; sys.exit('port 9400 in use')"],
                     tmp_path / "exporter.log")
    supervisor, out = _supervisor(tmp_path, monkeypatch, comp)
    failed = _supervise_until(supervisor, lambda: False)
    assert failed == [comp]
    tries = supervision.MAX_START_FAILURES
    assert comp.start_failures == tries and comp.restarts == tries - 1, (comp.start_failures, comp.restarts)
    text = " ".join(out.getvalue().split())
    assert (f"exporter cannot start: it exited on its own {supervision.MAX_START_FAILURES} times before any process "
            f"of it ran {supervision.STARTED_S:.0f} s (exit code 1") in text, text[-2000:]
    assert "port 9400 in use" in text  # the log's tail says why


def test_the_log_tail_shown_for_a_failed_component_skips_the_interpreter_exit_report(tmp_path, monkeypatch):
    # triton's nanobind bindings print a report of leaked objects as the interpreter exits: 20+ lines after the cause
    exit_report = ["nanobind: leaked 3 instances!", ' - leaked instance 0x7f of type "triton._C.libtriton.ir.context"',
                   "nanobind: leaked 514 functions!"] + [f' - leaked function "f{i}"' for i in range(20)] + [
                   " - ... skipped remainder", "nanobind: this is likely caused by a reference counting issue in the "
                   "binding code.", "See https://nanobind.readthedocs.io/en/latest/refleaks.html"]
    script = (f"import sys; print('OpenEnvUnavailable: GET /schema failed: Cannot connect to host', file=sys.stderr); "
              f"print({chr(10).join(exit_report)!r}, file=sys.stderr); sys.exit(1)")
    comp = Component("raas-0", [sys.executable, "-c", script], tmp_path / "raas-0.log")
    supervisor, out = _supervisor(tmp_path, monkeypatch, comp)
    assert _supervise_until(supervisor, lambda: False) == [comp]
    text = out.getvalue()
    assert "Cannot connect to host" in text and "nanobind" not in text and "leaked" not in text, text[-2000:]


def test_a_component_that_once_got_going_is_restarted_whatever_stops_it(tmp_path, monkeypatch):
    # a component that ran STARTED_S seconds once, then exits with an error at each start (e.g. the store is down
    # while it restarts): restarted for as long as the run goes
    monkeypatch.setattr(supervision, "STARTED_S", 0.5)
    flag = tmp_path / "ran"
    script = (f"import pathlib, sys, time; f = pathlib.Path({str(flag)!r})\n"
              "if f.exists(): sys.exit(1)\nf.touch(); time.sleep(1.0); sys.exit(1)")
    comp = Component("trainer.actor", [sys.executable, "-c", script], tmp_path / "trainer.log")
    supervisor, _ = _supervisor(tmp_path, monkeypatch, comp)
    assert _supervise_until(supervisor, lambda: comp.restarts >= 2 * supervision.MAX_START_FAILURES) == []
    assert comp.got_going and comp.start_failures == 0
    comp.proc.wait()
