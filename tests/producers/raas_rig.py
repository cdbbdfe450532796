"""The RaaS test rig (a test helper): a run of policy ``actor`` on the tiny model, rolling out ``arith`` prompts
with the ``single_turn`` workflow (2 samples of 2 tokens each), its topics created and its prompts acquired, and
what the RaaS tests do around a :class:`~producers.raas.RaasWorker`: count the groups it wrote, publish weights
as the trainer would, and read back the figures it reports."""
import uuid
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file

from astraflow.config import RunConfig, load_config
from producers.acquisition import acquire_run
from producers.raas import RaasWorker
from topics.bus import Bus, TopicPartition, connect
from topics.codec import encode, headers_for
from topics.follow import LatestByKey
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Metric, TrainerProgress
from weights.publisher import Publisher


def run_config(tmp_path: Path, bus_url: str, tiny_model_dir, *, prompts: int, max_inflight_groups: int,
               batch_groups: int = 4, max_staleness: int | None = None, store: str | None = None) -> Path:
    """Write the rig's run config (a fresh run name, ``raas.batch_prompts`` 2) under ``tmp_path``; returns its
    path. ``prompts``: the arith records used; ``max_staleness`` None: the config's default; ``store`` None:
    the run's default store."""
    staleness = "" if max_staleness is None else f", max_staleness: {max_staleness}"
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: rig{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: {bus_url}
{f'store: {store}' if store else ''}
policies:
  actor: {{model: {tiny_model_dir}, batch_groups: {batch_groups}, checkpoint_every: 1000{staleness}}}
workflow: {{name: single_turn}}
data: {{sources: [{{name: arith, limit: {prompts}}}], n_samples: 2}}
sampling: {{max_new_tokens: 2}}
raas: {{batch_prompts: 2, max_inflight_groups: {max_inflight_groups}}}
""")
    return path


@dataclass
class RaasRun:
    """A run of the rig's config with its topics and its prompts acquired."""

    path: Path
    cfg: RunConfig
    names: TopicNames
    bus: Bus

    def produced(self) -> int:
        """Groups RaaS workers wrote to ``trajectories.actor`` so far (its end offsets, summed)."""
        return sum(self.bus.admin().end_offsets(self.names.trajectories("actor")).values())

    def samples_end(self) -> int:
        """The end of ``samples.actor`` (offsets, summed over partitions: what a trainer at the end consumed)."""
        return sum(self.bus.admin().end_offsets(self.names.samples("actor")).values())

    def worker(self, worker_id: int = 0) -> RaasWorker:
        """A RaaS worker of this run (the caller closes it)."""
        return RaasWorker(self.cfg.raas_section(), worker_id, self.bus)

    def commit_trainer(self, lag: int) -> None:
        """Commit the trainer group's offsets on ``samples.actor`` ``lag`` offsets short of the end (summed over
        partitions), as a trainer commits its position after each step."""
        offsets = {}
        for partition, end in sorted(self.bus.admin().end_offsets(self.names.samples("actor")).items()):
            short = min(lag, end)
            offsets[TopicPartition(self.names.samples("actor"), partition)] = end - short
            lag -= short
        assert lag == 0, f"samples.actor has fewer offsets than the lag asked for ({lag} left)"
        consumer = self.bus.consumer(self.names.trainer_group("actor"), client_id="rig-trainer")
        try:
            consumer.commit(offsets)
        finally:
            consumer.close()

    def report_progress(self, version: int, consumed: int, finished: bool = False, starving: bool = False) -> None:
        """Send the trainer's :class:`TrainerProgress` heartbeat for ``actor`` (flushed)."""
        msg = TrainerProgress(policy="actor", version=version, consumed=consumed, finished=finished,
                              starving=starving)
        producer = self.bus.producer()
        try:
            producer.send(self.names.control, encode(msg), key="trainer.actor", headers=headers_for(msg))
            producer.flush()
        finally:
            producer.close()


def acquired_run(path: Path, partitions: int = 4) -> RaasRun:
    """Load the run config at ``path``, create its topics (``partitions`` each) and acquire all its prompts."""
    cfg = load_config(path)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=partitions)
    assert acquire_run(cfg.acquisition_section()) == cfg.data.sources[0].limit
    return RaasRun(path, cfg, names, bus)


def publish_model(publisher: Publisher, tiny_model_dir, version: int, samples_consumed: int | None = None) -> None:
    """Publish the tiny model's weights as ``version`` (durable and announced when this returns)."""
    publisher.publish(load_file(str(Path(tiny_model_dir) / "model.safetensors")), version, samples_consumed)
    assert publisher.wait(60) and not publisher.errors


def reported(worker: RaasWorker) -> dict[str, float]:
    """The figures ``worker`` reports on ``metrics`` now: it sends a Metric, then this reads its newest one back."""
    worker._maybe_metrics(every_s=0.0)
    worker.producer.flush()
    metrics = LatestByKey(worker.bus, worker.names.metrics, Metric)
    try:
        return metrics.read_to_end()[worker.id].values
    finally:
        metrics.close()
