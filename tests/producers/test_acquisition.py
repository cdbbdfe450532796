"""Acquisition on every bus backend: epochs, seeded shuffle, resume without resending, lag pacing (through one
admin client, closed when acquisition stops); bad records go to deadletter one by one (or stop a strict run)."""
import json
import logging
import re
import threading
import time
import uuid

import pytest

from astraflow.config import load_config
from bad_prompts import BAD_LINES, GOOD_LINES, write_bad_prompt_file
from producers.acquisition import Acquisition, AcquisitionError, acquire_run
from producers.sources import SourceError, load_source, prompt_id
from topics.bus import TopicPartition, connect, read_topic
from topics.codec import decode
from topics.local import LocalAdmin, LocalBus
from topics.names import TopicNames
from topics.schemas import DeadLetter, Prompt


def read_prompts(bus, topic: str, expect: int, timeout_s: float = 30.0) -> list:
    """Every record of ``topic`` (no group), waiting until ``expect`` have arrived."""
    consumer = bus.consumer(None)
    parts = bus.admin().describe_topic(topic).partitions
    consumer.assign([TopicPartition(topic, p) for p in range(parts)])
    records, deadline = [], time.monotonic() + timeout_s
    while len(records) < expect and time.monotonic() < deadline:
        records += consumer.poll(max_records=500, timeout_s=0.5)
    records += consumer.poll(max_records=500, timeout_s=0.5)  # nothing beyond `expect`
    consumer.close()
    return records


def test_two_epochs_resume_after_a_restart_without_resending(bus_url, tmp_path):
    bus, names = connect(bus_url), TopicNames(f"acq-{uuid.uuid4().hex[:8]}")
    source, state = load_source("arith", n=30, seed=1), tmp_path / "acq.json"

    first = Acquisition(bus, names, source, state_path=state, epochs=2, seed=7, batch_size=8, n_samples=4)
    assert first.run(max_prompts=20) == 20 and not first.done
    # A new process picks up from the state file.
    second = Acquisition(bus, names, source, state_path=state, epochs=2, seed=7, batch_size=8, n_samples=4)
    assert (second.state.epoch, second.state.position, second.state.sent) == (0, 20, 20)
    assert second.run(progress=True) == 40 and second.done
    assert Acquisition(bus, names, source, state_path=state, epochs=2, seed=7).run() == 0

    records = read_prompts(bus, names.prompts, 60)
    prompts = [decode(r.value, expect=Prompt) for r in records]
    assert len(prompts) == 60
    seen = {(p.prompt_id, p.metadata["epoch"]) for p in prompts}
    assert seen == {(source[i].prompt_id, e) for i in range(30) for e in (0, 1)}
    for r, p in zip(records, prompts):
        assert r.key == p.prompt_id.encode() and r.headers["task_type"] == b"arith"
        assert p.n_samples == 4 and p.workflow == "single_turn"
    # Each epoch follows its own seeded order (checked on one partition, where order is kept).
    part0 = [p for r, p in zip(records, prompts) if r.partition == records[0].partition]
    for epoch in (0, 1):
        got = [p.metadata["index"] for p in part0 if p.metadata["epoch"] == epoch]
        order = [i for i in first.order(epoch) if i in set(got)]
        assert got == order
    assert first.order(0) != first.order(1) and sorted(first.order(0)) == list(range(30))


def test_pacing_holds_prompts_back_until_the_raas_group_consumes(bus_url, tmp_path):
    bus, names = connect(bus_url), TopicNames(f"acq-{uuid.uuid4().hex[:8]}")
    acq = Acquisition(bus, names, load_source("arith", n=25), state_path=tmp_path / "s.json",
                      max_outstanding=10, batch_size=4, poll_s=0.1, partitions=2)
    worker = threading.Thread(target=acq.run)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while acq.state.sent < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        assert 8 <= acq.state.sent <= 10 and acq.outstanding() <= 10 and worker.is_alive()

        consumer = bus.consumer(acq.group)
        consumer.subscribe([names.prompts])
        got, deadline = set(), time.monotonic() + 60
        while len(got) < 25 and time.monotonic() < deadline:
            records = consumer.poll(max_records=3, timeout_s=0.5)
            if records:
                consumer.commit(records)
                got |= {r.key for r in records}
            assert acq.outstanding() <= 10
        consumer.close()
        assert len(got) == 25
    finally:
        worker.join(timeout=30)
    assert acq.done and acq.state.sent == 25


class ClosableAdmin(LocalAdmin):
    """The embedded bus's admin, recording its close."""

    closed = False

    def close(self) -> None:
        super().close()
        self.closed = True


