"""RaaS workers obey the commands on ``control`` that ``astraflow control`` writes: a pause (for the workflow or
one worker) holds them, a resume lets them go on, a throttle caps the prompts they roll out per minute; a
worker started after a command obeys it (the topic is compacted, the command is its state)."""
import pytest
from typer.testing import CliRunner

from astraflow.cli import app
from astraflow.config import load_config
from astraflow.monitor import RunMonitor
from producers.raas import RaasWorker
from raas_rig import acquired_run, reported, run_config
from topics.bus import connect
from topics.schemas import Control


def _config(tmp_path, bus_url, tiny_model_dir):
    return run_config(tmp_path, bus_url, tiny_model_dir, prompts=100, max_inflight_groups=1000, max_staleness=100)


def _control(path, *args, seen_by=()):
    """``astraflow control ACTION CONFIG ARGS...``; then waits until ``seen_by`` workers have read it."""
    result = CliRunner().invoke(app, ["control", *args[:1], str(path), *args[1:]])
    assert result.exit_code == 0, result.output
    for worker in seen_by:
        worker.commands.read_to_end()
    return result.output


def test_pause_resume_and_throttle_for_the_workflow_and_for_one_worker(tmp_path, bus_url, tiny_model_dir):
    path = _config(tmp_path, bus_url, tiny_model_dir)
    run = acquired_run(path, 2)
    produced = run.produced

    def steps(worker, n=6, until=None):
        """``n`` steps (or fewer, once ``until`` groups were produced); the groups produced then."""
        for _ in range(n):
            worker.step()
            if until is not None and produced() >= until:
                break
        return produced()

    assert "raas.single_turn: pause" in _control(path, "pause", "--reason", "maintenance")
    worker = run.worker()  # started after the pause: obeys it
    try:
        assert steps(worker) == 0
        assert worker.paused_reason == "paused by control (raas.single_turn: maintenance)"
        # a worker's resume does not lift the workflow's pause
        _control(path, "resume", "--worker", "0", seen_by=(worker,))
        assert steps(worker) == 0
        _control(path, "resume", seen_by=(worker,))
        assert steps(worker, 20, until=4) >= 4 and worker.paused_reason == ""  # one group per prompt

        _control(path, "pause", "--worker", "0", seen_by=(worker,))  # one worker: this one
        for _ in range(40):  # a pause starts no prompt: the ones in flight finish
            if not worker.episodes:
                break
            worker.step()
        assert not worker.episodes
        before = produced()
        assert steps(worker) == before
        assert worker.paused_reason.startswith("paused by control (raas.single_turn/raas-0")
        other = run.worker(1)  # another worker is not held
        try:
            for _ in range(30):  # both step: the group rebalances, and the other worker gets a partition
                worker.step()
                if other.step():
                    break
            assert produced() > before and other.paused_reason == ""
        finally:
            other.close()
        _control(path, "resume", "--worker", "0", seen_by=(worker,))

        # Throttles: the lower rate holds. At 3 prompts a minute: one batch of 2, then 40 s until the next.
        _control(path, "throttle", "--per-minute", "600", seen_by=(worker,))
        _control(path, "throttle", "--worker", "0", "--per-minute", "3", seen_by=(worker,))
        worker._last_batch = (0.0, 0)  # count from now
        before = produced()
        assert steps(worker, 20) == before + 2  # 20 steps take a few seconds
        assert worker.paused_reason == "throttled by control to 3 prompts a minute"
        held = reported(worker)
        assert (held["throttled"], held["paused_by_control"], held["paused"]) == (1.0, 0.0, 0.0)
        monitor = RunMonitor(run.bus, run.names, ["actor"], "single_turn")  # what astraflow status shows
        try:
            for _ in range(40):
                monitor.poll(0.5)
                if monitor.controlled_workers():
                    break
            assert monitor.snapshot()["held_by_control"] == {"raas-0": "throttled"}
        finally:
            monitor.close()
        # lifted: the workflow's 600 a minute holds now, a batch of 2 every 0.2 s
        _control(path, "throttle", "--worker", "0", seen_by=(worker,))
        assert steps(worker, 40, until=before + 8) >= before + 8, worker.paused_reason
    finally:
        worker.close()


