"""`astraflow run` refuses a bad config before starting anything, naming what is wrong; `status` says when
a run is not on the bus."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from astraflow.cli import app
from astraflow.launched import EXIT_BAD_INPUT


@pytest.mark.parametrize("override, message", [
    ("workflow.name=nope", "invalid run config examples/arith-tiny.yaml: unknown workflow 'nope'; registered: ["),
    ("policies.actor.filters=[{name: nope}]", "policies.actor.filters.0: unknown policy name; known here: accept_all"),
    ("policies.actor.serving=[{name: nope}]", "policies.actor.serving.0: unknown policy name; known here: replay, or "),
    ("policies.actor.serving=[{name: mix, weights: {arith: 1}}]", "policies.actor.serving.0: unknown policy name"),
    ("curators=[{name: greso, p_eazy: 0.3}]", "curators.0.greso.p_eazy: Extra inputs are not permitted"),
    ("curators=[{name: greso, p_easy: 1.5}]", "curators.0.greso: policy 'greso', parameter 'p_easy': must be in "
                                               "(0, 1], got 1.5"),
    ("policies.actor.serving=[{name: replay}, {name: replay}]",
     "policy 'replay': 2 serving policies given; the serving stage takes one (policies.actor.serving)"),
    ("policies.actor.serving=[{name: replay, ratio: 1.5}]",
     "policies.actor.serving.0.replay: policy 'replay', parameter 'ratio': must be in [0, 1), got 1.5"),
    ("policies.actor.serving=[{name: replay, ratio: 0.5, max_staleness: 8}]",  # the example's bound is 4
     "policies.actor: serving[0].max_staleness 8 is above max_staleness 4: a serving policy obeys the policy's bound"),
    ("policies.actor.model=/nonexistent", "/nonexistent is not an HF model directory"),
    ("data.sources=[{name: nosuchdataset}]", "unknown prompt source 'nosuchdataset': neither a built-in"),
    ("bus=kafka://127.0.0.1:1", "cannot use bus kafka://127.0.0.1:1: cannot reach Kafka at 127.0.0.1:1"),
    ("store=ftp://x", "store: weight store URI 'ftp://x' must be file:///abs/dir or s3://bucket/prefix"),
    ("data.n_samples=1", "data.n_samples: Input should be greater than or equal to 2"),
    ("policies.actor.trainer.device=garbage", "policies.actor.trainer.device: String should match pattern"),
    ("policies.actor.trainer.device=cuda", "policies.actor.trainer.device is 'cuda', and torch sees no CUDA device"),
    ("store=file://relative/dir", "store: weight store URI 'file://relative/dir': a file:// path must be absolute"),
    # two files both named train.*, or one source twice: the same prompt ids, one's records dropped as duplicates
    ("data.sources=[{name: arith}, {name: arith, limit: 5}]",
     "sources[0] (arith) and sources[1] (arith) share the source name 'arith', which every prompt_id is made of"),
])
def test_run_preflight_rejects_bad_config(tmp_path, override, message):
    result = CliRunner().invoke(app, ["run", "examples/arith-tiny.yaml", f"run_dir={tmp_path}", override])
    assert result.exit_code == 2
    assert message in result.output
    assert not any(tmp_path.iterdir())  # nothing was started or written


#: a bad field of each kind of plugin, and what the refusal says
BAD_PLUGIN_FIELDS = [
    ("curators=[{name: filter_solved, treshold: 0.5}]",
     "curators.0.filter_solved.treshold: Extra inputs are not permitted"),
    ("policies.actor.filters=[{name: filter_length, max_tokenz: 64}]",
     "policies.actor.filters.0.filter_length.max_tokenz: Extra inputs are not permitted"),
    ("policies.actor.serving=[{name: replay, ratoi: 0.5}]",
     "policies.actor.serving.0.replay.ratoi: Extra inputs are not permitted"),
    ("policies.actor.serving=[{name: replay, ratio: 1.5}]",
     "policies.actor.serving.0.replay: policy 'replay', parameter 'ratio': must be in [0, 1), got 1.5"),
]
#: every command that reads a run config, with the options it needs
CONFIG_COMMANDS = [(["acquire"], []), (["raas"], []), (["policy"], ["--policy", "actor"]),
                   (["trainer"], ["--policy", "actor"]), (["controller"], []), (["exporter"], []), (["tracker"], []),
                   (["replay"], ["--policy", "actor"]), (["eval"], ["--policy", "actor"]), (["control", "pause"], [])]


@pytest.mark.parametrize("command, options, override, message", [
    *[(["run"], [], *bad) for bad in BAD_PLUGIN_FIELDS],  # every kind by astraflow run, each command one kind
    *[(*cmd, *BAD_PLUGIN_FIELDS[i % len(BAD_PLUGIN_FIELDS)]) for i, cmd in enumerate(CONFIG_COMMANDS)]])
def test_every_command_refuses_a_bad_plugin_field_before_starting(tmp_path, command, options, override, message):
    """The run config, plugins included, is validated when it is read: each command exits 2 naming the field."""
    args = [*command, "examples/arith-tiny.yaml", f"run_dir={tmp_path}", override, *options]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not any(tmp_path.iterdir())  # nothing was started or written


def test_run_gives_its_raas_workers_the_vllm_server_it_starts_as_an_option(tmp_path, tiny_model_dir):
    from astraflow.config import load_config
    from astraflow.launcher.plan import plan_components

    cfg = load_config(None, ["policies.actor.model=tiny", "policies.actor.engine=vllm", "policies.actor.vllm.port=8123",
                             f"policies.actor.vllm.python={sys.executable}", f"run_dir={tmp_path}"])
    raas = next(c for c in plan_components(cfg, tmp_path / "run.yaml", ["seed=1"]) if c.name == "raas-0")
    assert raas.argv[raas.argv.index("--vllm-url") + 1] == "actor=http://127.0.0.1:8123"
    assert "seed=1" in raas.argv and not any("started_url" in a for a in raas.argv)
    refused = CliRunner().invoke(app, ["raas", "examples/arith-tiny.yaml", f"run_dir={tmp_path}",
                                       "--vllm-url", "critic=http://127.0.0.1:8123"])
    assert refused.exit_code == 2
    assert "--vllm-url 'critic=http://127.0.0.1:8123': give POLICY=URL, POLICY one of ['actor']" in refused.output


def test_unreachable_broker_is_one_line_on_stderr(tmp_path):
    """librdkafka's own per-attempt "Connection refused" lines (C-level stderr) stay quiet."""
    out = subprocess.run([sys.executable, "-m", "astraflow", "run", "examples/arith-tiny.yaml", f"run_dir={tmp_path}",
                          "bus=kafka://127.0.0.1:1"], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("cannot use bus kafka://127.0.0.1:1: cannot reach Kafka")


def test_status_of_a_run_not_on_the_bus_exits_1_and_creates_nothing(tmp_path):
    result = CliRunner().invoke(app, ["status", "examples/arith-tiny.yaml", "run=nosuch", f"run_dir={tmp_path}",
                                      "--seconds", "0.5", "--json"])
    assert result.exit_code == 1
    assert "run 'nosuch' has no metrics topic on local://" in result.output
    assert list((tmp_path / "bus" / "topics").glob("nosuch*")) == []  # a mistyped run= makes no topics


@pytest.mark.parametrize("command", [["status"], ["raas"], ["trainer", "--policy", "actor"],
                                     ["policy", "--policy", "actor"], ["acquire"]])
def test_component_commands_refuse_an_unusable_bus_in_one_line(command):
    result = CliRunner().invoke(app, [*command, "examples/arith-tiny.yaml", "bus=foo://x"])
    assert result.exit_code == 2
    assert result.output.strip() == "cannot use bus foo://x: bus URL 'foo://x': unknown scheme 'foo' (use kafka:// or local://)"


def test_verify_rewards_names_the_missing_field_and_the_fields_a_record_has(tmp_path):
    data = tmp_path / "sol.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+{i}?", "solution": str(2 * i)}) + "\n" for i in range(3)))
    result = CliRunner().invoke(app, ["verify-rewards", "--dataset", str(data)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)  # no traceback
    assert result.output.splitlines() == [
        f"skipped 3 of 3 record(s) that cannot be made a prompt; the first: {data}:1: no field 'answer' "
        "(fields: ['problem', 'solution'])",
        f"--dataset '{data}': no record to score (--answer-field names the gold answer's field)"]


def test_verify_rewards_takes_the_first_element_of_a_list_valued_answer_field(tmp_path):
    data = tmp_path / "golds.jsonl"
    data.write_text(json.dumps({"problem": "What is 6*7?", "golds": ["42", "forty-two"]}) + "\n"
                    + json.dumps({"problem": "What is 1/2?", "golds": ["\\frac{1}{2}", "0.5"]}) + "\n"
                    + json.dumps({"problem": "What is 0?", "golds": []}) + "\n")
    result = CliRunner().invoke(app, ["verify-rewards", "--dataset", str(data), "--answer-field", "golds"])
    assert result.exit_code == 0, result.output
    assert f"skipped 1 of 3 record(s) that cannot be made a prompt; the first: {data}:3: field 'golds' is an " \
           "empty list" in result.output
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"gold_accept": 1.0, "wrong_reject": 1.0, "n": 2}


