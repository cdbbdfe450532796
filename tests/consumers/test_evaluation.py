"""pass@1 (avg@k) on the tiny model and the arith benchmark; `astraflow eval` offline and live."""
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from astraflow.cli import app
from consumers.evaluation import evaluate, load_benchmark, pull_newest
from producers.hf_engine import HFEngine
from topics.bus import TopicPartition, connect
from topics.codec import decode
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Metric
from weights.publisher import Publisher
from weights.store import WeightStore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir)


def write_config(tmp_path, tiny_model_dir, run, bus_url=None):
    path, bus_url = tmp_path / "run.yaml", bus_url or f"local://{tmp_path / 'bus'}"
    path.write_text(f"run: {run}\nrun_dir: {tmp_path / 'run'}\nbus: {bus_url}\n"
                    f"policies:\n  actor:\n    model: {tiny_model_dir}\nsampling:\n  max_new_tokens: 8\n")
    return path


def zeroed(engine):
    """The engine's parameters, all zero (a visibly different version)."""
    return {k: torch.zeros_like(v) for k, v in engine.model.named_parameters()}


def test_pass_at_1_is_the_mean_of_per_prompt_correctness(engine):
    prompts = load_benchmark("arith", limit=16)
    result = evaluate(engine, prompts, k=2, temperature=0.6, max_new_tokens=8, seed=3, progress=False)
    b = result.benchmarks["arith"]
    assert (result.version, b.n, b.k, b.rewards.shape) == (0, 16, 2, (16, 2))
    assert b.prompt_ids == [p.prompt_id for p in prompts]
    assert set(np.unique(b.rewards)) <= {0.0, 1.0}
    per_prompt = [(row > 0.5).mean() for row in b.rewards]
    assert 0 < b.pass_at_1 < 1
    assert b.pass_at_1 == pytest.approx(np.mean(per_prompt))
    assert b.stderr == pytest.approx(np.std(per_prompt, ddof=1) / 4.0)
    assert result.summary()["arith"]["n"] == 16
    assert result.metric_values()["pass@1.arith"] == pytest.approx(b.pass_at_1)
    again = evaluate(engine, prompts, k=2, temperature=0.6, max_new_tokens=8, seed=3, progress=False)
    np.testing.assert_array_equal(again.benchmarks["arith"].rewards, b.rewards)  # seeded: reproducible


def test_evaluate_rejects_bad_arguments(engine):
    prompts = load_benchmark("arith", limit=2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        evaluate(engine, prompts, k=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        evaluate(engine, prompts, temperature=0.0)


def test_pull_newest_loads_the_newest_stored_version(engine, tmp_path):
    uri, run = (tmp_path / "weights").as_uri(), "pull"
    assert pull_newest(engine, uri, run, "actor") == 0  # nothing published: the base model
    pub = Publisher(WeightStore(uri, run), None, TopicNames(run), "actor")
    pub.publish(zeroed(engine), 1)
    pub.close()
    assert not pub.errors
    assert pull_newest(engine, uri, run, "actor") == 1
    assert all(float(p.detach().abs().sum()) == 0.0 for p in engine.model.parameters())


def test_cli_offline_prints_one_json_line(tiny_model_dir, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, f"ev-{uuid.uuid4().hex[:8]}")
    out = CliRunner().invoke(app, ["eval", str(config), "--benchmark", "arith", "--limit", "8", "--k", "2"])
    assert out.exit_code == 0, out.output
    line = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    assert (line["policy"], line["version"]) == ("actor", 0)
    assert line["results"]["arith"]["n"] == 8 and line["results"]["arith"]["k"] == 2
    assert 0.0 <= line["results"]["arith"]["pass@1"] <= 1.0


@pytest.mark.parametrize("args, message", [
    (["--benchmark", "no-such-benchmark"], "unknown prompt source"),
    (["--policy", "critic"], "unknown policy"),
    (["--k", "0"], "--k must be >= 1"),
])
def test_cli_bad_input_exits_2(tiny_model_dir, tmp_path, args, message):
    config = write_config(tmp_path, tiny_model_dir, "bad")
    out = CliRunner().invoke(app, ["eval", str(config), "--benchmark", "arith", *args])
    assert out.exit_code == 2
    assert message in out.output


@pytest.mark.slow  # a component subprocess: ~30 s on 2 busy cores
def test_live_evaluates_each_new_version_and_stops_on_sigterm(tiny_model_dir, engine, tmp_path, bus_url):
    run = f"ev-{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path, tiny_model_dir, run, bus_url)
    # What version 1 (all-zero: uniform sampling) scores, and what the base model scores, on the same
    # prompts and seeds (cfg.seed 0) as the live evaluator: distinguishable, so that evaluating the wrong
    # version cannot pass.
    prompts = load_benchmark("arith", limit=8)
    args = dict(k=2, temperature=0.6, max_new_tokens=8, seed=0, progress=False)
    base = evaluate(engine, prompts, **args).benchmarks["arith"].pass_at_1
    zero_engine = HFEngine(tiny_model_dir)
    zero_engine.load_weights(zeroed(zero_engine), 1)
    want = evaluate(zero_engine, prompts, **args).benchmarks["arith"].pass_at_1
    assert base > want, (base, want)
    bus, names = connect(bus_url), TopicNames(run)
    ensure_run_topics(bus.admin(), names, ["actor"])
    pub = Publisher(WeightStore((tmp_path / "run" / "weights").as_uri(), run), bus, names, "actor")
    pub.publish(zeroed(engine), 1)
    pub.close()
    assert not pub.errors

    log = (tmp_path / "eval.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "astraflow", "eval", str(config), "--live", "--benchmark",
                             "arith", "--limit", "8", "--k", "2", "--temperature", "0.6"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        consumer = bus.consumer(None)
        consumer.assign([TopicPartition(names.metrics, p) for p in bus.admin().end_offsets(names.metrics)])
        metrics, deadline = [], time.monotonic() + 120
        while not any(m.step == 1 for m in metrics) and time.monotonic() < deadline and proc.poll() is None:
            for rec in consumer.poll(timeout_s=0.5):
                m = decode(rec.value, Metric)
                if m.component == "eval.actor":
                    metrics.append(m)
        consumer.close()
        assert proc.poll() is None, (tmp_path / "eval.log").read_text()
        last = metrics[-1]
        assert (last.kind, last.policy, last.step) == ("eval", "actor", 1)
        assert last.values["pass@1.arith"] == pytest.approx(want) and "stderr.arith" in last.values
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    assert proc.returncode == 0, (tmp_path / "eval.log").read_text()
