"""RaaS backpressure, per policy: a worker stops at raas.max_inflight_groups groups waiting for the
filter and trainer, resumes by exactly what the trainer reports it has consumed (its weight
announcement, or its progress heartbeat without a new version), and a finished trainer holds nothing."""
import uuid
from pathlib import Path

from safetensors.torch import load_file

from astraflow.config import load_config
from policies.processor import FilterProcessor
from policies.config import policy_spec
from policies.registry import build_chain
from producers.acquisition import acquire_run
from producers.raas import RaasWorker
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.follow import LatestByKey
from topics.schemas import Metric, TrainerProgress
from weights.publisher import Publisher
from weights.store import WeightStore


def reported(worker: RaasWorker) -> dict[str, float]:
    """The figures ``worker`` reports on ``metrics`` now: it sends a Metric, then this reads its newest one back."""
    worker._maybe_metrics(every_s=0.0)
    worker.producer.flush()
    metrics = LatestByKey(worker.bus, worker.names.metrics, Metric)
    try:
        return metrics.read_to_end()[worker.id].values
    finally:
        metrics.close()


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
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=2)
    assert acquire_run(cfg.acquisition_section()) == 40
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    produced = lambda: sum(bus.admin().end_offsets(names.trajectories("actor")).values())  # noqa: E731
    try:
        # Nothing filtered or trained: every group is in flight. Two per batch, so the worker
        # rolls out while a batch fits under the limit, and stops at 8.
        for _ in range(20):
            worker.step()
        assert produced() == 8
        assert "8 groups of actor in flight, and a batch of 2 more would pass its limit 8" in worker.paused_reason
        # paused_frac: the share of the time between two metrics the worker was held back (here all of it)
        worker._maybe_metrics(every_s=0.0)
        for _ in range(5):
            worker.step()
        values = reported(worker)
        assert values["paused"] == 1.0 and values["paused_frac"] > 0.95

        filt = FilterProcessor(bus, cfg.run, "actor", build_chain([policy_spec({"name": "accept_all"})]), linger_s=0.0)
        while filt.totals["consumed"] < 8:
            filt.step()
        filt.close()
        # The filter moved all 8 to samples; the trainer announces version 1 at a position 6 offsets
        # short of the end (offsets, not records: on Kafka, transaction markers take offsets too).
        end = sum(bus.admin().end_offsets(names.samples("actor")).values())
        state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
        pub = Publisher(WeightStore(cfg.store, cfg.run), bus, names, "actor")
        pub.publish(state, 1, samples_consumed=end - 6)
        assert pub.wait(30) and not pub.errors
        pub.close()
        for _ in range(20):
            worker.step()
        assert worker.engines["actor"].version == 1
        assert produced() == 10  # 6 in flight: one more batch, then 8 again
        assert "8 groups of actor in flight" in worker.paused_reason

        # A heartbeat, no new version (e.g. the trainer dropped stale groups): the trainer is at the
        # end of samples; 2 groups still wait for the filter. Rolls out to 8 in flight again.
        producer = bus.producer()

        def heartbeat(**kw):
            msg = TrainerProgress(policy="actor", version=1, **kw)
            producer.send(names.control, encode(msg), key="trainer.actor", headers=headers_for(msg))
            producer.flush()

        heartbeat(consumed=sum(bus.admin().end_offsets(names.samples("actor")).values()))
        for _ in range(20):
            worker.step()
        assert produced() == 16 and "8 groups of actor in flight" in worker.paused_reason
        # The trainer reports a version more than max_staleness past this engine's, nothing in flight: what it
        # rolled out now would be dropped as stale, so it waits for those weights.
        ahead = 1 + cfg.policies["actor"].max_staleness + 1
        msg = TrainerProgress(policy="actor", version=ahead, consumed=produced() * 2)
        producer.send(names.control, encode(msg), key="trainer.actor", headers=headers_for(msg))
        producer.flush()
        for _ in range(5):
            worker.step()
        assert produced() == 16
        assert f"actor weights {ahead - 1} versions behind its trainer" in worker.paused_reason
        # The trainer finished: this policy holds nothing back; all 40 prompts are rolled out.
        heartbeat(consumed=0, finished=True)
        for _ in range(20):
            worker.step()
        assert produced() == 40 and worker.paused_reason == ""
        producer.close()
    finally:
        worker.close()


def test_a_batch_that_would_be_trained_too_stale_is_not_rolled_out(tmp_path, bus_url, tiny_model_dir):
    """At the trainer's pace (batch_groups per version), a batch started with the groups in flight ahead of it
    is trained about version + inflight // batch_groups: past max_staleness, the worker waits instead of
    producing groups only for them to be dropped, and goes on once its engine has the trainer's version."""
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: st{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: {bus_url}
policies:
  actor: {{model: {tiny_model_dir}, batch_groups: 2, max_staleness: 1, checkpoint_every: 1000}}
workflow: {{name: single_turn}}
data: {{sources: [{{name: arith, limit: 20}}], n_samples: 2}}
sampling: {{max_new_tokens: 2}}
raas: {{batch_prompts: 2, max_inflight_groups: 100}}
""")
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=2)
    assert acquire_run(cfg.acquisition_section()) == 20
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    producer = bus.producer()
    produced = lambda: sum(bus.admin().end_offsets(names.trajectories("actor")).values())  # noqa: E731

    def progress(version: int, consumed: int) -> None:
        msg = TrainerProgress(policy="actor", version=version, consumed=consumed)
        producer.send(names.control, encode(msg), key="trainer.actor", headers=headers_for(msg))
        producer.flush()

    try:
        progress(0, 0)
        for _ in range(10):
            worker.step()
        # 0 in flight: trained at version 0; 2 in flight: at version 1 (staleness 1, allowed); 4: staleness 2
        assert produced() == 4
        assert ("a batch of actor rolled out now would be trained about 2 versions stale (4 groups in flight "
                "ahead of it; max_staleness 1)") in worker.paused_reason
        # The trainer takes all 4 (the filter moved them) and publishes version 2; the engine pulls it.
        filt = FilterProcessor(bus, cfg.run, "actor", build_chain([policy_spec({"name": "accept_all"})]), linger_s=0.0)
        while filt.totals["consumed"] < 4:
            filt.step()
        filt.close()
        end = sum(bus.admin().end_offsets(names.samples("actor")).values())
        pub = Publisher(WeightStore(cfg.store, cfg.run), bus, names, "actor")
        pub.publish(load_file(str(Path(tiny_model_dir) / "model.safetensors")), 2, samples_consumed=end)
        assert pub.wait(30) and not pub.errors
        pub.close()
        progress(2, end)
        for _ in range(10):
            worker.step()
        assert worker.engines["actor"].version == 2 and produced() == 8
        assert "about 2 versions stale" in worker.paused_reason
    finally:
        producer.close()
        worker.close()
