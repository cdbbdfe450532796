"""Escapes from the code sandbox (bubblewrap mode): each is denied or contained within the timeout,
the caller lives on, and nothing outside the sandbox's temp directory changes.

Every case runs hostile code that catches what it can and reports what it reached; the
``world`` fixture checks a canary directory and the host's ``/dev/shm`` before and after.
"""
import os
import secrets
from pathlib import Path

import pytest

from listener import listener
from producers import rewards, sandbox
from producers.sandbox import VIOLATION_EXIT, SandboxLimits, SandboxUnavailable, run_python
from topics.schemas import Prompt

LIMITS = SandboxLimits(cpu_s=2, wall_s=4)
# Start-up and kill time allowed beyond wall_s: ~0.1-0.5 s needed, generous for a busy machine. `contained` proves
# a run came back at its wall limit, not after the hostile program (a sleep of 60 s, a loop, a bomb) had its way.
SLACK_S = 20.0

LIBC = "import ctypes, ctypes.util\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def snapshot(path: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file and directory under ``path``: (mode, mtime_ns, content)."""
    out = {}
    for p in sorted(path.rglob("*")) + [path]:
        st = p.lstat()
        out[str(p)] = (st.st_mode, st.st_mtime_ns, p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
    return out


def shm_entries() -> dict[str, int]:
    """The host's /dev/shm: name -> owner uid (entries that vanish while listing are left out)."""
    out = {}
    for name in os.listdir("/dev/shm"):
        try:
            out[name] = os.lstat(f"/dev/shm/{name}").st_uid
        except FileNotFoundError:
            pass
    return out


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A canary directory with a secret (outside the sandbox), a fake ~/.aws/credentials, a run-dir config, a
    canary file in the host's /dev/shm and a planted environment secret. After the test the canaries must be
    unchanged and /dev/shm must hold no new entry the sandbox made: none named like the hostile programs' files
    and none owned by another user than this process (a sandbox runs as its own uid). The listing is not
    compared exactly: this process's own multiprocessing semaphores (``sem.mp-*``) and other programs on the
    host come and go there."""
    token = "s3cr3t-" + secrets.token_hex(8)
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep.txt").write_text("canary " + token)
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {token}\n")
    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"store: s3://bucket?key={token}\n")
    shm_canary = Path("/dev/shm", f"astraflow-canary-{token}")
    shm_canary.write_text(token)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ASTRAFLOW_TEST_SECRET", token)
    monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
    before, shm_before = snapshot(canary), shm_entries()
    try:
        yield {"token": token, "canary": canary, "home": home, "run_dir": run_dir, "tmp": tmp_path,
               "shm_canary": shm_canary}
        assert snapshot(canary) == before, "the canary directory changed"
        assert shm_canary.read_text() == token, "the /dev/shm canary changed"
        new = {name: uid for name, uid in shm_entries().items() if name not in shm_before}
        assert not [n for n, uid in new.items() if uid != os.geteuid() or n.startswith("astraflow-escape")], \
            f"the sandbox wrote to the host's /dev/shm: {new}"
    finally:
        shm_canary.unlink(missing_ok=True)


def contained(r, limits=LIMITS):
    """The run came back within its wall limit (plus start-up and kill slack): it was not left to run on."""
    assert r.mode == "bwrap"
    assert r.wall_s < limits.wall_s + SLACK_S, r
    assert os.getpid() > 0  # the caller is alive to check


def comm_pids(name: str) -> list[int]:
    """Host pids whose process name (comm) is ``name``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(int(pid))
        except OSError:
            pass
    return found


def code_prompt(tests: str = "assert True\n") -> Prompt:
    return Prompt(prompt_id="p", source="t", task_type="code", text="write f", tests=tests, entry_point="f")


# ---------------------------------------------------------------- secrets

def test_parent_and_pid1_environment_hold_no_secret(world):
    code = ("import os\nfor p in ['/proc/%d/environ' % os.getppid(), '/proc/1/environ', '/proc/self/environ',\n"
            f"          '/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ']:\n"
            "    try:\n        print(p, open(p, 'rb').read())\n"
            "    except OSError as e:\n        print(p, 'denied', e)\n"
            "print(dict(os.environ))\n")
    r = run_python(code, LIMITS)
    contained(r)
    assert r.passed, r
    assert world["token"] not in r.stdout + r.stderr
    assert "ASTRAFLOW_TEST_SECRET" not in r.stdout
    assert "/proc/1/environ b'PATH=" in r.stdout  # its own pid 1 (bwrap), with the minimal environment


def test_credentials_repo_and_run_dir_files_are_absent(world):
    repo_file = Path(sandbox.__file__).resolve()
    paths = ["~/.aws/credentials", str(world["home"] / ".aws" / "credentials"), "/root/.aws/credentials",
             str(world["run_dir"] / "config.yaml"), str(world["canary"] / "keep.txt"), str(repo_file),
             str(repo_file.parent), "/etc/shadow", "/etc/passwd", "/home", "/root", "/work"]
    code = ("import os\nfor p in %r:\n    p = os.path.expanduser(p)\n    try:\n"
            "        data = open(p).read() if not os.path.isdir(p) else os.listdir(p)\n        print('READ', p, data)\n"
            "    except OSError as e:\n        print('absent', p, type(e).__name__)\n" % paths)
    r = run_python(code, LIMITS)
    contained(r)
    assert r.passed, r
    assert "READ" not in r.stdout, r.stdout
    assert r.stdout.count("absent") == len(paths)
    assert world["token"] not in r.stdout + r.stderr


# ---------------------------------------------------------------- writes

def test_dir_fd_and_ctypes_writes_do_not_leave_the_temp_dir(world):
    canary = world["canary"]
    code = (LIBC + "import os\nresults = []\n"
            f"for d in [{str(canary)!r}, '/usr/lib', '/', '/proc', '/dev']:\n"
            "    try:\n        fd = os.open(d, os.O_RDONLY)\n"
            "        os.close(os.open('x.txt', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))\n"
            "        results.append(('WROTE', d))\n"
            "    except OSError as e:\n        results.append(('denied', d, e.errno))\n"
            f"for p in [{str(canary / 'keep.txt')!r}, {str(canary / 'new.txt')!r}, '/usr/lib/x.txt', '/x.txt']:\n"
            "    fd = libc.open(p.encode(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)\n"
            "    results.append(('WROTE', p) if fd >= 0 else ('denied', p, ctypes.get_errno()))\n"
            "print(results)\nopen('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())\n")
    r = run_python(code, LIMITS)
    contained(r)
    assert r.passed and "WROTE" not in r.stdout and r.stdout.count("denied") == 9, r
    assert r.stdout.strip().endswith("fine")
    assert not Path("/usr/lib/x.txt").exists() and not Path("/x.txt").exists()


def test_symlinks_out_of_the_temp_dir_reach_nothing(world):
    secret_file = world["canary"] / "keep.txt"
    # the audit hook refuses a link to an outside path outright
    r = run_python("import os\nos.symlink('/etc/passwd', 'pw')\n", LIMITS)
    contained(r)
    assert r.returncode == VIOLATION_EXIT
    # through ctypes: links to host paths resolve inside the sandbox's own view, and the caller never follows
    # a path in the sandbox directory (a '.stdout' link used to make it read a host file back)
    code = (LIBC + "import os\n"
            f"for name in ['.stdout', '.stderr', 'link']:\n"
            f"    libc.symlink({str(secret_file)!r}.encode(), name.encode())\n"
            f"libc.symlink({str(world['canary'])!r}.encode(), b'dirlink')\n"
            "for p in ['link', 'dirlink/keep.txt', 'dirlink/new.txt']:\n"  # the audit hook would see these writes
            "    fd = libc.open(p.encode(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
            "    print('WROTE' if fd >= 0 else 'denied', p, ctypes.get_errno())\n"
            "print(sorted(os.listdir('.')))\n")
    r = run_python(code, LIMITS)
    contained(r)
    assert r.passed and "WROTE" not in r.stdout and r.stdout.count("denied") == 3, r
    assert "'.stdout'" in r.stdout  # the links were made, and are harmless
    assert world["token"] not in r.stdout + r.stderr


def test_dev_shm_writes_stay_private(world):
    name = "astraflow-escape-" + secrets.token_hex(4)
    r = run_python(f"open('/dev/shm/{name}', 'w').write('x')\n", LIMITS)
    contained(r)
    assert r.returncode == VIOLATION_EXIT  # the audit hook
    canary = world["shm_canary"].name
    code = (LIBC + "import os\n"
            f"fd = libc.open(b'/dev/shm/{name}', os.O_WRONLY | os.O_CREAT, 0o644)\n"
            f"print('unlink', libc.unlink(b'/dev/shm/{canary}'), libc.open(b'/dev/shm/{canary}', os.O_RDWR))\n"
            "print('fd', fd, os.listdir('/dev/shm'))\n")
    r = run_python(code, LIMITS)
    contained(r)
    assert name in r.stdout and canary not in r.stdout  # it wrote its own, private /dev/shm: the host's is unseen
    assert "unlink -1 -1" in r.stdout
    assert not Path("/dev/shm", name).exists()


# ---------------------------------------------------------------- processes and signals

def test_signalling_the_parent_and_everyone_leaves_the_caller_alive(world):
    me = os.getpid()
    code = ("import os, signal\n"
            "for target in [os.getppid(), 1, %d, %d, -1]:\n"
            "    try:\n        os.kill(target, signal.SIGKILL)\n        print('sent', target)\n"
            "    except OSError as e:\n        print('denied', target, e.errno)\n"
            "print('alive')\n" % (me, os.getppid()))
    r = run_python(code, LIMITS)
    contained(r)
    assert "alive" in r.stdout or r.returncode == -9, r  # kill(-1) may take the program itself
    assert run_python("print('next')", LIMITS).stdout.strip() == "next"  # and the sandbox still works


def test_multiprocessing_is_refused_or_cannot_fork(world):
    for ctx in ("fork", "spawn", "forkserver"):
        code = ("import multiprocessing as mp\n"
                f"p = mp.get_context({ctx!r}).Process(target=print, args=('CHILD RAN',))\n"
                "p.start()\np.join()\nprint('parent done')\n")
        r = run_python(code, LIMITS)
        contained(r)
        assert not r.passed and "CHILD RAN" not in r.stdout, (ctx, r)


def test_a_thread_bomb_is_contained(world):
    code = ("import threading, time\nn = 0\ntry:\n    while True:\n"
            "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
            "except RuntimeError as e:\n    print('stopped at', n, e)\n")
    r = run_python(code, LIMITS)
    contained(r)
    assert "stopped at 0" in r.stdout, r  # nproc=1: the main thread only
    r = run_python(code, SandboxLimits(cpu_s=2, wall_s=4, nproc=5))
    contained(r)
    assert "stopped at 4" in r.stdout, r


def test_ctypes_fork_is_limited_even_for_root(world):
    code = LIBC + ("import os\nok = 0\nfor _ in range(200):\n    pid = libc.fork()\n    if pid == 0:\n"
                   "        os._exit(0)\n    ok += pid > 0\nprint('forked', ok)\n")
    r = run_python(code, LIMITS)
    contained(r)
    assert r.passed and "forked 0" in r.stdout, r


def test_a_ctypes_fork_bomb_is_contained_and_killed(world):
    name = "afb" + secrets.token_hex(5)
    code = LIBC + (f"libc.prctl(15, b'{name}', 0, 0, 0)\n"  # PR_SET_NAME: findable from the host
                   "while True:\n    libc.fork()\n")
    r = run_python(code, SandboxLimits(cpu_s=2, wall_s=3, nproc=8))
    contained(r, SandboxLimits(wall_s=3))
    assert r.timed_out and not r.passed
    assert comm_pids(name) == []


def test_setsid_children_do_not_survive(world):
    name = "ass" + secrets.token_hex(5)
    child = (f"libc.setsid()\nlibc.prctl(15, b'{name}', 0, 0, 0)\n"
             "import time\nwhile True:\n    time.sleep(0.1)\n")
    limits = SandboxLimits(cpu_s=2, wall_s=2, nproc=4)
    # the program hangs: killed at the wall timeout, with its setsid child
    code = LIBC + "pid = libc.fork()\nif pid == 0:\n" + "".join("    " + line + "\n" for line in child.splitlines()) \
        + "print('child', pid, flush=True)\nimport time\ntime.sleep(60)\n"
    r = run_python(code, limits)
    contained(r, limits)
    assert r.timed_out and "child" in r.stdout and int(r.stdout.split()[1]) > 0, r
    assert comm_pids(name) == []
    # the program exits at once: the run ends then, not at the timeout (a wall limit far above the ~1 s the run
    # takes, so that a busy machine cannot reach it), and the child, which would sleep on, goes with it
    code = LIBC + "pid = libc.fork()\nif pid == 0:\n" + "".join("    " + line + "\n" for line in child.splitlines()) \
        + "import time\ntime.sleep(0.3)\nprint('parent exits')\n"
    long_wall = SandboxLimits(cpu_s=2, wall_s=30, nproc=4)
    r = run_python(code, long_wall)
    assert r.passed and not r.timed_out and r.wall_s < long_wall.wall_s, r
    assert comm_pids(name) == []


# ---------------------------------------------------------------- memory and network

def test_a_50_gb_allocation_is_refused(world):
    for code in ("x = bytearray(50 * 2**30)\nx[-1] = 1\nprint('allocated')\n",
                 "import mmap\nm = mmap.mmap(-1, 50 * 2**30)\nm[-1] = 1\nprint('allocated')\n",
                 "x = [bytearray(2**20) for _ in range(50 * 1024)]\nprint('allocated')\n"):
        r = run_python(code, LIMITS)
        contained(r)
        assert not r.passed and "allocated" not in r.stdout, r
        assert "MemoryError" in r.stderr or "OSError" in r.stderr or r.returncode < 0, r


def test_network_reaches_no_listener(world):
    with listener() as (port, reached):
        results = [run_python(_plain_connect(port), LIMITS), run_python(_raw_connect(port), LIMITS)]
    assert reached == [False]
    for r in results:
        contained(r)
        assert "CONNECTED" not in r.stdout, r
    assert results[0].returncode == VIOLATION_EXIT  # the audit hook refuses the socket
    assert results[1].passed and "denied -1 111" in results[1].stdout  # ECONNREFUSED: an empty network namespace


def _plain_connect(port: int) -> str:
    return ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=2).sendall(b'x')\n"
             "    print('CONNECTED')\nexcept Exception as e:\n    print('denied', e)\n" % port)


