"""`patiently`: a failing bus operation is retried in place for a bounded time; fatal and delivery
errors are not retried."""
import logging
import re
import time

import pytest

from topics.bus import BusError, DeliveryError, FatalBusError
from topics.patience import patiently


def failing(times: int, error: BusError):
    calls = []

    def fn():
        calls.append(time.monotonic())
        if len(calls) <= times:
            raise error
        return len(calls)
    return fn, calls


def test_a_transient_error_is_retried_until_it_clears(caplog):
    fn, calls = failing(2, BusError("broker down"))
    with caplog.at_level(logging.WARNING):
        assert patiently("op", fn, patience_s=30) == 3
    # back-off 0.5 s, then 1 s; one line when the condition starts, one when it clears
    assert len(calls) == 3 and calls[1] - calls[0] >= 0.45 and calls[2] - calls[1] >= 0.95
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0] == "op: broker down; retrying for up to 30 s", lines
    assert re.fullmatch(r"op: the bus answers again after \d+ s", lines[1]), lines


@pytest.mark.parametrize("error", [FatalBusError("fenced"), DeliveryError([("t", b"k", "timed out")])])
def test_fatal_and_delivery_errors_are_raised_at_once(error):
    fn, calls = failing(1, error)
    with pytest.raises(type(error)):
        patiently("op", fn, patience_s=30)
    assert len(calls) == 1


def test_the_last_error_is_raised_after_the_patience():
    fn, calls = failing(1000, BusError("still down"))
    t0 = time.monotonic()
    with pytest.raises(BusError, match="still down"):
        patiently("op", fn, patience_s=1.0)
    # the patience was waited (its stop comes at or past 1 s), then it gave up: tries at 0, 0.5 and 1.5 s (back-off
    # 0.5 s, then 1 s), the third past the patience, so at most 3 however slow the machine, and ~1.5 s in all;
    # 15 s is a busy machine's slack, far under a retry that went on to the default patience (PATIENCE_S, 180 s)
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 15.0 and 2 <= len(calls) <= 3, (elapsed, len(calls))


def test_a_wait_whose_error_changes_says_so_at_most_every_say_again_s(caplog, monkeypatch):
    monkeypatch.setattr("topics.patience.SAY_AGAIN_S", 1.2)
    errors = iter(["broker down"] * 2 + ["no coordinator"] * 2)  # failures at 0, 0.5, 1.5 and 3.5 s

    def fn():
        error = next(errors, None)
        if error is not None:
            raise BusError(error)
        return "done"
    with caplog.at_level(logging.WARNING):
        assert patiently("op", fn, patience_s=30) == "done"
    lines = [r.getMessage() for r in caplog.records]
    # the first error, then the new one once 1.2 s had passed (at the third failure, 1.5 s in), said once
    assert lines[0] == "op: broker down; retrying for up to 30 s", lines
    assert len(lines) == 3 and re.fullmatch(r"op: still failing after 2 s, now with: no coordinator", lines[1]), lines
