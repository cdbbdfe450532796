"""Exactly-once on Kafka with two filter processors: instances 0 and 1 (``astraflow policy --instance``)
share the partitions of ``trajectories.<policy>``; instance 1 is SIGKILLed mid-stream and restarted (as
``astraflow run`` would), and every kept group appears on samples.<policy> exactly once for a
read_committed reader. The chain includes a user filter named only in the config (module:Class from a
temporary module on PYTHONPATH)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import yaml
from policy_factories import make_group, read_all
from topics.bus import TopicPartition, connect
from topics.codec import decode, encode, headers_for
from topics.layout import ensure_run_topics
from topics.names import TopicNames

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 4


def _start(config: Path, instance: int, tmp_path: Path, log_name: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    log = open(tmp_path / log_name, "wb")
    return subprocess.Popen([sys.executable, "-m", "astraflow", "policy", str(config), "--policy", "solver",
                             "--instance", str(instance)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _consumed_by(bus, names: TopicNames) -> Counter:
    """Records consumed per filter processor component, from its ``metrics`` records so far."""
    counts: Counter = Counter()
    for r in read_all(bus, names.metrics, 1, timeout_s=30, settle_s=3.0):
        m = decode(r.value)
        if m.kind == "policy" and m.component.startswith("filter.solver."):
            counts[m.component] += int(m.values.get("consumed", 0))
    return counts


def test_two_processors_share_partitions_and_a_sigkill_keeps_exactly_once(kafka_url, run_id, tmp_path):
    (tmp_path / "user_filters_kill.py").write_text(textwrap.dedent('''
        from policies.base import Decision, Filter

        class DropSource(Filter):
            def __init__(self, source):
                self.source = source

            def keep(self, group):
                return Decision(group.source != self.source, "user_source")
    '''))
    filters = [{"name": "filter_zero_adv"}, {"name": "user_filters_kill:DropSource", "source": "junk"}]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": run_id, "bus": kafka_url, "run_dir": str(tmp_path / "run"),
        "policies": {"solver": {"model": "tiny", "filters": filters, "filter_processor": {
            "instances": 2, "max_records": 3, "metrics_interval_s": 0.5, "session_timeout_s": 6}}}}))
    bus = connect(kafka_url)
    names = TopicNames(run_id)
    ensure_run_topics(bus.admin(), names, ["solver"], partitions=PARTITIONS)
    procs = [_start(config, 0, tmp_path, "p0.log"), _start(config, 1, tmp_path, "p1.log")]
    try:
        # both instances are members of filter.solver and own partitions before any group is written
        deadline = time.monotonic() + 90
        while True:
            members = bus.admin().group_members(names.filter_group("solver"))
            if len(members) == 2 and all(members.values()):
                break
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (members, (tmp_path / "p0.log").read_text()[-1500:], (tmp_path / "p1.log").read_text()[-1500:])
            time.sleep(0.5)
        assert sorted(tp.partition for tps in members.values() for tp in tps) == list(range(PARTITIONS)), members

        groups = []
        for i in range(240):
            rewards = [[0, 1, 1], [1, 1, 1], [0, 1, 0]][i % 3]
            groups.append(make_group(rewards, prompt_id=f"q{i}", source="junk" if i % 8 == 0 else "gsm8k"))
        producer = bus.producer()
        for g in groups:
            producer.send(names.trajectories("solver"), encode(g), key=g.prompt_id, headers=headers_for(g))
        producer.flush()
        expected = {g.group_id for g in groups if not g.zero_adv and g.source != "junk"}
        assert 100 < len(expected) < 240

        reader = bus.consumer(None, read_committed=True)
        topic = names.samples("solver")
        reader.seek_to_beginning()
        reader.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        seen: list[str] = []
        deadline = time.monotonic() + 90
        try:
            while len(seen) < 30 and time.monotonic() < deadline and procs[1].poll() is None:
                seen += [decode(r.value).group_id for r in reader.poll(100, 0.2)]
        finally:
            reader.close()
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        assert procs[1].returncode == -signal.SIGKILL, (tmp_path / "p1.log").read_text()
        assert 30 <= len(seen) < len(expected), "the kill must land mid-stream"
        procs[1] = _start(config, 1, tmp_path, "p1-restarted.log")

        out = read_all(bus, topic, len(expected), timeout_s=120, settle_s=3.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
    logs = {n: (tmp_path / n).read_text()[-1500:] for n in ("p0.log", "p1.log", "p1-restarted.log")}
    ids = Counter(decode(r.value).group_id for r in out)
    assert [g for g, n in ids.items() if n > 1] == [], "a group was delivered twice"
    assert set(ids) == expected, logs
    assert [p.returncode for p in procs] == [0, 0], logs
    # every input record was consumed, and its offset committed in a transaction
    consumed = sum(n or 0 for n in bus.admin().group_offsets(names.filter_group("solver"), names.trajectories("solver")).values())
    assert consumed == len(groups)
    # both instances did part of the work (their metrics count what each consumed; the killed instance's
    # counts since its last metrics record are not written)
    by = _consumed_by(bus, names)
    assert set(by) == {"filter.solver.0", "filter.solver.1"} and all(by.values()), by
    assert sum(by.values()) <= len(groups), by
