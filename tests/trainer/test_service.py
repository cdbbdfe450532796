"""The trainer service does the I/O around :class:`trainer.loop.Trainer`: it publishes each version the trainer
computes, and reports the publish with the step's metrics."""
import json

from topics.bus import connect
from topics.codec import encode, headers_for
from topics.names import TopicNames
from trainer.config import TrainerConfig
from trainer.service import ServiceConfig, TrainerService
from weights.publisher import Publisher
from weights.store import WeightStore


def test_the_service_publishes_each_version_with_its_position(tiny_model_dir, make_group, tmp_path):
    """Each step's weights go to the publisher as the new version, announced with the service's position on
    ``samples.<policy>`` after its batch; the step waits for the publisher's host copy only (``publish_wait_s``,
    well under the step), and the figures of the newest version published come with the step's metrics."""
    names, bus_url = TopicNames("publishes"), f"local://{tmp_path / 'bus'}"
    bus = connect(bus_url)
    publisher = Publisher(WeightStore((tmp_path / "store").as_uri(), names.run), bus, names, "p")
    service = TrainerService(ServiceConfig(
        bus=bus_url, run=names.run, model_dir=tiny_model_dir, run_dir=tmp_path / "run", steps=2, batch_groups=2,
        trainer=TrainerConfig(policy="p", param_dtype="float32", lr=1e-3, device="cpu"), console=False,
        poll_timeout_s=1.0), publisher=publisher)
    producer = bus.producer()
    for seed in range(4):
        g = make_group([1.0, 0.0], seed=seed, gen_len=2, policy="p")
        producer.send(names.samples("p"), encode(g), key="one", headers=headers_for(g))
    producer.flush()
    try:
        summary = service.run()
    finally:
        service.close()
    assert publisher.wait(30) and not publisher.errors
    publisher.close()
    assert summary["version"] == 2 and summary["steps_run"] == 2
    # a busy publisher may coalesce version 1 into 2; what it announces carries the position after its batch
    announced = {a.version: a.samples_consumed for a in publisher.announcements}
    assert announced[2] == 4 and announced.get(1, 2) == 2
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(0 < m["publish_wait_s"] < m["step_s"] for m in steps)
    # (on a loaded machine version 1 may still be in the publisher's thread at step 2: then no figures yet)
    published = [m for m in steps if "published_version" in m]
    assert all(m["publish_bytes"] > 0 and m["published_version"] <= m["step"] for m in published)


def test_a_trainer_with_nothing_to_train_after_its_poll_timeout_reports_it_is_starving(tiny_model_dir, make_group,
                                                                                       tmp_path):
    """RaaS releases its limit for a starving trainer (producers/raas.py): the trainer says so on ``control`` once
    a wait for a batch runs out with nothing to train (a short batch is trained), keeps saying so while it waits,
    and stops once it trains."""
    import threading
    import time

    from topics.bus import read_topic
    from topics.codec import decode
    from topics.schemas import TrainerProgress

    names, bus_url = TopicNames("starving"), f"local://{tmp_path / 'bus'}"
    bus = connect(bus_url)
    service = TrainerService(ServiceConfig(
        bus=bus_url, run=names.run, model_dir=tiny_model_dir, run_dir=tmp_path / "run", steps=1, batch_groups=1,
        trainer=TrainerConfig(policy="p", param_dtype="float32", lr=1e-3, device="cpu"), console=False,
        poll_timeout_s=0.5))
    producer = bus.producer()

    def heartbeats() -> list[TrainerProgress]:
        return [decode(r.value, TrainerProgress) for r in read_topic(bus, names.control)]

    thread = threading.Thread(target=service.run)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not any(h.starving for h in heartbeats()):
            assert time.monotonic() < deadline and thread.is_alive(), heartbeats()
            time.sleep(0.2)
        # one group and a batch of one: two groups sent one after the other can fall into two 0.5 s waits
        group = make_group([1.0, 0.0], seed=0, gen_len=2, policy="p")
        producer.send(names.samples("p"), encode(group), key="one", headers=headers_for(group))
        producer.flush()
        thread.join(timeout=300)
        assert not thread.is_alive()
    finally:
        service.close()
    seen = heartbeats()
    first = next(i for i, h in enumerate(seen) if h.starving)
    assert all(not h.starving for h in seen[:first]) and seen[first].version == 0, seen
    assert seen[-1].finished and not seen[-1].starving and (seen[-1].version, seen[-1].consumed) == (1, 1), seen
