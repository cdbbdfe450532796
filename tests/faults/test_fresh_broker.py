"""``scripts/kafka-local.sh start --fresh`` (how the suite's brokers start): refused while the broker runs, and
a fresh start has none of the topics of the broker's earlier life."""
import os
import subprocess
import uuid
from pathlib import Path

from topics.bus import connect

ROOT = Path(__file__).resolve().parents[2]


def test_a_fresh_start_is_refused_while_the_broker_runs_and_forgets_the_earlier_topics(private_broker):
    topic = f"fresh-{uuid.uuid4().hex[:10]}"
    connect(private_broker.url).admin().create_topic(topic, partitions=1)
    refused = subprocess.run(["scripts/kafka-local.sh", "start", "--fresh"], cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, KAFKA_PORT=str(private_broker.port)), timeout=60)
    assert refused.returncode == 1 and "refusing start --fresh: a broker runs" in refused.stderr, refused.stderr
    assert topic in connect(private_broker.url).admin().list_topics()  # the running broker was left alone
    private_broker.stop()
    private_broker.start(fresh=True)
    assert topic not in connect(private_broker.url).admin().list_topics()
