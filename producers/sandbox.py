"""A sandbox for untrusted Python (model-written code and its tests).

Two isolation modes, chosen by the ``ASTRAFLOW_SANDBOX`` environment variable
(or the ``mode`` argument of :func:`run_python`):

``bwrap`` (the default): isolation by bubblewrap (``bwrap``, Debian package
``bubblewrap``). The code runs under the system interpreter
(:data:`SANDBOX_PYTHON`, standard library only) in new user, PID, network, IPC,
UTS, mount and cgroup namespaces (``--unshare-all``) that

- see a read-only view of only what the interpreter needs (its binary, ``/usr/lib``,
  ``/usr/lib64``, the loader cache, time zones): not ``/root``, ``/home``, the
  repository, the run directory nor the caller's temp files;
- may write only to a fresh private directory, ``/sandbox`` inside (its cwd,
  ``HOME`` and ``TMPDIR``), deleted afterwards (a :class:`~topics.scratch.ScratchDir`: one left by a killed
  caller is swept when a component starts), and to a private 1 MiB
  ``/dev/shm``; ``/dev`` is bwrap's minimal one (``null``, ``zero``,
  ``urandom``, ...), read-only like every other path;
- get their own ``/proc`` (the sandbox's pid 1 is bwrap's reaper), a cleared
  environment (``PATH``, ``HOME``, ``TMPDIR``, ``LANG``, thread-count caps: no
  secret of the caller reaches it, not even through ``/proc/1/environ``), only a
  loopback network, a new session (``setsid``) and no further user namespaces;
- when AstraFlow runs as root, run as an unprivileged user id of their own
  (set by ``subprocess`` before ``prlimit`` runs, :func:`_acquire_uid`; shown as
  ``nobody`` inside);
- have rlimits set by ``prlimit`` before bwrap starts (CPU time, address
  space, file size, open files, no core dumps: they bind bwrap and everything
  it starts), and ``RLIMIT_NPROC`` set by the bootstrap before any untrusted
  code runs. The kernel counts processes per user namespace, and no process in
  a child user namespace has ``CAP_SYS_RESOURCE`` in the initial one, so the
  limit holds even when AstraFlow runs as root, and one run's fork bomb cannot
  starve a concurrent run (a limit set outside, on a uid shared by concurrent
  runs, would; and a uid's count can stay up for a second or more after its
  processes die);
- are killed on the wall timeout by killing bwrap and the sandbox's pid 1 (the
  PID namespace dies with it, ``setsid`` children included); then no process of
  the sandbox may remain (checked in ``/proc``: by its uid as root, after every
  run; otherwise by its PID namespace, after a kill). A survivor is killed and
  named in the result's ``error``.

The PEP 578 audit hook of the ``audit-hook`` mode stays inside as a second layer.

``audit-hook``: the older, weaker in-process sandbox, only on explicit opt-in
(``ASTRAFLOW_SANDBOX=audit-hook``). The code runs under the caller's
interpreter with the same rlimits and, where the kernel permits, a new network
namespace (``unshare -n``); an audit hook refuses writes outside the temp
directory, process creation and sockets. It is not a security boundary:
``ctypes``, ``dir_fd`` and ``/proc`` get around it, and ``RLIMIT_NPROC`` does
not hold for root.

Where ``bwrap`` (or ``prlimit`` from util-linux) is missing or cannot
create namespaces, :func:`run_python` raises :class:`SandboxUnavailable` naming
the tool and how to install it; code rewards refuse to score rather than run
untrusted code unconfined.

A refused operation stops the child at once with exit code
:data:`VIOLATION_EXIT`, so catching the ``PermissionError`` cannot hide it.
"""
from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from topics.scratch import ScratchDir

#: Exit code of a child stopped for a refused operation.
VIOLATION_EXIT = 86
TAIL_CHARS = 2000
#: Environment variable that picks the isolation mode: ``bwrap`` (default) or ``audit-hook``.
MODE_ENV = "ASTRAFLOW_SANDBOX"
MODES = ("bwrap", "audit-hook")
#: The interpreter run inside bwrap (overridable with ``ASTRAFLOW_SANDBOX_PYTHON``); it must be
#: readable by an unprivileged user, so not one under ``/root`` (a pyenv or a venv there).
SANDBOX_PYTHON = "/usr/bin/python3"
#: Where the code lives inside bwrap (its cwd, ``HOME`` and ``TMPDIR``).
INSIDE_ROOT = "/sandbox"
#: ``RLIMIT_NOFILE`` of a sandboxed run.
OPEN_FILES = 256
#: Size of the private ``/dev/shm`` inside bwrap (bytes).
SHM_BYTES = 1 << 20
INSTALL_HINT = ("install it with `apt-get install -y bubblewrap` (scripts/install.sh does this when apt-get is "
                f"available), or opt into the weaker in-process sandbox with {MODE_ENV}=audit-hook "
                "(not a security boundary)")
