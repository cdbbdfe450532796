"""What a component started by ``astraflow run`` shares with its launcher: its name, the exit status that stops
its restarts, and the watch on the launcher's life. Components import this module, never the launcher."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

#: a component's exit status when its input is bad and a restart would meet it again (acquisition with data.strict)
EXIT_BAD_INPUT = 3
#: The environment variable through which a launched component learns its launcher's pid.
LAUNCHER_PID_ENV = "ASTRAFLOW_LAUNCHER_PID"
#: Seconds a component whose launcher died has to stop cleanly before it exits hard.
ORPHAN_GRACE_S = 30.0


def policy_component(policy: str, instance: int) -> str:
    """The component name of filter processor ``instance`` of ``policy``: ``policy.<policy>`` for instance 0,
    ``policy.<policy>.<instance>`` for the others."""
    return f"policy.{policy}" + (f".{instance}" if instance else "")


def process_start_time(pid: int) -> int | None:
    """The start time of live process ``pid`` (clock ticks since boot, field 22 of ``/proc/PID/stat``), which
    tells it from a later process given the same pid; None when there is no such process or it is a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def watch_launcher(name: str, stop: threading.Event, poll_s: float = 1.0) -> threading.Thread | None:
    """In a component started by ``astraflow run`` (``$ASTRAFLOW_LAUNCHER_PID`` set), watch the launcher: once
    that process is gone (killed, even by SIGKILL: components run in their own sessions, so nothing else
    reaches them; a rank under torchrun has torchrun as its parent, so it is the launcher itself that is
    watched), log it, set ``stop`` and, if the component has not exited ``ORPHAN_GRACE_S`` seconds later,
    exit with status 1. Returns the watching daemon thread, or None outside a launched run."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return None
    started = process_start_time(int(launcher))

    def watch() -> None:
        while started is not None and process_start_time(int(launcher)) == started:
            time.sleep(poll_s)
        print(f"{name}: the launcher (pid {launcher}) is gone: stopping, exiting in at most {ORPHAN_GRACE_S:.0f} s",
              file=sys.stderr, flush=True)
        stop.set()
        time.sleep(ORPHAN_GRACE_S)
        os._exit(1)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
