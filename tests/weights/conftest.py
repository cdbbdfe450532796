"""Fixtures for weight tests: a real S3-compatible server (moto_server, a separate process on loopback)."""
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest


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


@pytest.fixture
def s3_uri(s3_endpoint):
    """A fresh bucket on the moto server, as ``(uri, options)`` for :class:`weights.store.WeightStore`."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    httpx.put(f"{s3_endpoint}/{bucket}").raise_for_status()
    options = dict(endpoint=s3_endpoint, access_key_id="test", secret_access_key="test", region="us-east-1")
    return f"s3://{bucket}/prefix", options
