"""The rollout scaling controller: its rules on synthetic loads (hysteresis, cooldown, rate limit, bounds, no
flapping on a steady load), and `astraflow controller` on a real bus writing its decision and reason to
`control`, where a launched run's actuator reads it."""
import itertools
import threading
import uuid

import pytest

from astraflow.config import load_config
from astraflow.controller import Observation, ScalingController, run_controller
from tests.astraflow.test_actuators import calls, recorder
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.follow import LatestByKey
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Control, Metric

STARVED = {"actor": 0.8}
BUSY = {"actor": 0.0}
HELD = {"raas-0": 1.0, "raas-1": 1.0}


def feed(ctl: ScalingController, loads, start: float = 0.0, every: float = 5.0):
    """Observe ``loads`` ((wait_frac, paused) pairs) every ``every`` seconds; the decisions' workers in order."""
    out = []
    for i, (wait, paused) in enumerate(loads):
        d = ctl.observe(Observation(start + i * every, wait, paused))
        if d is not None:
            out.append(d.workers)
    return out


def test_scales_up_after_a_window_of_starved_trainers_one_worker_at_a_time_within_bounds():
    ctl = ScalingController(workers=1, max_workers=3, window=3, cooldown_s=20)
    assert feed(ctl, [(STARVED, {})] * 2) == []  # two observations are not a window
    assert feed(ctl, [(STARVED, {})], start=10) == [2]
    assert "trainers starved" in ctl.decisions[-1][1].reason and "1 -> 2" in ctl.decisions[-1][1].reason
    # cooldown and a fresh window: the next step up comes after both, and the bound stops it at 3
    assert feed(ctl, [(STARVED, {})] * 20, start=15) == [3]
    assert ctl.workers == 3


def test_scales_down_only_when_trainers_are_busy_and_workers_held_back():
    ctl = ScalingController(workers=2, window=2, cooldown_s=0)
    assert feed(ctl, [(BUSY, {"raas-0": 0.0, "raas-1": 0.0})] * 5) == []  # busy trainers, but workers are not paused
    assert feed(ctl, [(BUSY, HELD)] * 2, start=100) == [1]
    assert feed(ctl, [(BUSY, HELD)] * 10, start=200) == []  # min_workers 1


@pytest.mark.parametrize("wait", [0.0, 0.1, 0.2, 0.29, 0.31, 0.9])
@pytest.mark.parametrize("paused", [0.0, 0.4, 1.0])
def test_a_steady_load_never_flaps(wait, paused):
    """Whatever the steady load, the target moves one way only (towards a bound) and never back."""
    ctl = ScalingController(workers=2, min_workers=1, max_workers=4, window=3, cooldown_s=30)
    workers = feed(ctl, [({"actor": wait}, {"raas-0": paused})] * 200)
    steps = [b - a for a, b in itertools.pairwise([2, *workers])]
    assert len(set(steps)) <= 1 and all(abs(s) == 1 for s in steps), workers


def test_no_worker_is_added_while_backpressure_holds_the_workers_back():
    ctl = ScalingController(workers=1, window=2, cooldown_s=0)
    assert feed(ctl, [(STARVED, {"raas-0": 1.0})] * 10) == []
    assert feed(ctl, [(STARVED, {"raas-0": 0.0})] * 2, start=100) == [2]


def test_nothing_is_decided_while_an_operator_pause_holds_a_worker():
    ctl = ScalingController(workers=1, window=2, cooldown_s=0)
    for i in range(10):  # starved because rollout was paused on purpose: a new worker would be paused too
        assert ctl.observe(Observation(i * 5.0, STARVED, {"raas-0": 0.0}, {"raas-0": 1.0})) is None
    assert ctl.observe(Observation(100.0, STARVED, {"raas-0": 0.0}, {"raas-0": 0.0})) is None  # a new window
    assert ctl.observe(Observation(105.0, STARVED, {"raas-0": 0.0}, {"raas-0": 0.0})).workers == 2


def test_alternating_noise_inside_the_window_decides_nothing():
    ctl = ScalingController(workers=2, window=3, cooldown_s=0)
    assert feed(ctl, [(STARVED, {}), (BUSY, HELD)] * 50) == []


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="min_workers"):
        ScalingController(workers=1, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="busy_below"):
        ScalingController(workers=1, busy_below=0.5, starved_above=0.3)


