"""Shared test fixtures.

``s3_endpoint`` is a real S3-compatible server (moto_server, a subprocess on loopback) for the session.

``bus_url`` runs a test once per bus backend: the embedded ``local://`` bus in a
temporary directory, and the real Kafka broker at ``$ASTRAFLOW_TEST_KAFKA``
(default 127.0.0.1:9092; CI starts it with ``scripts/kafka-local.sh start``).
A missing broker fails the Kafka tests: it is never skipped. A test parametrized
indirectly with ``bus_url="kafka-sasl-ssl"`` runs against the same broker's SASL_SSL
listener (SCRAM-SHA-512 over TLS), its credentials in the ``ASTRAFLOW_KAFKA_*``
environment variables (``scripts/kafka-local.sh secure-env``), which the test's
subprocesses inherit.
"""
import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

KAFKA = os.environ.get("ASTRAFLOW_TEST_KAFKA", "127.0.0.1:9092")


def _require_kafka() -> str:
    host, port = KAFKA.split(",")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError as e:
        pytest.fail(f"no Kafka broker at {KAFKA} ({e}); start one with scripts/kafka-local.sh start")
    return f"kafka://{KAFKA}"


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, our modules) lives for the session: out of the garbage
    collector's sight (``gc.freeze``), so its full collections do not walk it again and again."""
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``learning``, then ``slow``, run first (the longest jobs first keeps pytest-xdist's workers busy to the end,
    instead of one worker finishing a long run alone); tests marked ``gpu`` are skipped, with the reason,
    where no CUDA device is present."""
    # stable: the learning runs (the longest), then the other slow tests, then the rest, each in collection order
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, item.get_closest_marker("learning") is None))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: no CUDA device on this machine")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def kafka_url() -> str:
    """The test broker's bus URL."""
    return _require_kafka()


def secure_kafka_env() -> dict[str, str]:
    """The test broker's SASL_SSL listener: ``ASTRAFLOW_SECURE_BOOTSTRAP`` and the ``ASTRAFLOW_KAFKA_*``
    settings, from ``scripts/kafka-local.sh secure-env`` for the broker at ``$ASTRAFLOW_TEST_KAFKA``."""
    _require_kafka()
    port = KAFKA.split(",")[0].rsplit(":", 1)[1]
    done = subprocess.run(["bash", "scripts/kafka-local.sh", "secure-env"], cwd=Path(__file__).resolve().parents[1],
                          env=dict(os.environ, KAFKA_PORT=port), capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"the test broker at {KAFKA} has no SASL_SSL listener made by scripts/kafka-local.sh "
                    f"(restart it with that script): {done.stderr.strip()}")
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


@pytest.fixture(params=["local", "kafka"])
def bus_url(request, tmp_path) -> str:
    """A bus URL per backend: ``local://<tmp>`` and ``kafka://<test broker>``; indirectly also
    ``kafka-sasl-ssl`` (the broker's SASL_SSL listener, credentials set in this process's environment)."""
    if request.param == "local":
        return f"local://{tmp_path / 'bus'}"
    if request.param == "kafka-sasl-ssl":
        env = secure_kafka_env()
        monkeypatch = request.getfixturevalue("monkeypatch")
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return f"kafka://{env['ASTRAFLOW_SECURE_BOOTSTRAP']}"
    return _require_kafka()


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Directory of the tiny arithmetic model (``scripts/make_tiny_model.py``), built once and cached
    (see :func:`weights.models.tiny_model_dir`)."""
    from weights.models import tiny_model_dir as build
    return build()


@pytest.fixture(scope="session")
def s3_endpoint():
    """``http://127.0.0.1:<port>`` of a moto S3 server run as a subprocess for the session."""
    exe = Path(sys.executable).with_name("moto_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {url} (exit code {proc.poll()})")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