def _raw_connect(port: int) -> str:
    return LIBC + ("import socket, struct\nfd = libc.socket(2, 1, 0)\n"
                  "addr = struct.pack('<HH4s8x', 2, socket.htons(%d), socket.inet_aton('127.0.0.1'))\n"
                  "rc = libc.connect(fd, addr, len(addr))\nprint('CONNECTED' if rc == 0 else 'denied', rc, "
                  "ctypes.get_errno())\n" % port)


# ---------------------------------------------------------------- normal programs, modes

def test_a_normal_program_works(world):
    code = ("import collections, json, math, re, sys, tempfile, itertools, functools, datetime\n"
            "data = sys.stdin.read()\n"
            "words = re.findall(r'\\w+', data)\n"
            "c = collections.Counter(words)\n"
            "open('out.json', 'w').write(json.dumps({'sqrt': math.sqrt(16), 'top': c.most_common(1)}))\n"
            "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n    f.write('t')\n"
            "print(open('out.json').read(), open(f.name).read(), datetime.date(2024, 1, 2).isoformat())\n")
    r = run_python(code, LIMITS, stdin="a b a c a")
    contained(r)
    assert r.passed and r.error is None, r
    assert r.stdout.strip() == '{"sqrt": 4.0, "top": [["a", 3]]} t 2024-01-02'


