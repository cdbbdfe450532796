"""Fixtures for the policy tests."""
from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def run_id() -> str:
    """A unique run prefix so tests never collide on the shared broker."""
    return f"t-pol-{uuid.uuid4().hex[:10]}"
