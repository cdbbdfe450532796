"""Exactly-once on Kafka: the processor is SIGKILLed mid-stream, restarted, and every kept group
appears on samples.<policy> exactly once for a read_committed reader. The chain includes a user
filter named only in the config (module:Class from a temporary module on PYTHONPATH)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

from policy_factories import make_group, read_all
from topics.bus import TopicPartition, connect
from topics.codec import decode, encode, headers_for
from topics.names import TopicNames

REPO = Path(__file__).resolve().parents[2]


def _start(kafka_url, run_id, filters, tmp_path, log_name):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    log = open(tmp_path / log_name, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "policies.processor", "--bus", kafka_url, "--run", run_id, "--policy", "solver",
         "--filters", json.dumps(filters), "--max-records", "3", "--metrics-interval-s", "0.5",
         "--session-timeout-s", "6"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_sigkill_mid_stream_then_restart_is_exactly_once(kafka_url, run_id, tmp_path):
    (tmp_path / "user_filters_kill.py").write_text(textwrap.dedent('''
        from policies.base import Decision, Filter

        class DropSource(Filter):
            def __init__(self, source):
                self.source = source

            def keep(self, group):
                return Decision(group.source != self.source, "user_source")
    '''))
    bus = connect(kafka_url)
    names = TopicNames(run_id)
    bus.admin().ensure_run_topics(names, ["solver"], partitions=2)
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

    filters = [{"name": "filter_zero_adv"}, {"name": "user_filters_kill:DropSource", "source": "junk"}]
    first = _start(kafka_url, run_id, filters, tmp_path, "first.log")
    reader = bus.consumer(None, read_committed=True)
    topic = names.samples("solver")
    reader.seek_to_beginning()
    reader.assign([TopicPartition(topic, p) for p in range(2)])
    seen: list[str] = []
    deadline = time.monotonic() + 90
    try:
        while len(seen) < 15 and time.monotonic() < deadline and first.poll() is None:
            seen += [decode(r.value).group_id for r in reader.poll(100, 0.2)]
    finally:
        reader.close()
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()
    assert 15 <= len(seen) < len(expected), "the kill must land mid-stream"

    second = _start(kafka_url, run_id, filters, tmp_path, "second.log")
    try:
        out = read_all(bus, topic, len(expected), timeout_s=120, settle_s=3.0)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    ids = Counter(decode(r.value).group_id for r in out)
    assert [g for g, n in ids.items() if n > 1] == [], "a group was delivered twice"
    assert set(ids) == expected, (tmp_path / "second.log").read_text()[-2000:]
    assert second.returncode == 0, (tmp_path / "second.log").read_text()[-2000:]
    # every input record was consumed, and its offset committed in a transaction
    consumed = sum(n or 0 for n in bus.admin().group_offsets(names.filter_group("solver"), names.trajectories("solver")).values())
    assert consumed == len(groups)
