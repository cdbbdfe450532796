"""A sandbox for untrusted Python (model-written code and its tests).

The code runs in a child Python process that

- has rlimits on CPU time (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
  file size (``RLIMIT_FSIZE``) and processes (``RLIMIT_NPROC``);
- is killed, with its whole process group, after a wall-clock timeout;
- runs in a fresh temporary directory (its cwd, ``HOME`` and ``TMPDIR``), which
  is deleted afterwards;
- has no network: it is started in a new network namespace with ``unshare -n``
  (or ``unshare -rn`` without root) when the kernel permits, and in every case an
  audit hook (PEP 578) refuses to create non-Unix sockets or resolve names;
- may not write, delete, rename or change files outside its temp directory,
  nor start processes: the audit hook refuses those too.

A refused operation stops the child at once with exit code
:data:`VIOLATION_EXIT`, so catching the ``PermissionError`` cannot hide it.

The rlimits are set by the child itself before any untrusted code runs, not
in a ``preexec_fn``: ``preexec_fn`` is unsafe in a parent with threads (a RaaS
worker has Kafka client threads). Audit hooks are a best-effort guard, not a
security boundary (``ctypes`` can bypass them); the namespace and rlimits are
the hard limits. As root, ``RLIMIT_NPROC`` is not enforced by the kernel; the
audit hook still refuses ``fork``/``exec``/``subprocess``.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: Exit code of a child stopped for a refused operation.
VIOLATION_EXIT = 86
TAIL_CHARS = 2000

_BOOTSTRAP = r'''
import os, resource, runpy, sys
prog, root, cpu_s, mem, fsize, nproc = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
except (ValueError, OSError):
    pass
root = os.path.realpath(root)
_realpath, _commonpath, _write, _exit = os.path.realpath, os.path.commonpath, os.write, os._exit
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
               "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move"}
SPAWN_EVENTS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                "subprocess.Popen", "pty.spawn"}
NET_EVENTS = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.connect",
              "socket.bind", "socket.sendto"}

def refuse(why):
    _write(2, ("sandbox violation: " + why + "\n").encode("utf-8", "replace"))
    _exit(%(violation)d)

def inside(path):
    if isinstance(path, int):
        return True
    if isinstance(path, bytes):
        path = path.decode("utf-8", "replace")
    real = _realpath(path)
    return real == "/dev/null" or _commonpath([real, root]) == root

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(flags, int) and flags & WRITE_FLAGS) or (
            isinstance(mode, str) and any(c in mode for c in "wax+"))
        if writes and path is not None and not inside(path):
            refuse(f"write to {path!r} outside the sandbox directory")
    elif event in PATH_EVENTS:
        for p in args:
            if isinstance(p, (str, bytes, os.PathLike)) and not inside(os.fspath(p)):
                refuse(f"{event} on {p!r} outside the sandbox directory")
    elif event == "socket.__new__":
        import socket
        if args[1] not in (socket.AF_UNIX, -1):
            refuse("network sockets are not allowed")
    elif event in NET_EVENTS or event in SPAWN_EVENTS:
        refuse(f"{event} is not allowed")

sys.addaudithook(hook)
sys.argv = [prog]
runpy.run_path(prog, run_name="__main__")
''' % {"violation": VIOLATION_EXIT}


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
        cpu_s: CPU-time limit (seconds, ``RLIMIT_CPU``; SIGXCPU then SIGKILL one second later).
        wall_s: wall-clock limit (seconds); the process group is then killed.
        memory_bytes: address-space limit (bytes, ``RLIMIT_AS``).
        file_bytes: largest file the child may write (bytes, ``RLIMIT_FSIZE``), stdout/stderr included.
        nproc: ``RLIMIT_NPROC`` (processes and threads of the user; not enforced for root).
    """

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    nproc: int = 1


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        passed: exit code 0 within the limits.
        timed_out: stopped by the wall timeout or the CPU-time limit.
        returncode: the exit code (negative: killed by that signal).
        error: why it did not pass (``None`` when it passed).
        stdout, stderr: the last :data:`TAIL_CHARS` characters of each.
        wall_s: elapsed wall time, seconds.
    """

    passed: bool
    timed_out: bool
    returncode: int | None
    error: str | None
    stdout: str
    stderr: str
    wall_s: float


@functools.cache
def network_isolation_prefix() -> tuple[str, ...]:
    """The command prefix that runs a program in a new, empty network namespace, or ``()`` if none works.

    Tries ``unshare -n`` (needs root or CAP_SYS_ADMIN), then ``unshare -rn`` (user namespaces).
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "-n"), (unshare, "-rn")):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return prefix
    return ()


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * TAIL_CHARS))
            return f.read().decode("utf-8", "replace")[-TAIL_CHARS:]
    except OSError:
        return ""


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as ``__main__`` in the sandbox and report how it ended.

    Never raises for anything the code does: crashes, timeouts, memory
    exhaustion and refused operations all come back as a failed result.

    Raises:
        OSError: the sandbox itself cannot be set up (no temp directory, no Python).
    """
    root = Path(tempfile.mkdtemp(prefix="astraflow-sandbox-"))
    try:
        prog = root / "main.py"
        prog.write_text(code, encoding="utf-8")
        cmd = [*network_isolation_prefix(), sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(prog), str(root),
               str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes), str(limits.nproc)]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "TMPDIR": str(root), "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        start = time.monotonic()
        timed_out = False
        with open(root / ".stdout", "wb") as out, open(root / ".stderr", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, start_new_session=True)
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        wall = time.monotonic() - start
        rc = proc.returncode
        stdout, stderr = _tail(root / ".stdout"), _tail(root / ".stderr")
        if rc in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out and wall >= limits.cpu_s * 0.5:
            timed_out = True  # the CPU-time limit fired
        if timed_out:
            error = f"timed out (wall {limits.wall_s:g} s / CPU {limits.cpu_s} s)"
        elif rc == VIOLATION_EXIT:
            error = stderr.strip().splitlines()[-1] if stderr.strip() else "sandbox violation"
        elif rc != 0:
            last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            error = f"exit code {rc}" + (f": {last}" if last else "")
        else:
            error = None
        return SandboxResult(passed=rc == 0 and not timed_out, timed_out=timed_out, returncode=rc,
                             error=error, stdout=stdout, stderr=stderr, wall_s=wall)
    finally:
        shutil.rmtree(root, ignore_errors=True)