#: Unprivileged user ids for sandboxes when AstraFlow runs as root: above systemd's container range
#: (up to 0x7fffffff), 64 per caller process, by its pid (< 2**22 on Linux), so no two live sandboxes
#: of a host (one PID namespace) share a uid.
_UID_BASE = 0x70000000
_UIDS_PER_PROCESS = 64

_BOOTSTRAP = r'''
import os, resource, runpy, sys
prog, root, cpu_s, mem, fsize, nproc, started = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8])
def limit(res, soft, hard):
    cap = resource.getrlimit(res)[1]
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(res, (soft, hard))
limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)
limit(resource.RLIMIT_AS, mem, mem)
limit(resource.RLIMIT_FSIZE, fsize, fsize)
limit(resource.RLIMIT_CORE, 0, 0)
limit(resource.RLIMIT_NPROC, nproc, nproc)
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
if started >= 0:
    os.write(started, b"1")
    os.close(started)
sys.argv = [prog]
runpy.run_path(prog, run_name="__main__")
''' % {"violation": VIOLATION_EXIT}


class SandboxUnavailable(RuntimeError):
    """The chosen isolation cannot run here (a tool is missing or refused, or the mode is unknown).

    The message names what is missing and how to fix it. Code rewards let it
    propagate instead of scoring 0.0, so a misconfigured host fails loudly.
    """


class SandboxError(OSError):
    """One run could not be set up (the sandbox never reached the untrusted code); the message has bwrap's."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
        cpu_s: CPU-time limit (seconds, ``RLIMIT_CPU``; SIGXCPU then SIGKILL one second later).
        wall_s: wall-clock limit (seconds); the sandbox (its whole PID namespace) is then killed.
        memory_bytes: address-space limit per process (bytes, ``RLIMIT_AS``).
        file_bytes: largest file the child may write (bytes, ``RLIMIT_FSIZE``), stdout/stderr included.
        nproc: processes and threads the program may have, its main thread included
            (``RLIMIT_NPROC``, counted per sandbox in ``bwrap`` mode, root included; in
            ``audit-hook`` mode it is the user's count and not enforced for root).
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
        returncode: the exit code (negative: killed by that signal, also inside bwrap).
        error: why it did not pass (``None`` when it passed).
        stdout, stderr: the last :data:`TAIL_CHARS` characters of each.
        wall_s: elapsed wall time, seconds.
        mode: the isolation that ran it (``bwrap`` or ``audit-hook``).
    """

    passed: bool
    timed_out: bool
    returncode: int | None
    error: str | None
    stdout: str
    stderr: str
    wall_s: float
    mode: str = "bwrap"


def sandbox_mode(mode: str | None = None) -> str:
    """The isolation mode: ``mode`` if given, else ``$ASTRAFLOW_SANDBOX``, else ``bwrap``.

    Raises:
        SandboxUnavailable: the name is not one of :data:`MODES`.
    """
    name = (mode if mode is not None else os.environ.get(MODE_ENV, "")).strip() or "bwrap"
    if name not in MODES:
        raise SandboxUnavailable(f"unknown sandbox mode {name!r} (from {'the mode argument' if mode else MODE_ENV}); "
                                 f"choose one of {', '.join(MODES)}")
    return name


