"""RaaS backpressure, per policy: a worker stops at raas.max_inflight_groups groups waiting for the
filter and trainer (all of them while the trainer has committed nothing), resumes by exactly what the trainer group
has committed (a trainer commits its position after every step), and a finished or starving trainer holds nothing.
While the groups in flight cannot be counted (a bus error), the worker stays paused until the bus answers."""
import logging

from policies.config import policy_spec
from policies.processor import FilterProcessor
from policies.registry import build_chain
from raas_rig import acquired_run, publish_model, reported, run_config
from topics.layout import ensure_run_topics
from weights.publisher import Publisher
from weights.store import WeightStore


def _filter_all(run, groups: int) -> None:
    """Move ``groups`` groups from ``trajectories.actor`` to ``samples.actor`` (the accept_all filter)."""
    filt = FilterProcessor(run.bus, run.cfg.run, "actor", build_chain([policy_spec({"name": "accept_all"})]), linger_s=0.0)
    while filt.totals["consumed"] < groups:
        filt.step()
    filt.close()


def _publish(run, tiny_model_dir, version: int, samples_consumed: int) -> None:
    """The trainer publishes ``version`` at position ``samples_consumed``."""
    pub = Publisher(WeightStore(run.cfg.store, run.cfg.run), run.bus, run.names, "actor")
    try:
        publish_model(pub, tiny_model_dir, version, samples_consumed)
    finally:
        pub.close()


def test_pauses_at_max_inflight_and_resumes_by_the_trainers_committed_position(tmp_path, bus_url, tiny_model_dir):
    run = acquired_run(run_config(tmp_path, bus_url, tiny_model_dir, prompts=40, max_inflight_groups=8), 2)
    worker, produced = run.worker(), run.produced
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

        _filter_all(run, 8)
        # All 8 wait in samples, and the trainer has committed nothing (still loading): it has read nothing, so
        # all 8 stay in flight
        for _ in range(20):
            worker.step()
        assert produced() == 8
        # The trainer trains version 1 and commits its position 6 offsets short of the end (offsets, not records:
        # on Kafka, transaction markers take offsets too); it publishes version 1.
        run.commit_trainer(6)
        _publish(run, tiny_model_dir, 1, run.samples_end() - 6)
        for _ in range(20):
            worker.step()
        assert worker.engines["actor"].version == 1
        assert produced() == 10  # 6 in flight: one more batch, then 8 again
        assert "8 groups of actor in flight" in worker.paused_reason

        # No new version, but the trainer's commit moved (e.g. it dropped stale groups): the trainer is at the end
        # of samples; 2 groups still wait for the filter. Rolls out to 8 in flight again.
        run.commit_trainer(0)
        for _ in range(20):
            worker.step()
        assert produced() == 16 and "8 groups of actor in flight" in worker.paused_reason
        # The trainer reports a version more than max_staleness past this engine's, nothing in flight: what it
        # rolled out now would be dropped as stale, so it waits for those weights.
        ahead = 1 + run.cfg.policies["actor"].max_staleness + 1
        run.report_progress(ahead, produced() * 2)
        for _ in range(5):
            worker.step()
        assert produced() == 16
        assert f"actor weights {ahead - 1} versions behind its trainer" in worker.paused_reason
        # The trainer finished: this policy holds nothing back; all 40 prompts are rolled out.
        run.report_progress(1, 0, finished=True)
        for _ in range(20):
            worker.step()
        assert produced() == 40 and worker.paused_reason == ""
    finally:
        worker.close()


