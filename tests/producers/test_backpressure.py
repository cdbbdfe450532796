"""RaaS backpressure: a worker stops at raas.max_inflight_groups groups waiting for the filter and
trainer, and resumes by exactly what the trainer's weight announcement says it has consumed."""
import uuid
from pathlib import Path

from safetensors.torch import load_file

from astraflow.config import load_config
from policies.processor import FilterProcessor
from policies.registry import build_chain
from producers.acquisition import acquire_run
from producers.raas import RaasWorker
from topics.bus import connect
from topics.names import TopicNames
from weights.publisher import Publisher
from weights.store import WeightStore


def test_pauses_at_max_inflight_and_resumes_by_the_announced_position(tmp_path, bus_url, tiny_model_dir):
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: bp{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: {bus_url}
policies:
  actor: {{model: {tiny_model_dir}, batch_groups: 4, checkpoint_every: 1000}}
workflow: {{name: single_turn}}
data: {{sources: [{{name: arith, limit: 40}}], n_samples: 2}}
sampling: {{max_new_tokens: 2}}
raas: {{batch_prompts: 2, max_inflight_groups: 8}}
""")
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus)
    bus.admin().ensure_run_topics(names, ["actor"], partitions=2)
    assert acquire_run(cfg) == 40
    worker = RaasWorker(cfg, 0, bus)
    produced = lambda: sum(bus.admin().end_offsets(names.trajectories("actor")).values())  # noqa: E731
    try:
        # Nothing filtered or trained: every group is in flight. Two per batch, so the worker
        # rolls out while <= 8 are in flight and stops at 10.
        for _ in range(20):
            worker.step()
        assert produced() == 10
        assert "10 groups in flight > raas.max_inflight_groups=8" in worker.paused_reason

        filt = FilterProcessor(bus, cfg.run, "actor", build_chain([{"name": "accept_all"}]), linger_s=0.0)
        while filt.totals["consumed"] < 10:
            filt.step()
        filt.close()
        # The filter moved all 10 to samples; the trainer announces version 1 at a position 8 offsets
        # short of the end (offsets, not records: on Kafka, transaction markers take offsets too).
        end = sum(bus.admin().end_offsets(names.samples("actor")).values())
        state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
        pub = Publisher(WeightStore(cfg.store, cfg.run), bus, names, "actor")
        pub.publish(state, 1, samples_consumed=end - 8)
        assert pub.wait(30) and not pub.errors
        pub.close()
        for _ in range(20):
            worker.step()
        assert worker.engines["actor"].version == 1
        assert produced() == 12  # 8 in flight: one more batch, then 10 again
        assert "10 groups in flight" in worker.paused_reason
    finally:
        worker.close()