@functools.cache
def network_isolation_prefix() -> tuple[str, ...]:
    """The command prefix that runs a program in a new, empty network namespace, or ``()`` if none works.

    Used by the ``audit-hook`` mode. Tries ``unshare -n`` (needs root or
    CAP_SYS_ADMIN), then ``unshare -rn`` (user namespaces).
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


# ---------------------------------------------------------------- the bwrap setup

@dataclass(frozen=True)
class _Bwrap:
    """The tools and the read-only view of a bwrap sandbox on this host (found once per process)."""

    bwrap: str
    prlimit: str
    drop_uid: bool  # AstraFlow runs as root: each sandbox runs as a uid of its own
    python: str  # the interpreter's real path, also its path inside
    view: tuple[str, ...]  # bwrap arguments for the read-only filesystem
    modern: bool = True  # bwrap >= 0.8: --disable-userns, and --size/--perms for a small private /dev/shm


def _world_readable(path: str) -> bool:
    """Whether an unprivileged user can reach and read ``path`` (every parent directory searchable by others)."""
    p = Path(path)
    try:
        if not p.stat().st_mode & 0o004:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in p.parents)
    except OSError:
        return False


def _readonly_view(python: str) -> tuple[str, ...]:
    """bwrap arguments that mount, read-only, what ``python`` needs: the binary, its ``lib`` tree,
    ``/usr/lib``, ``/usr/lib64``, the top-level lib links or directories, the loader cache and time zones."""
    args = ["--ro-bind", python, python]
    dirs = {str(Path(python).parent.parent / "lib"), "/usr/lib", "/usr/lib64", "/usr/lib32"}
    for top in ("/lib", "/lib64", "/lib32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            dirs.add(top)
    for d in sorted(dirs):
        if os.path.isdir(d) and not os.path.islink(d):
            args += ["--ro-bind", d, d]
    for f in ("/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo"):
        args += ["--ro-bind-try", f, f]
    return tuple(args)


def _find_bwrap() -> _Bwrap:
    """Locate bwrap, prlimit and the sandbox interpreter.

    Raises:
        SandboxUnavailable: one is missing or the interpreter is not readable by an unprivileged user.
    """
    bwrap = shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin")
    if bwrap is None:
        raise SandboxUnavailable(f"the code sandbox needs bubblewrap (`bwrap`), which is not installed: {INSTALL_HINT}")
    prlimit = shutil.which("prlimit") or shutil.which("prlimit", path="/usr/bin:/bin")
    root = os.geteuid() == 0
    if prlimit is None:
        raise SandboxUnavailable("the code sandbox needs `prlimit` (Debian package util-linux), which is not "
                                 "installed: install it with `apt-get install -y util-linux`, or opt into the "
                                 f"weaker in-process sandbox with {MODE_ENV}=audit-hook")
    python = os.path.realpath(os.environ.get("ASTRAFLOW_SANDBOX_PYTHON") or SANDBOX_PYTHON)
    if not os.access(python, os.X_OK) or (root and not _world_readable(python)):
        raise SandboxUnavailable(f"the code sandbox runs {python} (ASTRAFLOW_SANDBOX_PYTHON or {SANDBOX_PYTHON}), "
                                 "which is missing or not readable by an unprivileged user: install the system "
                                 "Python (`apt-get install -y python3`) or point ASTRAFLOW_SANDBOX_PYTHON at one "
                                 "outside /root")
    return _Bwrap(bwrap=bwrap, prlimit=prlimit, drop_uid=root, python=python, view=_readonly_view(python),
                  modern=_bwrap_version(bwrap) >= (0, 8))


def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    """``bwrap --version`` as numbers (``(0,)`` when it cannot be read)."""
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split(".")[:3])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return (0,)


_probe_lock = threading.Lock()
_probe: tuple[_Bwrap | None, str | None] | None = None


def bwrap_setup() -> _Bwrap:
    """The bwrap setup of this host, found and tried once (a trivial program must run) and then cached.

    Raises:
        SandboxUnavailable: a tool is missing, or bwrap cannot build the sandbox
            here (e.g. unprivileged user namespaces are disabled); the message
            says which and how to fix it. The failure is cached too.
    """
    global _probe
    with _probe_lock:
        if _probe is None:
            try:
                setup = _find_bwrap()
                result = _run_bwrap(setup, "print('ok')", SandboxLimits(cpu_s=10, wall_s=30), b"")
                if result.stdout.strip() != "ok":
                    raise SandboxError(result.error or "no output")
                _probe = (setup, None)
            except SandboxUnavailable as e:
                _probe = (None, str(e))
            except (SandboxError, OSError) as e:
                _probe = (None, f"bubblewrap is installed but could not run a sandbox here ({e}). If that names "
                                "user namespaces, they are disabled: enable them (sysctl "
                                "kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; in a container, "
                                "allow unshare/clone in its seccomp profile); if it names an option, install "
                                f"bubblewrap >= 0.5. Or {MODE_ENV}=audit-hook opts into the weaker in-process sandbox "
                                "(not a security boundary)")
        setup, error = _probe
    if setup is None:
        raise SandboxUnavailable(error)
    return setup


def reset_bwrap_setup() -> None:
    """Forget the cached :func:`bwrap_setup` (after installing bubblewrap, or in tests)."""
    global _probe
    with _probe_lock:
        _probe = None


_uid_cond = threading.Condition()
_uids_in_use: set[int] = set()


def _acquire_uid() -> int:
    """An unprivileged user id no other live sandbox of this host uses (blocks while this process has
    :data:`_UIDS_PER_PROCESS` runs in flight)."""
    base = _UID_BASE + (os.getpid() & ((1 << 22) - 1)) * _UIDS_PER_PROCESS
    with _uid_cond:
        while True:
            for uid in range(base, base + _UIDS_PER_PROCESS):
                if uid not in _uids_in_use:
                    _uids_in_use.add(uid)
                    return uid
            _uid_cond.wait()


def _release_uid(uid: int) -> None:
    with _uid_cond:
        _uids_in_use.discard(uid)
        _uid_cond.notify()


def _namespace_pids(pid_ns: int | None, uid: int | None) -> list[int]:
    """Host pids of live processes owned by ``uid`` (when given), else in PID namespace ``pid_ns``
    (an inode number; the caller keeps it pinned so that no other sandbox can have it).

    Zombies are left out: they run nothing, and bwrap's pid 1 may linger as one until the
    host's init reaps it.
    """
    target = f"pid:[{pid_ns}]"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if uid is not None:
                match = os.stat(f"/proc/{name}").st_uid == uid
            else:
                match = pid_ns is not None and os.readlink(f"/proc/{name}/ns/pid") == target
            if match:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rpartition(b")")[2].split()[0]
                if state not in (b"Z", b"X"):
                    found.append(int(name))
        except (OSError, IndexError):
            pass
    return found


def _open_namespace(pid: int | None, pid_ns: int | None) -> int | None:
    """An open fd on ``pid``'s PID namespace if that is still ``pid_ns`` (else None)."""
    if pid is None:
        return None
    try:
        fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(fd).st_ino != pid_ns:
        os.close(fd)
        return None
    return fd