def test_a_batch_that_would_be_trained_too_stale_is_not_rolled_out(tmp_path, bus_url, tiny_model_dir):
    """At the trainer's pace (batch_groups per version), a batch started with the groups in flight ahead of it
    is trained about version + inflight // batch_groups: past max_staleness, the worker waits instead of
    producing groups only for them to be dropped, and goes on once its engine has the trainer's version."""
    run = acquired_run(run_config(tmp_path, bus_url, tiny_model_dir, prompts=20, max_inflight_groups=100,
                                  batch_groups=2, max_staleness=1), 2)
    worker, produced = run.worker(), run.produced
    try:
        run.report_progress(0, 0)
        for _ in range(10):
            worker.step()
        # 0 in flight: trained at version 0; 2 in flight: at version 1 (staleness 1, allowed); 4: staleness 2
        assert produced() == 4
        assert ("a batch of actor rolled out now would be trained about 2 versions stale (4 groups in flight "
                "ahead of it; max_staleness 1)") in worker.paused_reason
        # The trainer takes all 4 (the filter moved them) and publishes version 2; the engine pulls it.
        _filter_all(run, 4)
        end = run.samples_end()
        run.commit_trainer(0)
        _publish(run, tiny_model_dir, 2, end)
        run.report_progress(2, end)
        for _ in range(10):
            worker.step()
        assert worker.engines["actor"].version == 2 and produced() == 8
        assert "about 2 versions stale" in worker.paused_reason
    finally:
        worker.close()



def test_a_bus_error_counting_the_groups_in_flight_keeps_the_worker_paused_until_the_bus_answers(tmp_path,
                                                                                                tiny_model_dir,
                                                                                                caplog):
    """``samples.actor`` is deleted under the worker: the trainer's position cannot be read, so the groups in
    flight are unknown. The worker rolls nothing out and warns once (not at every tick); once the topic is back,
    it says so and rolls every prompt out."""
    run = acquired_run(run_config(tmp_path, f"local://{tmp_path / 'bus'}", tiny_model_dir, prompts=12,
                                  max_inflight_groups=100), 2)
    worker, produced = run.worker(), run.produced
    samples = run.names.samples("actor")
    try:
        run.bus.admin().delete_topic(samples)
        with caplog.at_level(logging.INFO, logger="producers.raas"):
            for _ in range(15):
                worker.step()
            assert produced() == 0 and not worker.episodes
            assert worker.paused_reason == "the groups of actor in flight cannot be counted: the bus does not answer"
            assert sum(run.bus.admin().group_lag(run.names.raas_group("single_turn"), run.names.prompts).values()) == 12
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert warned == [f"raas-0: paused: cannot count the groups of actor in flight for 0 s (topic {samples!r} "
                              "does not exist); waiting for the bus"]
            ensure_run_topics(run.bus.admin(), run.names, ["actor"], partitions=2)
            for _ in range(60):
                worker.step()
                if produced() == 12:
                    break
        assert produced() == 12 and worker.paused_reason == ""
        assert any(r.getMessage().startswith("raas-0: the groups of actor in flight are counted again, after ")
                   for r in caplog.records)
    finally:
        worker.close()


def test_a_starving_trainer_releases_the_limit_that_groups_it_will_never_train_hold(tmp_path, bus_url,
                                                                                      tiny_model_dir):
    """Offsets on ``samples.actor`` that the trainer group's commits will not pass soon (aborted transactions,
    records taken and dropped by a trainer killed before its next commit) count in its committed lag. With them at
    the limit the worker pauses while the trainer has nothing to train: a deadlock (the worker waits for the trainer,
    the trainer for data). The trainer reports it is starving, and the worker rolls out again, its limit then held by
    the filters' lag alone."""
    run = acquired_run(run_config(tmp_path, bus_url, tiny_model_dir, prompts=40, max_inflight_groups=8), 2)
    worker, produced = run.worker(), run.produced
    dropped = run.bus.producer()
    try:
        for i in range(8):
            dropped.send(run.names.samples("actor"), b"taken and dropped by the trainer", key=f"g{i}")
        dropped.flush()
        assert run.samples_end() >= 8
        run.commit_trainer(8)  # its last commit: before those 8
        run.report_progress(0, 0)
        for _ in range(20):
            worker.step()
        assert produced() == 0 and "8 groups of actor in flight" in worker.paused_reason, worker.paused_reason
        run.report_progress(0, 0, starving=True)
        for _ in range(20):
            worker.step()
        assert produced() == 8  # up to the limit, in trajectories (no filter runs here)
        assert "8 groups of actor in flight, and a batch of 2 more would pass its limit 8" in worker.paused_reason
    finally:
        dropped.close()
        worker.close()
