"""Fault-test fixtures: a private Kafka broker (``scripts/kafka-local.sh`` on its own port) that a
test may stop and start, without disturbing the suite's shared broker."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the private broker's port for the first pytest-xdist worker (and a run without workers); worker gwN uses
#: PORT + 10 * N (and the next two ports), so that fault tests on two workers never share a broker (one stopping it
#: under the other); two test sessions at once on one machine need their own ASTRAFLOW_FAULT_KAFKA_PORT
PORT = int(os.environ.get("ASTRAFLOW_FAULT_KAFKA_PORT", "19192"))


class PrivateBroker:
    """A one-node KRaft broker on 127.0.0.1:``port``; :meth:`stop` and :meth:`start` are real."""

    def __init__(self, port: int):
        self.port, self.url = port, f"kafka://127.0.0.1:{port}"

    def _script(self, *args: str) -> None:
        subprocess.run(["scripts/kafka-local.sh", *args], cwd=ROOT, check=True, timeout=300,
                       env=dict(os.environ, KAFKA_PORT=str(self.port)), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    def start(self, fresh: bool = False) -> None:
        """Start the broker; ``fresh``: with an empty data directory (no topic or group of an earlier test)."""
        self._script("start", *(["--fresh"] if fresh else []))

    def stop(self) -> None:
        self._script("stop")


@pytest.fixture
def private_broker():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gwN under pytest-xdist
    broker = PrivateBroker(PORT + 10 * int(worker[2:]))
    broker.start(fresh=True)
    try:
        yield broker
    finally:
        broker.stop()