class AdminLedgerBus(LocalBus):
    """The embedded bus, keeping every admin client it hands out (:class:`ClosableAdmin`)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.admins: list[ClosableAdmin] = []

    def admin(self) -> ClosableAdmin:
        self.admins.append(ClosableAdmin(self))
        return self.admins[-1]


def test_pacing_reads_the_lag_through_one_admin_client_closed_with_the_acquisition(tmp_path):
    bus, names = AdminLedgerBus(str(tmp_path / "bus")), TopicNames(f"acq-{uuid.uuid4().hex[:8]}")
    acq = Acquisition(bus, names, load_source("arith", n=8), max_outstanding=4, batch_size=4, poll_s=0.05,
                      partitions=1)
    worker = threading.Thread(target=acq.run)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while acq.state.sent < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # about ten lag checks while the group has consumed nothing
        assert acq.state.sent == 4 and worker.is_alive()
        consumer = bus.consumer(acq.group)
        consumer.subscribe([names.prompts])
        got, deadline = 0, time.monotonic() + 30
        while got < 8 and time.monotonic() < deadline:
            records = consumer.poll(max_records=8, timeout_s=0.5)
            if records:
                consumer.commit(records)
                got += len(records)
        consumer.close()
    finally:
        worker.join(timeout=30)
    assert acq.done and got == 8
    assert len(bus.admins) == 1 and not bus.admins[0].closed
    acq.close()
    assert len(bus.admins) == 1 and bus.admins[0].closed


def test_state_of_another_source_is_refused(tmp_path):
    bus, names = connect(f"local://{tmp_path / 'bus'}"), TopicNames("acq")
    state = tmp_path / "s.json"
    Acquisition(bus, names, load_source("arith", n=5), state_path=state).run()
    with pytest.raises(AcquisitionError, match="delete it to start over"):
        Acquisition(bus, names, load_source("arith", n=6), state_path=state)
    with pytest.raises(ValueError, match="must be positive"):
        Acquisition(bus, names, load_source("arith", n=5), epochs=0)


def bad_file_config(tmp_path, *overrides):
    path = write_bad_prompt_file(tmp_path / "p.jsonl")
    cfg = load_config(None, [f"run=acq{uuid.uuid4().hex[:8]}", f"run_dir={tmp_path / 'run'}",
                             "policies.actor.model=tiny", f"data.sources=[{{name: {path}}}]", *overrides])
    return path, cfg


def test_bad_records_go_to_deadletter_one_by_one_and_the_rest_is_sent(tmp_path, caplog):
    path, cfg = bad_file_config(tmp_path)
    with caplog.at_level(logging.WARNING, logger="producers.acquisition"):
        assert acquire_run(cfg.acquisition_section()) == 3
    bus, names = connect(cfg.bus, cfg.kafka), TopicNames(cfg.run)
    prompts = [decode(r.value, Prompt) for r in read_topic(bus, names.prompts)]
    assert sorted(p.answer for p in prompts) == sorted(GOOD_LINES.values())
    letters = sorted((decode(r.value, DeadLetter) for r in read_topic(bus, names.deadletter)), key=lambda d: d.offset)
    assert [d.offset for d in letters] == sorted(BAD_LINES)
    index = {line: i for i, line in enumerate(sorted([*BAD_LINES, *GOOD_LINES]))}  # line 5 is blank: no record
    for d in letters:
        assert (d.topic, d.partition, d.key) == (str(path), -1, prompt_id("p", index[d.offset]).encode())
        assert re.fullmatch(rf"{re.escape(str(path))}:{d.offset}: {BAD_LINES[d.offset]}.*", d.error), d.error
        raw = path.read_bytes().split(b"\n")[d.offset - 1]
        # unreadable lines as read; the others as their record re-encoded
        assert d.value == raw if d.offset in (2, 4) else json.loads(d.value) == json.loads(raw)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4
    for line, reason in BAD_LINES.items():
        assert len([w for w in warnings if re.search(rf"{re.escape(str(path))}:{line}: {reason}", w)]) == 1
    state = json.loads((tmp_path / "run" / "acquisition" / "0-p.json").read_text())
    assert (state["sent"], state["rejected"], state["epoch"]) == (3, 4, 1)


def test_strict_stops_at_the_first_bad_record(tmp_path):
    path, cfg = bad_file_config(tmp_path, "data.strict=true")
    with pytest.raises(SourceError) as info:
        acquire_run(cfg.acquisition_section())
    bus, names = connect(cfg.bus, cfg.kafka), TopicNames(cfg.run)
    order = Acquisition(bus, names, load_source(str(path)), seed=cfg.data.shuffle_seed).order(0)
    lines = sorted([*BAD_LINES, *GOOD_LINES])
    first = next(lines[i] for i in order if lines[i] in BAD_LINES)
    assert re.fullmatch(rf"{re.escape(str(path))}:{first}: {BAD_LINES[first]}.*", str(info.value)), str(info.value)
    assert sum(bus.admin().end_offsets(names.deadletter).values()) == 0


def test_a_state_file_from_before_rejected_was_named_skipped_still_loads(tmp_path):
    state = tmp_path / "s.json"
    state.write_text('{"source": "arith", "records": 5, "seed": 0, "epoch": 1, "position": 0, "sent": 4, "skipped": 1}')
    acq = Acquisition(connect(f"local://{tmp_path / 'bus'}"), TopicNames("acq"), load_source("arith", n=5),
                      state_path=state)
    assert (acq.state.sent, acq.state.rejected, acq.done) == (4, 1, True)
