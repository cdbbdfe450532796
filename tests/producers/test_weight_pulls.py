"""A RaaS worker pulls new weights in a thread of its own: over a slow store (a real S3 server behind
``scripts/latency_proxy.py``, 300 ms each way) it keeps rolling out with the weights its engine has while the
pull runs, and hands the new version to its engine between batches once the pull is done."""
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from astraflow.config import load_config
from producers.acquisition import acquire_run
from producers.raas import RaasWorker
from topics.bus import connect
from topics.names import TopicNames
from weights.publisher import Publisher
from weights.store import WeightStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bus_url", ["local"], indirect=True)
def test_rollout_goes_on_while_a_slow_pull_runs(tmp_path, bus_url, tiny_model_dir, s3_endpoint, monkeypatch):
    bucket = f"pull-{uuid.uuid4().hex[:8]}"
    httpx.put(f"{s3_endpoint}/{bucket}").raise_for_status()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "latency_proxy.py"), "--one-way-ms", "300",
                              f"127.0.0.1:{port}={s3_endpoint.removeprefix('http://')}"], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert proxy.stdout.readline().strip() == "ready"
        for name, value in (("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}"), ("AWS_ACCESS_KEY_ID", "test"),
                            ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)  # the worker's store: through the slow link
        path = tmp_path / "run.yaml"
        path.write_text(f"""
run: pull{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: {bus_url}
store: s3://{bucket}/weights
policies:
  actor: {{model: {tiny_model_dir}, batch_groups: 4, checkpoint_every: 1000, max_staleness: 100}}
workflow: {{name: single_turn}}
data: {{sources: [{{name: arith, limit: 200}}], n_samples: 2}}
sampling: {{max_new_tokens: 2}}
raas: {{batch_prompts: 2, max_inflight_groups: 1000}}
""")
        cfg = load_config(path)
        names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
        bus.admin().ensure_run_topics(names, ["actor"])
        assert acquire_run(cfg) == 200
        worker = RaasWorker(cfg, 0, bus)
        try:
            direct = WeightStore(cfg.store, cfg.run, endpoint=s3_endpoint)  # the trainer's side: no slow link
            pub = Publisher(direct, bus, names, "actor")
            pub.publish(load_file(str(Path(tiny_model_dir) / "model.safetensors")), 1)
            assert pub.wait(60) and not pub.errors
            pub.close()
            deadline = time.monotonic() + 30
            while "actor" not in worker._pulls:  # the announcement arrives; the next step starts the pull
                assert time.monotonic() < deadline, "no pull started"
                worker.step()
            started, rolled = time.monotonic(), 0
            while worker._pulls.get("actor") is not None and worker._pulls["actor"].is_alive():
                assert time.monotonic() < deadline + 60, "the pull did not end"
                rolled += worker.step()
            pulled_s = time.monotonic() - started
            assert worker.engines["actor"].version == 0  # the pull ran beside the rollout
            assert pulled_s > 1.2 and rolled >= 4, (pulled_s, rolled)  # a full pull is several round trips
            while worker.engines["actor"].version != 1:  # loaded on the engine's thread, between two calls
                assert time.monotonic() < deadline + 90, "version 1 was not loaded"
                worker.step()
            assert worker.pullers["actor"].version == 1
        finally:
            worker.close()
    finally:
        proxy.kill()
        proxy.wait()
