"""One launcher per run directory: ``astraflow run`` holds an exclusive ``flock(2)`` on ``run_dir/launcher.lock`` for
as long as it lives (the kernel lets go when the process ends, killed or not), so a second launch on the same
directory is refused at once instead of starting a second set of components that fence each other's trainers and
publish into the same store."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from astraflow.launcher.preflight import ConfigRefused


class RunDirBusy(ConfigRefused):
    """Another live launcher holds the run directory (the config's ``run_dir`` cannot be used now)."""


def hold_run_dir(run_dir: Path) -> int:
    """Take ``run_dir`` for this process (created if missing): an exclusive, non-blocking lock on its
    ``launcher.lock``, which then holds this process's pid.

    Returns:
        The lock file's descriptor: the lock lasts while it is open, by default until the process ends.

    Raises:
        RunDirBusy: another process holds it (the message names its pid).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / "launcher.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(f"run_dir {run_dir} is in use by another `astraflow run` (pid {holder}): stop it, or "
                         "give this run another run_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