def test_verify_rewards_exits_1_when_a_reward_disagrees(tmp_path):
    """The wrong answer made of 10^0 is 20^0, which equals it: the math reward accepts it."""
    data = tmp_path / "powers.jsonl"
    data.write_text(json.dumps({"problem": "What is 6*7?", "answer": "42"}) + "\n"
                    + json.dumps({"problem": "What is 10^0?", "answer": "10^0"}) + "\n")
    result = CliRunner().invoke(app, ["verify-rewards", "--dataset", str(data)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "disagreements" in result.stdout and "20^0" in result.stdout
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"gold_accept": 1.0, "wrong_reject": 0.5, "n": 2}


def test_acquire_with_strict_data_exits_non_zero_at_the_first_bad_record(tmp_path):
    """In a subprocess: a component command installs signal handlers and logging for its process."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"a": 1, "b": 2}\n{"a": 3\n{"a": 5, "b": 6}\n')

    def acquire(*overrides):
        return subprocess.run([sys.executable, "-m", "astraflow", "acquire", "examples/arith-tiny.yaml",
                               f"data.sources=[{{name: {data}, adapter: arith}}]", "data.epochs=1", *overrides],
                              cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)

    strict = acquire(f"run_dir={tmp_path / 'strict'}", "data.strict=true")
    assert strict.returncode == EXIT_BAD_INPUT == 3 and "Traceback" not in strict.stderr, strict.stderr
    assert strict.stderr.strip().splitlines()[-1] == \
        f"acquisition stopped: {data}:2: not JSON (Expecting ',' delimiter: line 1 column 8 (char 7))"
    lenient = acquire(f"run_dir={tmp_path / 'lenient'}")
    assert lenient.returncode == 0, lenient.stderr
    assert f"rejected {data}:2: not JSON" in lenient.stderr
    assert "source p: 2 prompts sent, 1 bad records rejected to arith-tiny.deadletter (in all)" in lenient.stderr


def test_a_second_run_on_a_run_dir_in_use_is_refused_naming_the_launcher(tmp_path):
    """Two launchers on one run_dir would start two sets of components that fence each other's trainers and
    publish into one store: while a process holds the run directory, `astraflow run` there exits 2 at once."""
    from astraflow.launcher.run_dir_lock import hold_run_dir

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from astraflow.launcher.run_dir_lock import hold_run_dir; "
                               "hold_run_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)",
                               str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = CliRunner().invoke(app, ["run", "examples/arith-tiny.yaml", f"run_dir={tmp_path}",
                                          f"bus=local://{tmp_path / 'bus'}"])
        assert result.exit_code == 2
        assert f"is in use by another `astraflow run` (pid {holder.pid})" in " ".join(result.output.split())
        assert not (tmp_path / "logs").exists()  # nothing was started
    finally:
        holder.kill()
        holder.wait()
    hold_run_dir(tmp_path)  # a killed holder's lock is gone with it


def _catches_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("command", [["raas"], ["policy", "--policy", "actor"], ["trainer", "--policy", "actor"]])
def test_a_component_catches_sigterm_before_it_loads_torch_and_a_sigterm_then_stops_it_cleanly(tmp_path, command):
    # The launcher retires a RaaS worker it started moments before (scale up, then down) with SIGTERM: one that
    # still imported torch before catching it died of the signal (exit -15) in a CI run
    proc = subprocess.Popen([sys.executable, "-m", "astraflow", *command, "examples/arith-tiny.yaml", "run=early",
                             f"bus=local://{tmp_path / 'bus'}", f"store=file://{tmp_path / 'store'}"],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.001)
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
    finally:
        proc.kill()
        proc.wait()