def _kill_namespace(pid_ns: int | None, uid: int | None, deadline_s: float = 5.0) -> list[int]:
    """SIGKILL every process of the sandbox until none is left; the pids still alive after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        pids = _namespace_pids(pid_ns, uid)
        if not pids or time.monotonic() > end:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _pid_namespace(status: bytes) -> tuple[int | None, int | None]:
    """(child pid, pid-namespace inode) from bwrap's first ``--json-status-fd`` document."""
    try:
        doc, _ = json.JSONDecoder().raw_decode(status.decode("utf-8", "replace").lstrip())
        return int(doc["child-pid"]), int(doc["pid-namespace"])
    except (ValueError, KeyError, TypeError):
        return None, None


def _inside_env() -> list[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": INSIDE_ROOT, "TMPDIR": INSIDE_ROOT, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return [arg for k, v in env.items() for arg in ("--setenv", k, v)]


#: The whole environment of prlimit and bwrap: bwrap's own environment stays readable inside as
#: /proc/1/environ (``--clearenv`` does not rewrite it), so nothing of the caller's may be in it.
_OUTER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _run_bwrap(setup: _Bwrap, code: str, limits: SandboxLimits, stdin: bytes) -> SandboxResult:
    """One run under bwrap (see the module docstring).

    Raises:
        SandboxError: bwrap could not build the sandbox (the bootstrap never started).
        OSError: no temp directory or pipe.
    """
    scratch = ScratchDir("sandbox")  # swept at the next component start if this process is killed
    root = scratch.path
    uid: int | None = None
    survivors: list[int] = []
    try:
        (root / "main.py").write_text(code, encoding="utf-8")
        if setup.drop_uid:
            if not all(p.stat().st_mode & 0o001 for p in root.parents):
                raise SandboxUnavailable(f"the sandbox directory {root} is under a directory other users cannot "
                                         "enter; set TMPDIR to one they can (e.g. /tmp)")
            uid = _acquire_uid()
            os.chown(root / "main.py", uid, uid)
            os.chown(root, uid, uid)
        started_r, started_w = os.pipe()
        status_r, status_w = os.pipe()
        os.set_blocking(started_r, False)
        os.set_blocking(status_r, False)
        limits_args = [f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_bytes}",
                       f"--fsize={limits.file_bytes}", f"--nofile={OPEN_FILES}", "--core=0"]
        # bwrap < 0.8: no --disable-userns, and /dev/shm stays read-only (no --size for a small tmpfs)
        no_userns = ["--disable-userns"] if setup.modern else []
        shm = ["--perms", "1777", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"] if setup.modern else []
        cmd = [setup.prlimit, *limits_args, "--", setup.bwrap, "--unshare-all", "--unshare-user", *no_userns,
               "--uid", "65534", "--gid", "65534", "--hostname", "sandbox", "--die-with-parent", "--new-session",
               "--clearenv", *_inside_env(), "--json-status-fd", str(status_w), *setup.view, "--proc", "/proc",
               "--dev", "/dev", *shm, "--remount-ro", "/dev", "--bind", str(root), INSIDE_ROOT,
               "--chdir", INSIDE_ROOT, "--remount-ro", "/", "--",
               setup.python, "-I", "-S", "-B", "-c", _BOOTSTRAP, f"{INSIDE_ROOT}/main.py", INSIDE_ROOT,
               str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes),
               str(limits.nproc + 1), str(started_w)]  # nproc + 1: bwrap's pid 1 counts in the namespace too
        start = time.monotonic()
        timed_out = False
        try:
            with _std_files(stdin) as (inp, out, err):
                try:
                    # user/group/extra_groups: set by subprocess between fork and exec (thread-safe, unlike
                    # preexec_fn); prlimit then only lowers limits, which an unprivileged user may do
                    drop = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
                    proc = subprocess.Popen(cmd, cwd="/", env=_OUTER_ENV, stdin=inp, stdout=out, stderr=err,
                                            pass_fds=(started_w, status_w), start_new_session=True, **drop)
                finally:
                    os.close(started_w)
                    os.close(status_w)
                try:
                    _wait(proc, limits.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    child_pid, pid_ns = _pid_namespace(_read_all(status_r))
                    # an open namespace file pins its inode number: no later sandbox can take it while we scan
                    ns_fd = _open_namespace(child_pid, pid_ns)
                    try:
                        if ns_fd is not None:
                            os.kill(child_pid, signal.SIGKILL)  # the sandbox's pid 1: its namespace dies with it
                        proc.kill()
                        proc.wait()
                        if uid is None and ns_fd is not None:
                            survivors = _kill_namespace(pid_ns, None)
                    finally:
                        if ns_fd is not None:
                            os.close(ns_fd)
                wall = time.monotonic() - start
                if uid is not None:
                    # as root, the uid is this sandbox's alone: catch any process left, on any path
                    survivors = _kill_namespace(None, uid)
                started = _read_all(started_r) == b"1"
                stdout, stderr = _tail(out), _tail(err)
        finally:
            os.close(started_r)
            os.close(status_r)
        rc = proc.returncode
        if rc is not None and rc > 128 and rc - 128 in _SIGNALS:
            rc = 128 - rc  # bwrap's reaper reports "killed by signal N" as exit code 128 + N
        if not started and not timed_out:
            raise SandboxError(f"bwrap could not start the sandbox (exit code {proc.returncode}): "
                               f"{stderr.strip()[-500:] or 'no message'}")
        result = _result(rc, timed_out, wall, stdout, stderr, limits, "bwrap")
        if survivors:
            result = _with_error(result, f"{len(survivors)} sandbox process(es) survived the kill: {survivors}")
        return result
    finally:
        scratch.remove()
        if uid is not None and not survivors:
            _release_uid(uid)  # a uid with survivors is never reused in this process


_SIGNALS = {int(s) for s in signal.Signals}


# ---------------------------------------------------------------- the audit-hook mode

def _run_audit_hook(code: str, limits: SandboxLimits, stdin: bytes) -> SandboxResult:
    """One run in the weaker ``audit-hook`` mode (see the module docstring).

    Raises:
        SandboxError: the interpreter did not reach the untrusted code.
        OSError: no temp directory or pipe.
    """
    scratch = ScratchDir("sandbox")  # swept at the next component start if this process is killed
    root = scratch.path
    try:
        prog = root / "main.py"
        prog.write_text(code, encoding="utf-8")
        started_r, started_w = os.pipe()
        os.set_blocking(started_r, False)
        cmd = [*network_isolation_prefix(), sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(prog), str(root),
               str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes), str(limits.nproc),
               str(started_w)]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "TMPDIR": str(root), "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        start = time.monotonic()
        timed_out = False
        try:
            with _std_files(stdin) as (inp, out, err):
                try:
                    proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=inp, stdout=out, stderr=err,
                                            pass_fds=(started_w,), start_new_session=True)
                finally:
                    os.close(started_w)
                try:
                    _wait(proc, limits.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
                wall = time.monotonic() - start
                started = _read_all(started_r) == b"1"
                stdout, stderr = _tail(out), _tail(err)
        finally:
            os.close(started_r)
        if not started and not timed_out:
            raise SandboxError(f"the sandbox interpreter did not start (exit code {proc.returncode}): "
                               f"{stderr.strip()[-500:] or 'no message'}")
        return _result(proc.returncode, timed_out, wall, stdout, stderr, limits, "audit-hook")
    finally:
        scratch.remove()


# ---------------------------------------------------------------- shared

class _std_files:
    """stdin (holding ``data``), stdout and stderr of a run: unnamed temp files of the caller, read back
    through their descriptors, never by a path the sandbox could replace with a symlink."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __enter__(self) -> tuple[IO[bytes], IO[bytes], IO[bytes]]:
        self.files = [tempfile.TemporaryFile() for _ in range(3)]
        self.files[0].write(self.data)
        self.files[0].seek(0)
        return self.files[0], self.files[1], self.files[2]

    def __exit__(self, *exc) -> None:
        for f in self.files:
            f.close()


def _wait(proc: subprocess.Popen, timeout_s: float) -> None:
    """``proc.wait(timeout_s)``, woken through a pidfd the moment the process exits (``Popen.wait``
    with a timeout polls, up to 50 ms late).

    Raises:
        subprocess.TimeoutExpired: still running after ``timeout_s`` seconds.
    """
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        proc.wait(timeout=timeout_s)
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        ready = poller.poll(max(0, int(timeout_s * 1000)))
    finally:
        os.close(fd)
    if not ready:
        raise subprocess.TimeoutExpired(proc.args, timeout_s)
    proc.wait()


def _tail(f: IO[bytes]) -> str:
    try:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * TAIL_CHARS))
        return f.read().decode("utf-8", "replace")[-TAIL_CHARS:]
    except OSError:
        return ""


def _result(rc: int | None, timed_out: bool, wall: float, stdout: str, stderr: str, limits: SandboxLimits,
            mode: str) -> SandboxResult:
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
                         error=error, stdout=stdout, stderr=stderr, wall_s=wall, mode=mode)


def _with_error(result: SandboxResult, why: str) -> SandboxResult:
    return SandboxResult(passed=False, timed_out=result.timed_out, returncode=result.returncode,
                         error=f"{result.error}; {why}" if result.error else why, stdout=result.stdout,
                         stderr=result.stderr, wall_s=result.wall_s, mode=result.mode)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str | bytes = "",
               mode: str | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` in the sandbox and report how it ended.

    Never raises for anything the code does: crashes, timeouts, memory
    exhaustion and refused operations all come back as a failed result.

    Args:
        code: the program (Python source).
        limits: its resource limits (:class:`SandboxLimits`; seconds and bytes).
        stdin: what the program reads on standard input (text is UTF-8 encoded).
        mode: ``bwrap`` or ``audit-hook``; ``None`` reads ``$ASTRAFLOW_SANDBOX`` (default ``bwrap``).

    Raises:
        SandboxUnavailable: the mode is unknown, or (``bwrap`` mode) bubblewrap,
            prlimit or the system Python is missing or cannot build a
            sandbox here; the message names it and how to install it.
        SandboxError: this run's sandbox could not be set up (an ``OSError``).
        OSError: no temp directory or pipe.
    """
    name = sandbox_mode(mode)
    data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
    if name == "audit-hook":
        return _run_audit_hook(code, limits, data)
    return _run_bwrap(bwrap_setup(), code, limits, data)
