"""Patience with a failing bus: a bus operation retried in place, with back-off, for a bounded time.

Transient broker trouble (a restart, a leader election, a coordinator move, a network cut) surfaces
as :class:`topics.bus.BusError`. A component waits it out where it is, keeping its position, instead
of exiting: :func:`patiently` calls ``fn`` until it returns or ``patience_s`` seconds have passed
(exponential back-off from 0.5 s to 10 s, through tenacity), with one warning when the condition
starts, one when its error changes (at most every ``SAY_AGAIN_S``), and one line when it clears. After the patience, on a :class:`FatalBusError` (e.g. a
fenced transactional producer: another instance took over) or on a
:class:`topics.bus.DeliveryError` (records were dropped: calling again would not send them), the
error is raised and the process's supervisor takes over (``astraflow run`` restarts the component,
which resumes from its committed offsets).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from topics.bus import BusError, DeliveryError, FatalBusError

T = TypeVar("T")

#: Seconds a component waits out a failing bus before it gives up (> a broker restart, ~30-60 s here).
PATIENCE_S = 180.0
#: Seconds between two lines of one wait: a wait whose error changes says so at most this often.
SAY_AGAIN_S = 30.0


def patiently(what: str, fn: Callable[[], T], *, patience_s: float = PATIENCE_S,
              log: logging.Logger | None = None) -> T:
    """``fn()``, retried on :class:`BusError` (not :class:`FatalBusError` nor :class:`DeliveryError`) for up to
    ``patience_s`` seconds.

    Args:
        what: names the operation in the log lines, e.g. ``"raas-0: flush"``.
        fn: the operation; it must be safe to call again after it raised (idempotent, or it restores
            its own state before raising).
        patience_s: the bound, in seconds from the first failure.
        log: where the two lines go (default: this module's logger).

    Returns:
        What ``fn`` returned.

    Raises:
        BusError: the last error, once ``patience_s`` has passed; a FatalBusError or DeliveryError at once.
    """
    log = log or logging.getLogger(__name__)
    started: list[float] = []
    said: list = [0.0, ""]  # when the last line was logged, and the error it named

    def before_sleep(state) -> None:
        now, error = time.monotonic(), str(state.outcome.exception())
        if not started:
            started.append(now)
            log.warning("%s: %s; retrying for up to %.0f s", what, error, patience_s)
            said[:] = [now, error]
        elif error != said[1] and now - said[0] >= SAY_AGAIN_S:
            log.warning("%s: still failing after %.0f s, now with: %s", what, now - started[0], error)
            said[:] = [now, error]

    retrying = Retrying(retry=retry_if_exception(lambda e: isinstance(e, BusError)
                                                 and not isinstance(e, (FatalBusError, DeliveryError))),
                        stop=stop_after_delay(patience_s), wait=wait_exponential(multiplier=0.5, max=10.0),
                        before_sleep=before_sleep, reraise=True)
    result = retrying(fn)
    if started:
        log.warning("%s: the bus answers again after %.0f s", what, time.monotonic() - started[0])
    return result
