"""The code sandbox: runaway, memory-hungry, networked and escaping programs are stopped or refused."""
import threading

from listener import listener
from producers import rewards
from producers.sandbox import VIOLATION_EXIT, SandboxLimits, run_python
from topics.schemas import Prompt

FAST = SandboxLimits(cpu_s=1, wall_s=5)


def code_prompt(tests: str = "assert True\n") -> Prompt:
    return Prompt(prompt_id="p", source="t", task_type="code", text="write f", tests=tests, entry_point="f")


def test_good_code_passes_and_may_use_its_temp_dir():
    r = run_python("import os\nopen('out.txt', 'w').write('hi')\nos.mkdir('d')\nprint(open('out.txt').read())", FAST)
    assert r.passed and not r.timed_out and r.returncode == 0 and r.error is None
    assert r.stdout.strip() == "hi"


def test_infinite_loop_is_stopped_and_scores_zero(monkeypatch):
    r = run_python("while True:\n    pass\n", FAST)
    assert not r.passed and r.timed_out
    # stopped by a limit (CPU 1 s or wall 5 s), not left to loop: 20 s of start-up and kill slack, where ~0.5 s is
    # needed, so that a busy machine cannot miss it
    assert r.wall_s < FAST.wall_s + 20
    monkeypatch.setattr(rewards, "CODE_LIMITS", FAST)
    assert rewards.score(code_prompt(), "def f():\n    while True:\n        pass\nf()\n") == 0.0


def test_sleeping_forever_hits_the_wall_timeout():
    r = run_python("import time\ntime.sleep(60)\n", SandboxLimits(cpu_s=1, wall_s=1.5))
    assert not r.passed and r.timed_out


def test_allocating_10_gb_is_refused_and_scores_zero():
    code = "x = bytearray(10 * 2**30)\nx[-1] = 1\nprint('allocated')\n"
    r = run_python(code, FAST)
    assert not r.passed and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert rewards.score(code_prompt(), code) == 0.0


def test_opening_a_socket_is_refused_and_scores_zero():
    # A listener in this process: if the sandbox could reach it, accept() would see a connection.
    with listener() as (port, reached):
        code = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=2).sendall(b'x')\n"
                "except Exception as e:\n    print('caught', e)\nprint('still here')\n" % port)
        r = run_python(code, FAST)
    assert not r.passed and r.returncode == VIOLATION_EXIT and "still here" not in r.stdout
    assert "sandbox violation" in r.error
    assert reached == [False]
    assert rewards.score(code_prompt(), code) == 0.0


def test_writing_outside_the_temp_dir_is_refused_and_scores_zero(tmp_path):
    target = tmp_path / "escaped.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.chdir('/')\nopen({str(target)!r}, 'a').write('x')",
                 f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
        r = run_python(code, FAST)
        assert not r.passed and r.returncode == VIOLATION_EXIT, (code, r)
        assert rewards.score(code_prompt(), code) == 0.0
    assert not target.exists() and tmp_path.exists()


def test_starting_processes_is_refused():
    r = run_python("import subprocess\nsubprocess.run(['true'])\n", FAST)
    assert not r.passed and r.returncode == VIOLATION_EXIT


def test_the_calling_worker_keeps_running_after_bad_runs():
    """Bad programs in parallel threads leave this process, its threads and the sandbox usable."""
    results = {}
    bad = ["while True: pass", "x = bytearray(10 * 2**30)", "import socket; socket.socket()", "import os; os._exit(3)"]
    threads = [threading.Thread(target=lambda c=c: results.__setitem__(c, run_python(c, FAST))) for c in bad]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(bad) and not any(r.passed for r in results.values())
    # each failed for its own reason, not because the runs interfered
    assert results["while True: pass"].timed_out and not results["import os; os._exit(3)"].timed_out
    assert results["import os; os._exit(3)"].returncode == 3
    assert run_python("print(6 * 7)", FAST).stdout.strip() == "42"