def test_missing_bwrap_refuses_with_a_clear_message(monkeypatch):
    which = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which",
                        lambda name, *a, **k: None if name == "bwrap" else which(name, *a, **k))
    monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
    sandbox.reset_bwrap_setup()
    try:
        with pytest.raises(SandboxUnavailable) as e:
            run_python("print(1)")
        msg = str(e.value)
        assert "bubblewrap" in msg and "apt-get install -y bubblewrap" in msg and "ASTRAFLOW_SANDBOX=audit-hook" in msg
        with pytest.raises(SandboxUnavailable, match="bubblewrap"):  # the code reward refuses, it does not score 0.0
            rewards.score(code_prompt(), "def f():\n    return 1\n")
        # opting into the weaker sandbox by name runs it
        monkeypatch.setenv(sandbox.MODE_ENV, "audit-hook")
        r = run_python("print(6 * 7)")
        assert r.passed and r.mode == "audit-hook" and r.stdout.strip() == "42"
        assert rewards.score(code_prompt(), "def f():\n    return 1\n") == 1.0
    finally:
        sandbox.reset_bwrap_setup()


def test_an_unusable_interpreter_or_unknown_mode_is_named(monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_SANDBOX_PYTHON", "/nonexistent/python3")
    sandbox.reset_bwrap_setup()
    try:
        with pytest.raises(SandboxUnavailable, match="/nonexistent/python3"):
            run_python("print(1)", mode="bwrap")
    finally:
        sandbox.reset_bwrap_setup()
    monkeypatch.setenv(sandbox.MODE_ENV, "none")
    with pytest.raises(SandboxUnavailable, match="unknown sandbox mode 'none'"):
        run_python("print(1)")


def test_audit_hook_mode_still_refuses_plain_escapes(tmp_path, monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "audit-hook")
    target = tmp_path / "escaped.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')", LIMITS)
    assert r.mode == "audit-hook" and r.returncode == VIOLATION_EXIT and not target.exists()
    r = run_python("import subprocess\nsubprocess.run(['true'])\n", LIMITS)
    assert r.returncode == VIOLATION_EXIT
    r = run_python("import sys\nprint(sys.stdin.read()[::-1])", LIMITS, stdin="abc")
    assert r.passed and r.stdout.strip() == "cba"


def test_the_sandbox_dir_is_removed_even_when_made_unreadable(monkeypatch):
    made = []
    mkdtemp = sandbox.tempfile.mkdtemp
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    r = run_python("import os\nprint(os.getcwd())\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\n"
                   "os.chmod('a/b', 0)\nos.chmod('a', 0)\n", LIMITS)
    assert r.passed and r.stdout.strip() == "/sandbox", r
    assert made and not any(os.path.exists(d) for d in made)
