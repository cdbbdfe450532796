"""A store that fails is reported once per episode, with its cause in words: the store behind a real TCP path
(``scripts/latency_proxy.py`` to the session's S3 server) that is cut (connections refused) and restored."""
import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

import weights.store as store_mod
from producers.ports import free_port
from weights.publisher import Publisher
from weights.store import StoreUnavailable, WeightStore, describe_failure

ROOT = Path(__file__).resolve().parents[2]


def test_a_store_outage_is_one_warning_with_its_cause_and_one_when_it_is_back(s3_endpoint, monkeypatch, caplog):
    monkeypatch.setattr(store_mod, "RETRY_TIMEOUT_S", 0.3)  # obstore's own retries: seconds in a run, short here
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    httpx.put(f"{s3_endpoint}/{bucket}").raise_for_status()
    port = free_port()  # nothing listens there yet: connections are refused
    store = WeightStore(f"s3://{bucket}/w", "run", endpoint=f"http://127.0.0.1:{port}", access_key_id="test",
                        secret_access_key="test", region="us-east-1")
    caplog.set_level(logging.DEBUG, logger="weights")
    key = store.key("actor", 1, "full")
    for op in (lambda: store.put(key, b"w"), lambda: store.get(key), lambda: store.versions("actor")) * 3:
        with pytest.raises(StoreUnavailable) as failure:
            op()
        assert "\n" not in str(failure.value) and "Debug" not in str(failure.value), str(failure.value)
    assert f"store unreachable: connection refused at http://127.0.0.1:{port}" in str(failure.value)

    proxy = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "latency_proxy.py"),
                              f"127.0.0.1:{port}=127.0.0.1:{s3_endpoint.rsplit(':', 1)[1]}"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "ready"
        store.put(key, b"w")
        assert store.get(key) == b"w"
    finally:
        proxy.kill()
        proxy.wait()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"store s3://{bucket}/w unreachable: connection refused at "
                                  f"http://127.0.0.1:{port} ("), warnings[0]
    assert warnings[1].startswith(f"store s3://{bucket}/w back after ") and "(9 requests failed)" in warnings[1]
    # obstore's whole message (its Rust debug dump) is kept at debug level
    assert sum("Debug source" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG) == 9


def test_publisher_retries_say_what_they_retry(tmp_path, monkeypatch, caplog):
    # a publisher whose store refuses connections: its retries name the object, at debug level (they said
    # "Retrying <unknown>" at warning level), and the version's failure is left to the store's one warning
    monkeypatch.setattr(store_mod, "RETRY_TIMEOUT_S", 0.2)
    import torch

    from topics.names import TopicNames

    port = free_port()
    store = WeightStore("s3://b/w", "run", endpoint=f"http://127.0.0.1:{port}", access_key_id="test",
                        secret_access_key="test", region="us-east-1")
    caplog.set_level(logging.DEBUG, logger="weights")
    publisher = Publisher(store, None, TopicNames("run"), "actor", attempts=2)
    publisher.publish({"w": torch.zeros(4)}, 1)
    deadline = time.monotonic() + 30
    while not publisher.errors:
        assert time.monotonic() < deadline, "the publish neither failed nor succeeded"
        time.sleep(0.05)
    publisher.close(30)
    assert publisher.errors and isinstance(publisher.errors[0], StoreUnavailable)
    text = [r.getMessage() for r in caplog.records]
    assert not any("<unknown>" in m for m in text), text
    assert any(m.startswith("publisher actor: put run/actor/00000001/full.safetensors: attempt 1 failed (put ")
               for m in text), text
    assert [r.getMessage()[:40] for r in caplog.records if r.levelno >= logging.WARNING] == \
        ["store s3://b/w unreachable: connection r"]


def test_describe_failure_reads_an_http_status_out_of_obstores_message(s3_uri):
    uri, options = s3_uri
    store = WeightStore(uri.replace("s3://", "s3://missing-"), "run", **options)
    with pytest.raises(StoreUnavailable, match=r"store answered HTTP 404 NoSuchBucket \(The specified bucket does not "
                                                r"exist\) at http://127\.0\.0\.1:\d+ \(0 retries in"):
        store.put("run/x", b"x")
    assert describe_failure(ValueError("plain")) == "ValueError: plain"
