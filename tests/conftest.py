"""Shared test fixtures.

``bus_url`` runs a test once per bus backend: the embedded ``local://`` bus in a
temporary directory, and the real Kafka broker at ``$ASTRAFLOW_TEST_KAFKA``
(default 127.0.0.1:9092; CI starts it with ``scripts/kafka-local.sh start``).
A missing broker fails the Kafka tests: it is never skipped.
"""
import os
import socket

import pytest

KAFKA = os.environ.get("ASTRAFLOW_TEST_KAFKA", "127.0.0.1:9092")


def _require_kafka() -> str:
    host, port = KAFKA.split(",")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError as e:
        pytest.fail(f"no Kafka broker at {KAFKA} ({e}); start one with scripts/kafka-local.sh start")
    return f"kafka://{KAFKA}"


@pytest.fixture
def kafka_url() -> str:
    """The test broker's bus URL."""
    return _require_kafka()


@pytest.fixture(params=["local", "kafka"])
def bus_url(request, tmp_path) -> str:
    """A bus URL per backend: ``local://<tmp>`` and ``kafka://<test broker>``."""
    if request.param == "local":
        return f"local://{tmp_path / 'bus'}"
    return _require_kafka()


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Directory of the tiny arithmetic model (``scripts/make_tiny_model.py``), built once.

    The build is cached under ``$ASTRAFLOW_CACHE`` (default ``~/.cache/astraflow``)
    as ``tiny-model-<sha256 of the script, 12 hex>``, so it is rebuilt only when
    the script changes. A file lock serialises concurrent test processes; the
    model is built in a temporary sibling directory and renamed into place.
    """
    import fcntl
    import hashlib
    import importlib.util
    import shutil
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_model.py"
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("ASTRAFLOW_CACHE", Path.home() / ".cache" / "astraflow"))
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"tiny-model-{digest}"
    with open(cache / f"tiny-model-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            spec = importlib.util.spec_from_file_location("make_tiny_model", script)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            tmp = cache / f"tiny-model-{digest}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            module.make_tiny_model(tmp)
            os.replace(tmp, target)
    return target
