"""Garbage on a changelog (``weights``, ``control``) is dead-lettered once by the launcher's check, whichever of the
run's many group-less readers skip it, and a restarted launcher does not dead-letter it again, even one that was
killed between a dead letter and its commit."""
import time
import uuid

from astraflow.launcher.changelog_check import ChangelogCheck
from astraflow.monitor import RunMonitor
from topics.bus import connect, read_topic
from topics.codec import decode, encode, headers_for
from topics.deadletter import send_to_deadletter
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import DeadLetter, Metric, TrainerProgress, WeightAnnouncement

GARBAGE = b"\x28\xb5\x2f\xfd not a message"


def dead_letters(bus, names: TopicNames) -> list[DeadLetter]:
    return [decode(r.value, DeadLetter) for r in read_topic(bus, names.deadletter)]


def test_bad_changelog_records_are_dead_lettered_once(bus_url):
    bus = connect(bus_url)
    names = TopicNames(f"cl{uuid.uuid4().hex[:8]}")
    ensure_run_topics(bus.admin(), names, ["actor"])
    producer = bus.producer()
    ann = WeightAnnouncement(policy="actor", version=1, kind="full", uri="file:///w/1", bytes=10, sha256="0" * 64,
                             sparsity=0.0)
    progress = TrainerProgress(policy="actor", version=1, consumed=4)
    metric = Metric(component="trainer.actor", kind="trainer", values={"loss": 1.0})  # a valid message, wrong topic
    producer.send(names.weights, encode(ann), key="actor", headers=headers_for(ann))
    producer.send(names.weights, encode(metric), key="actor", headers=headers_for(metric))
    producer.send(names.control, GARBAGE, key="trainer.actor")
    producer.send(names.control, encode(progress), key="trainer.actor", headers=headers_for(progress))
    producer.flush()

    monitor = RunMonitor(bus, names, ["actor"], "single_turn")
    check = ChangelogCheck(names)
    deadline = time.monotonic() + 30
    while check.rejected < 2 and time.monotonic() < deadline:
        check.look(monitor, timeout_s=0.5)
    assert check.rejected == 2
    check.close()
    letters = sorted(dead_letters(bus, names), key=lambda letter: letter.topic)
    assert [(letter.topic, letter.offset) for letter in letters] == [(names.control, 0), (names.weights, 1)]
    assert letters[0].value == GARBAGE and "not a zstd frame" in letters[0].error
    assert "schema Metric where WeightAnnouncement was expected" in letters[1].error
    assert {letter.consumer_group for letter in letters} == {names.changelog_check_group}

    # a launcher restarted on the run resumes after what was checked: nothing is dead-lettered twice
    # ... and a launcher killed after writing a record's dead letter, before committing it (offset 3 here)
    for extra in (b"2", b"3", b"4"):
        producer.send(names.control, GARBAGE + extra, key="trainer.actor")
    producer.flush()
    written = next(r for r in read_topic(bus, names.control) if r.offset == 3)
    send_to_deadletter(producer, names.deadletter, written, "written by a launcher killed before its commit",
                       names.changelog_check_group)
    producer.flush()
    producer.close()
    again = ChangelogCheck(names)
    deadline = time.monotonic() + 30
    while again.rejected < 2 and time.monotonic() < deadline:
        again.look(monitor, timeout_s=0.5)
    again.close()
    monitor.close()
    letters = dead_letters(bus, names)
    assert again.rejected == 2
    assert sorted((letter.topic, letter.offset) for letter in letters) == [
        (names.control, 0), (names.control, 2), (names.control, 3), (names.control, 4), (names.weights, 1)]
