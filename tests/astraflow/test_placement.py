"""Placement: ``astraflow run`` gives each kind of component its CPUs, thread count and niceness (``placement:``,
and ``policies.<p>.trainer_placement`` for one policy's trainer); a component started so places itself before it
starts threads, and a placement on CPUs this machine lacks, or below the launcher's niceness, is refused before
anything starts."""
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from astraflow.config import ConfigError, load_config
from astraflow.launcher.run import Launcher
from astraflow.placement import component_placement

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path, *overrides):
    return load_config(ROOT / "examples" / "arith-tiny.yaml", [f"run_dir={tmp_path / 'run'}", *overrides])


@contextmanager
def _started(launcher: Launcher, comp, ready: str, timeout_s: float):
    """Start ``comp`` through the launcher's supervisor and wait until its log says ``ready``; at the end it is
    sent SIGTERM and must exit 0."""
    launcher.supervisor.start(comp)
    try:
        deadline = time.monotonic() + timeout_s
        while ready not in (comp.log.read_text() if comp.log.exists() else ""):
            assert comp.proc.poll() is None and time.monotonic() < deadline, comp.log.read_text()
            time.sleep(0.2)
        yield comp.log.read_text()
    finally:
        comp.proc.send_signal(signal.SIGTERM)
        assert comp.proc.wait(60) == 0


def test_a_placement_on_cpus_this_machine_lacks_is_refused_before_anything_starts(tmp_path):
    bad = max(os.sched_getaffinity(0)) + 1
    done = subprocess.run([sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml",
                           f"run_dir={tmp_path / 'run'}", f"placement.trainer.cpus=[{bad}]"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"placement.trainer.cpus: CPUs [{bad}] are not available here" in done.stderr
    assert not (tmp_path / "run").exists()  # refused before the bus folder or any process
    with pytest.raises(ConfigError, match="threads"):
        _config(tmp_path, "placement.raas.threads=0")
    with pytest.raises(ConfigError, match="placement.gpu"):
        _config(tmp_path, "placement.gpu.cpus=[0]")
    # CPU ids are ints >= 0: no bool, float or string read as one, no negative id
    for cpus, error in (("[-1]", "placement.trainer.cpus.0: Input should be greater than or equal to 0"),
                        ("[true]", "placement.trainer.cpus.0: Input should be a valid integer"),
                        ("[1.0]", "placement.trainer.cpus.0: Input should be a valid integer"),
                        ("['0']", "placement.trainer.cpus.0: Input should be a valid integer"),
                        ("[]", "placement.trainer.cpus: List should have at least 1 item"),
                        ("0", "placement.trainer.cpus: Input should be a valid list")):
        with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace(".", r"\.")):
            _config(tmp_path, f"placement.trainer.cpus={cpus}")
    assert _config(tmp_path, "placement.trainer.cpus=[0]").placement.trainer.cpus == [0]
    for nice, error in (("20", "placement.raas.nice: Input should be less than or equal to 19"),
                        ("-1", "placement.raas.nice: Input should be greater than or equal to 0"),
                        ("true", "placement.raas.nice: Input should be a valid integer")):  # not 1
        with pytest.raises(ConfigError, match=error.replace(".", r"\.")):
            _config(tmp_path, f"placement.raas.nice={nice}")


def test_a_niceness_below_the_launchers_is_refused(tmp_path):
    done = subprocess.run(["nice", "-n", "5", sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml",
                           f"run_dir={tmp_path / 'run'}", "policies.actor.trainer_placement.nice=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "policies.actor.trainer_placement.nice: 2 is below the launcher's own niceness 5" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_policys_trainer_placement_replaces_the_trainers_field_by_field(tmp_path):
    cfg = _config(tmp_path, "placement.trainer.cpus=[0]", "placement.trainer.threads=2",
                  "policies.actor.trainer_placement.nice=7", "placement.raas.nice=3")
    placed = component_placement(cfg, "trainer.actor", "trainer")
    assert (placed.cpus, placed.threads, placed.nice) == ([0], 2, 7)
    assert cfg.placement.trainer.nice is None  # the kind's own placement is not changed
    assert component_placement(cfg, "raas-0", "raas").nice == 3
    assert component_placement(cfg, "vllm.actor", "vllm") is None


def test_the_launcher_starts_a_component_pinned_to_its_cpus_with_its_threads(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    cfg = _config(tmp_path, f"placement.controller.cpus=[{cpu}]", "placement.controller.threads=1",
                  "placement.controller.nice=4")
    (tmp_path / "run").mkdir()
    launcher = Launcher(cfg, ROOT / "examples" / "arith-tiny.yaml", [f"run_dir={tmp_path / 'run'}"])
    comp = next(c for c in launcher.components if c.kind == "acquire")  # any component: the controller's command
    comp.name, comp.log = "controller", tmp_path / "controller.log"
    comp.argv = [sys.executable, "-m", "astraflow", "controller", str(ROOT / "examples" / "arith-tiny.yaml"),
                 f"run_dir={tmp_path / 'run'}"]
    with _started(launcher, comp, "controller on cpus", 90) as log:
        assert f"controller on cpus [{cpu}], 1 thread(s), nice 4" in log
        status = Path(f"/proc/{comp.proc.pid}/status").read_text()
        assert f"Cpus_allowed_list:\t{cpu}\n" in status
        # every thread it started runs at that niceness (/proc/<pid>/task/<tid>/stat: field 19)
        tasks = Path(f"/proc/{comp.proc.pid}/task").iterdir()
        nices = {int(Path(t, "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks}
        assert nices == {4}, nices
        environ = Path(f"/proc/{comp.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ


def test_the_search_server_runs_where_it_is_placed(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    config = ROOT / "examples" / "search-tiny.yaml"
    overrides = [f"run_dir={tmp_path / 'run'}", f"placement.search.cpus=[{cpu}]"]
    (tmp_path / "run").mkdir()
    launcher = Launcher(load_config(config, overrides), config, overrides)
    comp = next(c for c in launcher.components if c.kind == "search")
    comp.log = tmp_path / "search.log"
    with _started(launcher, comp, "serving", 60):
        assert f"Cpus_allowed_list:\t{cpu}\n" in Path(f"/proc/{comp.proc.pid}/status").read_text()
