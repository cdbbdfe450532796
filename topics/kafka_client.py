"""What the Kafka clients of the bus share: librdkafka's errors as log lines, bounded calls into librdkafka,
conversions, and the broker and group questions a stuck client asks."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Mapping, TypeVar

from confluent_kafka import (
    Consumer as _Consumer,
    KafkaError,
    KafkaException,
    Producer as _Producer,
    TopicPartition as _TP,
)

from topics.bus import (
    BusError,
    FatalBusError,
    Headers,
    TopicPartition,
)
from topics.kafka_groups import GroupDescriber

log = logging.getLogger(__name__)

#: Largest record value we produce or accept on our topics (bytes).
MAX_MESSAGE_BYTES = 64 << 20
INVALID_OFFSET = -1001


class Reporter:
    """librdkafka's client errors as one log line per condition, not a line per reconnect attempt.

    Installed as ``error_cb`` with librdkafka's own logging at critical only (``log_level`` 2):
    the first error of each code is logged as a warning, then at most one per ``every_s``
    seconds with the count of repeats. The errors stay visible to callers as :class:`BusError`.
    """

    def __init__(self, client: str, every_s: float = 30.0):
        self.client, self.every_s = client, every_s
        self._seen: dict[int, tuple[float, int]] = {}  # code -> (last logged, repeats since)
        self.last: str | None = None  # the newest error's text, for the message of a failure it explains
        self.quiet = False  # record only: the caller reports the failure itself

    def __call__(self, err: KafkaError) -> None:
        self.last = err.str()
        if self.quiet:
            return
        now = time.monotonic()
        last, repeats = self._seen.get(err.code(), (None, 0))
        if last is not None and now - last < self.every_s:
            self._seen[err.code()] = (last, repeats + 1)
            return
        self._seen[err.code()] = (now, 0)
        more = f" ({repeats} more like it in the last {self.every_s:.0f} s)" if repeats else ""
        log.warning("kafka %s: %s%s", self.client, err.str(), more)

    def conf(self) -> dict:
        """The client config entries that route errors here."""
        return {"error_cb": self, "log_level": 2}


def to_tp(tp: TopicPartition, offset: int = INVALID_OFFSET) -> _TP:
    return _TP(tp[0], tp[1], offset)


def kafka_headers(headers: Headers | None) -> list[tuple[str, bytes]] | None:
    if not headers:
        return None
    return [(k, v.encode() if isinstance(v, str) else bytes(v)) for k, v in headers.items()]


def txn_error(what: str, e: KafkaException) -> BusError:
    """``what: e`` as a :class:`FatalBusError` when librdkafka says the producer is unusable (e.g. fenced
    by a newer instance with the same ``transactional.id``), else as a (retriable) :class:`BusError`."""
    err = e.args[0]
    return (FatalBusError if err.fatal() else BusError)(f"{what}: {err}")


def is_fatal(err: KafkaError) -> bool:
    """Whether librdkafka says the client is unusable: a fatal error (for a consumer, FENCED_INSTANCE_ID: a static
    member whose ``group.instance.id`` the coordinator gave to a newer member)."""
    return err.fatal() or err.code() in (KafkaError._FATAL, KafkaError.FENCED_INSTANCE_ID)


T = TypeVar("T")


class StillRunning(Exception):
    """A :func:`_bounded` call had not returned at its bound (its thread is left behind, blocked)."""


def bounded(name: str, fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` on a daemon thread named ``name``, waited for ``timeout_s`` seconds, for librdkafka calls that can
    block past any timeout of their own: a synchronous consumer commit has none, and a transactional producer's
    ``send_offsets_to_transaction`` waits for ever on a group coordinator that went down during the call, even
    once the broker is back (librdkafka #5456).

    Returns:
        What ``fn`` returned; what it raised is raised.

    Raises:
        StillRunning: ``fn`` had not returned after ``timeout_s`` seconds; the client it uses must be given up.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise StillRunning(name)
    if "error" in box:
        raise box["error"]
    return box.get("result")


#: seconds past its deadline that a transaction's commit may take before its producer is given up as wedged
TXN_GRACE_S = 10.0


def broker_answers(client: _Producer | _Consumer) -> bool:
    """Whether the broker answers ``client``'s metadata request within 5 s (a client that gets no acknowledgement
    or no coordinator while the broker answers is stuck, not waiting out an outage)."""
    try:
        client.list_topics(timeout=5)
        return True
    except KafkaException:
        return False


_describers: dict[tuple, GroupDescriber] = {}  # one per cluster and credentials, for the clients of a process
_describers_lock = threading.Lock()


def group_members(client: Mapping[str, str], group: str) -> dict[str, list[TopicPartition]]:
    """:meth:`topics.kafka_groups.GroupDescriber.members` through one helper process per cluster for the whole
    process (its admin clients and consumers ask one at a time).

    Raises:
        BusError: the cluster did not answer, or the helper died (it is started afresh on the next call).
    """
    key = tuple(sorted(client.items()))
    with _describers_lock:
        describer = _describers.get(key)
        if describer is None:
            describer = _describers[key] = GroupDescriber(client)
        return describer.members(group)


def check_result(what: str, result: Iterable[_TP]) -> None:
    for tp in result:
        if tp.error is not None:
            raise BusError(f"{what} failed for {tp.topic}[{tp.partition}]: {tp.error}")