def test_the_controller_writes_its_decision_and_reason_to_control(bus_url, tmp_path):
    run = f"ctl{uuid.uuid4().hex[:8]}"
    path = tmp_path / "run.yaml"
    path.write_text(f"run: {run}\nrun_dir: {tmp_path / 'run'}\nbus: {bus_url}\npolicies: {{actor: {{model: tiny}}}}\n"
                    "controller: {enabled: true, interval_s: 0.2, window: 2, cooldown_s: 0, max_workers: 2}\n")
    cfg = load_config(path)
    names, bus = TopicNames(run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"])
    producer = bus.producer()
    stop = threading.Event()
    thread = threading.Thread(target=run_controller, args=(cfg.controller_section(), bus, stop), daemon=True)
    thread.start()
    control = LatestByKey(bus, names.control, Control)
    try:
        decision = None
        for _ in range(300):  # the trainer keeps reporting that it starves
            m = Metric(component="trainer.actor", kind="trainer", policy="actor", step=1, values={"wait_frac": 0.9})
            producer.send(names.metrics, encode(m), key=m.component, headers=headers_for(m))
            producer.flush()
            decision = control.poll(0.2).get("raas.single_turn")
            if decision is not None:
                break
        assert decision is not None and decision.action == "target_replicas" and decision.value == 2
        assert "trainers starved (wait_frac actor 0.90" in decision.reason
    finally:
        stop.set()
        thread.join(30)
        control.close()
        producer.close()
    assert not thread.is_alive()


def test_the_controller_carries_its_decision_out_retries_a_failure_and_reapplies_it_when_restarted(bus_url, tmp_path):
    """actuator: compose, its command a recording script (no Docker daemon here, see test_actuators.py): the
    decision goes to `control`, then to compose; a failed `up` is retried and reported on `metrics`; a restarted
    controller applies the newest target on `control` again, before any new decision."""
    run = f"act{uuid.uuid4().hex[:8]}"
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text("services: {}\n")
    path = tmp_path / "run.yaml"
    path.write_text(f"run: {run}\nrun_dir: {tmp_path / 'run'}\nbus: {bus_url}\npolicies: {{actor: {{model: tiny}}}}\n"
                    "controller: {interval_s: 0.2, window: 2, cooldown_s: 0, max_workers: 2, actuator: compose, "
                    f"compose_file: {compose_file}, compose_command: [{recorder(tmp_path)}]}}\n")
    (tmp_path / "exit_code").write_text("1")  # compose fails at first
    cfg = load_config(path)
    names, bus = TopicNames(run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"])
    producer = bus.producer()
    want = ["-f", str(compose_file), "up", "-d", "--no-recreate", "--scale", "raas=2", "raas"]

    def controller() -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        thread = threading.Thread(target=run_controller, args=(cfg.controller_section(), bus, stop), daemon=True)
        thread.start()
        return thread, stop

    thread, stop = controller()
    try:
        for _ in range(300):  # the trainer keeps reporting that it starves
            m = Metric(component="trainer.actor", kind="trainer", policy="actor", step=1, values={"wait_frac": 0.9})
            producer.send(names.metrics, encode(m), key=m.component, headers=headers_for(m))
            producer.flush()
            if calls(tmp_path):
                break
            threading.Event().wait(0.2)
        (tmp_path / "exit_code").unlink()  # compose works again
        control = LatestByKey(bus, names.control, Control)
        metrics = LatestByKey(bus, names.metrics, Metric)
        try:
            assert control.read_to_end()["raas.single_turn"].value == 2  # on control before compose ran
            report = None
            for _ in range(100):
                report = metrics.poll(0.2).get("controller")
                if report is not None and report.values["applied_workers"] == 2:
                    break
        finally:
            control.close()
            metrics.close()
        assert report is not None and report.kind == "controller"
        assert report.values["applied_workers"] == 2 and report.values["target_workers"] == 2
        assert report.values["actuator_errors"] >= 1 and report.values["actuator_failing"] == 0
        tried = len(calls(tmp_path))
        assert tried >= 2 and all(c == want for c in calls(tmp_path))
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    thread, stop = controller()  # restarted: applies the target on control again, with no new metrics
    try:
        for _ in range(150):
            if len(calls(tmp_path)) > tried:
                break
            threading.Event().wait(0.2)
        assert calls(tmp_path)[tried:] == [want]
    finally:
        stop.set()
        thread.join(30)
        producer.close()
    assert not thread.is_alive()


@pytest.mark.parametrize("actuator, want", [("local", 3), ("compose", 1)])
def test_the_launcher_follows_control_only_with_the_local_actuator(tmp_path, actuator, want):
    """With compose or kubernetes the controller scales RaaS elsewhere: the launcher's own workers stay."""
    from pathlib import Path

    from astraflow.launcher.run import Launcher

    (tmp_path / "docker-compose.yml").write_text("services: {}\n")
    extra = [f"controller.compose_file={tmp_path / 'docker-compose.yml'}"] if actuator == "compose" else []
    cfg = load_config(None, ["policies.actor.model=tiny", f"run_dir={tmp_path}", "controller.enabled=true",
                             f"controller.actuator={actuator}", *extra])
    bus, names = connect(cfg.bus), TopicNames(cfg.run)
    ensure_run_topics(bus.admin(), names, ["actor"])
    producer = bus.producer()
    msg = Control(component="raas.single_turn", action="target_replicas", value=3, reason="test")
    producer.send(names.control, encode(msg), key=msg.component, headers=headers_for(msg))
    producer.flush()
    producer.close()
    scaler = Launcher(cfg, Path("examples/arith-tiny.yaml"), []).scaler
    for _ in range(20):
        scaler.read_target(bus)
        if scaler.target != 1:
            break
        threading.Event().wait(0.05)
    scaler.close()
    assert scaler.target == want


@pytest.mark.slow
def test_a_real_run_scales_up_when_its_trainer_starves_and_back_down_when_the_trainer_is_the_bottleneck(tmp_path):
    """A real run (arith-tiny) starts with one RaaS worker throttled by an operator to 240 prompts a minute
    (``astraflow control throttle``; a throttle is per worker): the trainer starves, and the controller decides
    2 workers (the launcher starts raas-1). The test then lifts the throttle: rollout outruns the trainer,
    backpressure pauses the workers while the trainer is busy, and the controller decides 1 worker (the
    launcher stops raas-1, retired, exit 0). Both decisions with their reasons are in the controller's log and the
    newest on ``control``."""
    import json
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    run = f"ctlrun{uuid.uuid4().hex[:8]}"
    root = Path(__file__).resolve().parents[2]
    args = ["examples/arith-tiny.yaml", f"run={run}", f"run_dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")

    def control(*more):
        subprocess.run([sys.executable, "-m", "astraflow", "control", *more[:1], *args, *more[1:]], cwd=root,
                       env=env, check=True, capture_output=True, timeout=120)

    control("throttle", "--per-minute", "240", "--reason", "test: a slow rollout")
    log = tmp_path / "logs" / "controller.log"
    proc = subprocess.Popen([sys.executable, "-m", "astraflow", "run", *args, "policies.actor.steps=200",
                             "controller.enabled=true", "controller.interval_s=2", "controller.window=3",
                             "controller.cooldown_s=10", "controller.max_workers=2", "controller.busy_below=0.1"],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while "-> 2 workers" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "no scale-up decision"
            time.sleep(1)
        control("throttle", "--reason", "test: rollout is fast now")  # lifted
        stderr = proc.communicate(timeout=400)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    decisions = log.read_text()
    assert "-> 2 workers: trainers starved" in decisions
    assert "-> 1 workers: trainers busy" in decisions and "workers held back" in decisions
    assert decisions.index("-> 2 workers") < decisions.index("-> 1 workers")
    control_topic = LatestByKey(connect(f"local://{tmp_path / 'bus'}"), TopicNames(run).control, Control)
    try:
        decision = control_topic.read_to_end().get("raas.single_turn")
    finally:
        control_topic.close()
    assert decision.action == "target_replicas" and decision.value == 1 and "trainers busy" in decision.reason
    components = json.loads((tmp_path / "components.json").read_text())
    assert components["raas-1"]["exit_code"] == 0 and components["controller"]["exit_code"] == 0
    assert f"raas-1: joined {run}.raas.single_turn" in (tmp_path / "logs" / "raas-1.log").read_text()
