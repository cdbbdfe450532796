"""A trainer whose reads of ``samples.<policy>`` are stalled, with records waiting past its position, names the
partitions and exits (so the launcher restarts it) instead of waiting without a word (the liveness rule,
:class:`topics.liveness.ProgressWatch`). The block is real: a
transaction on the broker that writes two samples and is never ended (read_committed readers stop before it)."""
import time
import uuid

import pytest

from topics.bus import connect
from topics.liveness import Stalled
from topics.names import TopicNames
from trainer.config import TrainerConfig
from trainer.service import ServiceConfig, TrainerService


def test_a_reader_blocked_behind_an_open_transaction_is_named_then_stops(kafka_url, tiny_model_dir, tmp_path):
    run = f"blocked{uuid.uuid4().hex[:8]}"
    names = TopicNames(run)
    service = TrainerService(ServiceConfig(bus=kafka_url, run=run, model_dir=tiny_model_dir, run_dir=tmp_path,
                                           trainer=TrainerConfig(policy="actor", param_dtype="float32"),
                                           batch_groups=4, console=False))
    producer = connect(kafka_url).producer(transactional_id=f"{run}.open")
    try:
        producer.begin_transaction()
        for _ in range(2):
            producer.send(names.samples("actor"), b"never committed", partition=0)
        producer.flush()
        deadline = time.monotonic() + 60
        while not service.consumer.assignment():
            assert time.monotonic() < deadline, "no partition assigned in 60 s"
            assert service.serving.next_batch(0, timeout_s=1.0) is None
        watch, long_ago = service.liveness, time.monotonic() - 100
        watch.every_s, watch.stall_s = 0.0, 3.0
        watch.check(long_ago)  # logs the positions, starts the clock
        time.sleep(4)
        assert service.serving.next_batch(0, timeout_s=1.0) is None  # nothing readable: the reader stays put
        with pytest.raises(Stalled, match=r"trainer actor stalled: \S+samples\.actor: p0 at None of 2, .*"
                                          r"\(records wait past the position\), unmoved"):
            watch.check(long_ago)
    finally:
        producer.abort_transaction()
        producer.close()
        service.close()
