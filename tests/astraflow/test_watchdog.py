"""The data watchdog's verdict on a trainer whose progress on ``control`` is ahead of its metrics in the live view
(a CI run told "at version 0" of a trainer that had trained version 1): it names the trainer's own version, stalled
since the watchdog learnt of it. A real (embedded) bus, real processes as the components."""
import re
import subprocess
import time

from rich.console import Console

from astraflow.config import load_config
from astraflow.launcher.plan import Component
from astraflow.launcher.watchdog import DataWatchdog
from astraflow.monitor import RunMonitor
from topics.bus import Record, connect
from topics.codec import encode, headers_for
from topics.deadletter import send_to_deadletter
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import TrainerProgress

WATCHDOG_S = 0.5


def test_the_verdict_names_the_version_the_trainer_reported_not_the_live_views_older_one(tmp_path):
    cfg = load_config("examples/arith-tiny.yaml", ["run=dog", f"watchdog_s={WATCHDOG_S}", "policies.actor.steps=5"])
    bus, names = connect(f"local://{tmp_path / 'bus'}"), TopicNames("dog")
    ensure_run_topics(bus.admin(), names, ["actor"])
    producer = bus.producer()
    # trained one batch, then waited for the next in vain; none of its metrics yet
    progress = TrainerProgress(policy="actor", version=1, consumed=16, starving=True)
    producer.send(names.control, encode(progress), key="trainer.actor", headers=headers_for(progress))
    # and one prompt went to deadletter instead (the verdict says so: the data ran out partly through it)
    send_to_deadletter(producer, names.deadletter, Record(names.prompts, 0, 7, b"p7", b"{}"), "the server refused",
                       "dog.raas")
    producer.flush()
    acquire = Component("acquire", ["true"], tmp_path / "acquire.log", proc=subprocess.Popen(["true"]))
    acquire.proc.wait()
    trainer = Component("trainer.actor", ["sleep"], tmp_path / "trainer.log", proc=subprocess.Popen(["sleep", "60"]))
    monitor = RunMonitor(bus, names, ["actor"], "single_turn")
    console = Console(width=250, record=True)
    watchdog = DataWatchdog(cfg, names, [acquire, trainer], console)
    try:
        assert monitor.views["actor"].version == 0
        deadline = time.monotonic() + 60
        while monitor.dead_letters == 0:
            assert time.monotonic() < deadline, "the monitor did not read the dead letter"
            monitor.poll()
        verdicts = []
        for _ in range(3):  # the stall at 0 begins; the progress at 1 starts it again; the verdict at 1
            watchdog.look(monitor)
            verdicts.append(watchdog.data_exhausted)
            time.sleep(WATCHDOG_S * 1.2)
        assert verdicts[:2] == [None, None], (verdicts, console.export_text())
        assert re.search(r"trainer\.actor has been at version 1 of 5 for [01] s", verdicts[2] or ""), verdicts
        assert "1 records went to deadletter instead of training" in verdicts[2], verdicts
        assert "version 0" not in console.export_text(), console.export_text()
    finally:
        watchdog.close()
        monitor.close()
        trainer.proc.kill()
        trainer.proc.wait()