@pytest.mark.parametrize("bus_url", ["local"], indirect=True)
def test_bad_commands_are_refused_naming_the_field(tmp_path, bus_url, tiny_model_dir):
    path = _config(tmp_path, bus_url, tiny_model_dir)
    runner = CliRunner()
    bad = runner.invoke(app, ["control", "stop", str(path)])
    assert bad.exit_code == 2 and "action 'stop': one of pause, resume, throttle" in bad.output
    bad = runner.invoke(app, ["control", "pause", str(path), "--per-minute", "3"])
    assert bad.exit_code == 2 and "--per-minute is for throttle, not pause" in bad.output
    bad = runner.invoke(app, ["control", "throttle", str(path), "--per-minute", "0"])
    assert bad.exit_code == 2 and "--per-minute" in bad.output
    # too large to encode: refused by name, not a msgpack traceback
    bad = runner.invoke(app, ["control", "throttle", str(path), "--per-minute", "99999999999999999999"])
    assert bad.exit_code == 2 and "--per-minute" in bad.output and "Traceback" not in bad.output
    assert runner.invoke(app, ["control", "throttle", str(path), "--per-minute", "1000000"]).exit_code == 0
    for worker in ("", "a/b", "0 1", "x" * 65):  # no worker can have this --worker-id
        bad = runner.invoke(app, ["control", "pause", str(path), "--worker", worker])
        assert bad.exit_code == 2 and f"--worker {worker!r}: a worker's --worker-id" in bad.output, bad.output
    with pytest.raises(ValueError, match="pause takes no value"):
        Control(component="raas.x", action="pause", value=3)
    with pytest.raises(ValueError, match="target_replicas needs a value of at least 1"):
        Control(component="raas.x", action="target_replicas")
    assert Control(component="raas.x/raas-0", action="resume").key() == "raas.x/raas-0:pause"
    assert Control(component="raas.x", action="throttle", value=5).key() == "raas.x:throttle"
    assert Control(component="raas.x", action="target_replicas", value=2).key() == "raas.x"


@pytest.mark.parametrize("bus_url", ["local"], indirect=True)
def test_a_command_for_a_run_or_worker_not_there_is_kept_with_a_warning(tmp_path, bus_url, tiny_model_dir):
    """A command is kept for a run or worker that starts later, but a mistyped ``run=`` or ``--worker`` must not
    wait silently: the command says that no such run has topics yet, or that no such worker is in the group."""
    path = _config(tmp_path, bus_url, tiny_model_dir)
    runner = CliRunner()
    result = runner.invoke(app, ["control", "pause", str(path)])
    assert result.exit_code == 0, result.output
    assert "warning: run 'rig" in result.output and "has no topics" in result.output
    assert "kept for when it starts" in result.output
    cfg = load_config(path)
    bus = connect(cfg.bus, cfg.kafka)
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    try:
        worker.step()  # joins the group
        result = runner.invoke(app, ["control", "throttle", str(path), "--worker", "42", "--per-minute", "5"])
        assert result.exit_code == 0, result.output
        assert "warning: --worker 42: no worker raas-42 is in the run's RaaS group now (members: raas-0" \
            in result.output
        result = runner.invoke(app, ["control", "resume", str(path), "--worker", "raas-0"])  # the name, not the id
        assert result.exit_code == 0 and "(--worker takes the --worker-id: 0 for raas-0)" in result.output
        result = runner.invoke(app, ["control", "resume", str(path), "--worker", "0"])
        assert result.exit_code == 0 and "warning" not in result.output, result.output
        result = runner.invoke(app, ["control", "throttle", str(path)])
        assert result.exit_code == 0 and "raas.single_turn: throttle lifted" in result.output, result.output
    finally:
        worker.close()
