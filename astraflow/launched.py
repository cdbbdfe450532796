"""What a component started by ``astraflow run`` shares with its launcher: its name, the exit status that stops
its restarts, the watch on the launcher's life, and a component process's setup. Components import this module,
never the launcher."""
from __future__ import annotations

import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

#: a component's exit status when its input is bad and a restart would meet it again (acquisition with data.strict)
EXIT_BAD_INPUT = 3
#: a trainer's exit status when its reward collapsed and ``stop_on_collapse`` stopped it: the run fails, no restart
EXIT_COLLAPSED = 4
#: The environment variable through which a launched component learns its launcher's pid.
LAUNCHER_PID_ENV = "ASTRAFLOW_LAUNCHER_PID"
#: Seconds a component whose launcher died has to stop cleanly before it exits hard.
ORPHAN_GRACE_S = 30.0
#: The environment variable naming the file that a launched component touches every second while its Python runs:
#: the launcher kills a component whose file goes stale (:mod:`astraflow.launcher.supervision`).
HEARTBEAT_ENV = "ASTRAFLOW_HEARTBEAT_FILE"


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
    exit with status 1. While it watches, it touches the file ``$ASTRAFLOW_HEARTBEAT_FILE`` names (a rank under
    ``torchrun`` its own: the name with ``.$RANK`` added) every ``poll_s`` seconds: a Python thread that gets to
    run, so a file that goes stale tells the launcher the whole process is frozen (a C call that holds the
    interpreter lock, a stopped process). Returns the watching daemon thread, or None outside a launched run."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return None
    started = process_start_time(int(launcher))
    heartbeat = os.environ.get(HEARTBEAT_ENV)
    if heartbeat and os.environ.get("RANK"):
        heartbeat += f".{os.environ['RANK']}"

    def watch() -> None:
        while started is not None and process_start_time(int(launcher)) == started:
            if heartbeat:
                try:
                    Path(heartbeat).touch()
                except OSError:
                    pass  # the run directory went away: the launcher cannot look at it either
            time.sleep(poll_s)
        print(f"{name}: the launcher (pid {launcher}) is gone: stopping, exiting in at most {ORPHAN_GRACE_S:.0f} s",
              file=sys.stderr, flush=True)
        stop.set()
        time.sleep(ORPHAN_GRACE_S)
        os._exit(1)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def stacks_on_sigusr1() -> None:
    """From now on, SIGUSR1 writes every thread's stack to the process's own stderr (its log under ``astraflow
    run``; not a replaced ``sys.stderr``), from the signal handler, without the interpreter lock: the launcher sends
    it before killing a wedged or frozen component."""
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def stop_on_signals() -> threading.Event:
    """A stop event that SIGTERM and SIGINT set (from now on, in place of their handlers)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Have glibc's malloc keep the memory this process frees for its next allocations, rather than hand it back
    to the kernel: allocations up to ``mmap_threshold`` bytes (32 MiB, glibc's largest) come from the heap, and a
    heap gives memory back only above ``trim_threshold`` bytes free at its top (``mallopt(M_MMAP_THRESHOLD)``,
    ``mallopt(M_TRIM_THRESHOLD)``: glibc manual, "Malloc Tunable Parameters").

    A component allocates and frees the same tensors every step (a train step's activations and gradients, an
    engine call's cache). With glibc's defaults each step's large blocks are mapped afresh and their pages
    faulted in and zeroed again, every step, at a cost in kernel CPU time that grows with the step's allocations;
    with these settings they are reused. The cost is memory: a process keeps its peak heap.

    Does nothing where the C library has no ``mallopt`` (not glibc) or where ``GLIBC_TUNABLES`` sets malloc's own
    (the operator's choice stands).

    Returns:
        Whether both settings took effect.
    """
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def component_setup(name: str, create_topics: Callable[[], None]) -> threading.Event:
    """Set up component process ``name``: pin it to the CPUs the launcher placed it on
    (:func:`astraflow.placement.apply_placement`, before anything starts a thread); on SIGUSR1 write every thread's
    stack to the log (:func:`faulthandler.register`); log at INFO under its name; call ``create_topics`` (the run's
    topics, created if missing, so components can start in any order on any machine); watch the launcher
    (:func:`watch_launcher`); have malloc keep what it frees (:func:`keep_freed_memory`); and remove the scratch
    directories that killed processes left in the temp dir (:func:`topics.scratch.sweep_scratch`).

    Args:
        name: the component's name, in every log line.
        create_topics: creates the run's topics; what it raises propagates.

    Returns:
        the stop event, set by SIGTERM / SIGINT and, in a component that ``astraflow run`` started, when the
        launcher dies.
    """
    from astraflow.placement import apply_placement
    from topics.scratch import sweep_scratch

    placed = apply_placement()  # before anything starts a thread
    keep_freed_memory()  # before the arenas of the threads to come
    stacks_on_sigusr1()
    stop = stop_on_signals()  # before anything that takes time: a SIGTERM during start-up stops cleanly too
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(name)s %(levelname)s %(message)s")
    logging.getLogger("astraflow").info("%s on %s", name, placed)
    create_topics()
    watch_launcher(name, stop)
    swept = sweep_scratch()
    if swept:
        logging.getLogger("astraflow").info("removed %d scratch directories of dead processes: %s", len(swept),
                                            ", ".join(p.name for p in swept))
    # Everything imported so far (torch, transformers: ~10^6 objects) lives as long as the process: out of the
    # collector's sight, its full collections and the one at exit skip it (1 s of CPU less per exit, measured)
    gc.freeze()
    return stop
