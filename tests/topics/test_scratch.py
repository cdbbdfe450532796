"""Scratch directories (topics.scratch): a process SIGKILLed while a sandbox run staged its directory leaves it in
the temp dir; the sweep a component runs at start removes it, and keeps a live owner's directory and anything that is
not a scratch directory."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from topics.scratch import SCRATCH_PREFIX, ScratchDir, sweep_scratch

ROOT = Path(__file__).resolve().parents[2]
#: A RaaS-like process running model code in the sandbox (bwrap, the default mode): the code sleeps, so its sandbox
#: directory stays staged until the process is killed.
SANDBOXED = ("from producers.sandbox import SandboxLimits, run_python\n"
             "run_python('import time\\ntime.sleep(120)\\n', SandboxLimits(cpu_s=120, wall_s=120))\n")


def test_a_killed_owners_directory_is_swept_and_a_live_owners_kept(monkeypatch):
    # under /tmp, entered by others: bwrap's sandbox user (as root) must reach its directory
    tmp = Path(tempfile.mkdtemp(prefix="scratch-test-", dir="/tmp"))
    tmp.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # this process's own ScratchDir goes there too
    victim = subprocess.Popen([sys.executable, "-c", SANDBOXED], cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp.glob(f"{SCRATCH_PREFIX}sandbox-*/main.py")):
            assert victim.poll() is None, victim.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"no staged sandbox directory in {sorted(tmp.iterdir())}"
            time.sleep(0.05)
        [staged] = tmp.glob(f"{SCRATCH_PREFIX}sandbox-*")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert (staged / "main.py").exists()  # nothing of the killed process removed it
        (tmp / "astraflow-bus").mkdir()  # a user's directory that only looks alike
        (tmp / f"{SCRATCH_PREFIX}note").write_text("a file, not a directory")
        with ScratchDir("pull") as live:
            (live / "full.safetensors").write_bytes(b"\0" * 1024)
            assert sweep_scratch() == [staged]
            assert not staged.exists()
            assert (live / "full.safetensors").read_bytes() == b"\0" * 1024
            assert sorted(p.name for p in tmp.iterdir()) == sorted(["astraflow-bus", f"{SCRATCH_PREFIX}note",
                                                                    live.name])
            assert sweep_scratch(tmp) == []  # a second sweep finds nothing more to remove
        assert not live.exists()  # its owner removed it on exit
    finally:
        if victim.poll() is None:
            victim.kill()
        shutil.rmtree(tmp, ignore_errors=True)
