"""What ``astraflow status`` shows of a dead RaaS worker that its group still counts as a member (it holds its
partitions until ``raas.session_timeout_s``): marked SILENT, with 0 tok/s, beside a live worker's own throughput;
the run's rollout throughput is the live worker's alone. Real records on a real (embedded) bus, a real member."""
import time

from rich.console import Console

from astraflow.launcher.view import LiveView
from astraflow.monitor import WORKER_SILENT_S, RunMonitor
from topics.bus import connect
from topics.codec import encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames
from topics.schemas import Metric


def test_status_marks_a_silent_worker_and_shows_each_workers_throughput(tmp_path):
    bus, names = connect(f"local://{tmp_path / 'bus'}"), TopicNames("status")
    ensure_run_topics(bus.admin(), names, ["actor"])
    now = time.time()
    producer = bus.producer()
    # raas-0 reports every 2 s up to now, 100 tokens a report (50 tok/s); raas-1 did the same until 20 s ago, and so
    # did raas-2, whose last report said it stopped (a finished run's worker)
    for worker, last in (("raas-0", now), ("raas-1", now - 20), ("raas-2", now - 20)):
        for i in range(6):
            values = {"tokens_total": 1000 + 100 * i, "stopped": float(worker == "raas-2" and i == 5)}
            m = Metric(component=worker, kind="raas", values=values, ts=last - 10 + 2 * i)
            producer.send(names.metrics, encode(m), key=worker, headers=headers_for(m))
    producer.flush()
    # the dead worker's consumer is still a member of the RaaS group (its session has not expired)
    member = bus.consumer(names.raas_group("single_turn"), client_id="raas-1", instance_id="raas-1",
                          session_timeout_s=120.0)
    member.subscribe([names.prompts])
    member.poll(1, 1.0)
    monitor = RunMonitor(bus, names, ["actor"], "single_turn")
    try:
        deadline = time.monotonic() + 30
        while len(monitor.components) < 3:
            assert time.monotonic() < deadline, "the metrics did not arrive"
            monitor.poll(0.5)
        rates = monitor.worker_throughput()
        assert rates["raas-1"] == 0.0 and abs(rates["raas-0"] - 50.0) < 1e-6, rates
        assert abs(monitor.rollout_throughput() - 50.0) < 1e-6  # the 30 s average counted the dead workers
        workers = monitor.snapshot()["workers"]
        assert workers["raas-1"]["silent_s"] > WORKER_SILENT_S > workers["raas-0"]["silent_s"], workers
        console = Console(width=250, record=True)
        console.print(monitor.table())
        text = console.export_text()
        member_row = next(line for line in text.splitlines() if "raas-1" in line and "status.raas.single_turn" in line)
        assert "SILENT 2" in member_row, text  # 20-21 s
        cells = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines()]
        rows = {row[0]: row[1:3] for row in cells if row and row[0] in ("raas-0", "raas-1", "raas-2")}  # worker: tok/s, last
        assert rows["raas-0"][0] == "50" and rows["raas-0"][1].endswith(" s ago"), text
        assert rows["raas-1"][0] == "0" and rows["raas-1"][1].startswith("SILENT 2"), text
        assert rows["raas-2"][0] == "0" and rows["raas-2"][1].startswith("stopped 2"), text
    finally:
        monitor.close()
        member.close()


def test_status_shows_entropy_clip_fraction_grad_norm_and_a_collapse_alert(tmp_path):
    bus, names = connect(f"local://{tmp_path / 'bus'}"), TopicNames("collapse")
    ensure_run_topics(bus.admin(), names, ["actor"])
    producer = bus.producer()
    step = Metric(component="trainer.actor", kind="trainer", policy="actor", step=7,
                  values={"reward_mean": 0.0, "entropy": 0.19, "clipfrac": 0.0125, "grad_norm": 3.5, "steps_done": 7})
    # the trainer's alert (trainer/collapse.py's Collapse.values, as TrainerService sends it)
    alert = Metric(component="trainer.actor", kind="trainer", policy="actor",
                   values={"collapse": 1.0, "collapse_step": 37.0, "reward_window": 0.1, "reward_best_window": 0.75,
                           "best_step": 25.0, "entropy_window": 0.19, "entropy_best_window": 0.032, "version": 7.0})
    for m in (step, alert):
        producer.send(names.metrics, encode(m), key=m.component, headers=headers_for(m))
    producer.flush()
    monitor = RunMonitor(bus, names, ["actor"], "single_turn")
    try:
        deadline = time.monotonic() + 30
        while monitor.views["actor"].collapse is None:
            assert time.monotonic() < deadline, "the metrics did not arrive"
            monitor.poll(0.5)
        shown = monitor.snapshot()["policies"]["actor"]
        assert (shown["entropy"], shown["clipfrac"], shown["grad_norm"], shown["step"]) == (0.19, 0.0125, 3.5, 7)
        assert shown["collapse"] == ("reward collapsed at step 37: the last 10 steps' mean reward 0.100 is under 0.5 x "
                                     "the best window's 0.750 (steps 16-25), and the entropy moved 0.0320 -> 0.1900 "
                                     "nats/token (x5.94)"), shown
        console = Console(width=250, record=True)
        console.print(monitor.table())
        text = console.export_text()
        row = next(line for line in text.splitlines() if line.startswith("│ actor"))
        assert [c.strip() for c in row.split("│")[1:-1]][5:8] == ["0.1900", "0.0125", "3.5"], text
        assert "actor: reward collapsed at step 37" in text, text
        # 80 columns (a log, a CI job): the policies' table turns to a row per figure instead of cutting each one
        narrow = Console(width=80, record=True)
        narrow.print(monitor.table())
        text = narrow.export_text().split("consumer-group lag")[0]
        cells = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
        figures = {c[0]: c[1] for c in cells if len(c) == 2}
        assert (figures["entropy"], figures["clipfrac"], figures["grad norm"], figures["step"]) == \
            ("0.1900", "0.0125", "3.5", "7") and "…" not in text, text
        # a log's progress line
        line = LiveView(monitor, "r", narrow, looks=()).progress_line(61.4)
        assert line == "run r 61 s: actor step 7 version 7 reward 0.000 KL - train - tok/s staleness -", line
    finally:
        monitor.close()
