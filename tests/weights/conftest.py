"""Fixtures for weight tests: a fresh bucket on the session's S3 server (``s3_endpoint``, tests/conftest.py)."""
import uuid

import httpx
import pytest


@pytest.fixture
def s3_uri(s3_endpoint):
    """A fresh bucket on the moto server, as ``(uri, options)`` for :class:`weights.store.WeightStore`."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    httpx.put(f"{s3_endpoint}/{bucket}").raise_for_status()
    options = dict(endpoint=s3_endpoint, access_key_id="test", secret_access_key="test", region="us-east-1")
    return f"s3://{bucket}/prefix", options
