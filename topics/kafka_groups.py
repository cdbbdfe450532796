"""Kafka consumer-group descriptions in a child process: a crash barrier around librdkafka's DescribeGroups.

A DescribeGroups request in flight across a broker outage can trip a librdkafka assertion
(``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0'``) that aborts the whole
process: confluentinc/librdkafka#4605, reproduced here by a loop of describes while the broker was
stopped and started, with and without a metadata request first and a client-side request timeout.
The launcher and ``astraflow status`` must outlive a broker outage, so the request runs in a helper
process (``python -m topics.kafka_groups``: its client config as the first JSON line on stdin, never in
its argv, where any user of the host could read a password; then one JSON line per request on stdin and
per answer on stdout); a helper that dies or does not answer costs one :class:`BusError` and is started afresh on
the next request. The helper exits when its parent closes its stdin (or dies).
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
from typing import Mapping

from topics.bus import BusError, TopicPartition

#: Seconds a request may take: librdkafka's own request timeout (10 s) plus a metadata round (5 s) and margin.
ANSWER_TIMEOUT_S = 30.0


class GroupDescriber:
    """Describes consumer groups of a cluster through a helper process.

    Args:
        client: librdkafka properties of the cluster: ``bootstrap.servers`` and any security settings.
    """

    def __init__(self, client: Mapping[str, str]):
        self.client = dict(client)
        self.bootstrap = self.client["bootstrap.servers"]
        self._proc: subprocess.Popen | None = None

    def members(self, group: str) -> dict[str, list[TopicPartition]]:
        """The live members of ``group`` (``"<instance or client id> <member id>"``) -> the partitions each owns.

        Raises:
            BusError: the cluster did not answer, the request failed, or the helper died (it is restarted
                on the next call).
        """
        proc = self._helper()
        try:
            proc.stdin.write(json.dumps({"group": group}) + "\n")
            proc.stdin.flush()
        except OSError as e:
            self._stop()
            raise BusError(f"cannot describe group {group}: the describe helper is gone ({e})") from None
        ready, _, _ = select.select([proc.stdout], [], [], ANSWER_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line:
            code = proc.poll()
            self._stop()
            why = f"the describe helper died (exit code {code})" if code is not None else \
                f"no answer in {ANSWER_TIMEOUT_S:.0f} s"
            raise BusError(f"cannot describe group {group} on {self.bootstrap}: {why}")
        answer = json.loads(line)
        if "error" in answer:
            raise BusError(f"cannot describe group {group}: {answer['error']}")
        return {m: [TopicPartition(t, p) for t, p in parts] for m, parts in answer["members"].items()}

    def _helper(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", "topics.kafka_groups"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
            self._proc.stdin.write(json.dumps(self.client) + "\n")
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the helper (closing its stdin ends it; it is killed if it does not end within 5 s)."""
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
            self._proc = None


def _serve() -> None:
    """The helper's loop: its client config on the first line; then one ``{"group": ...}`` line in, one
    ``{"members": ...}`` or ``{"error": ...}`` out."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    client, admin = {**json.loads(sys.stdin.readline()), "log_level": 0}, None
    for line in sys.stdin:
        group = json.loads(line)["group"]
        # A client whose request failed is replaced: the answer is a second opinion on whether the cluster
        # answers (:meth:`topics.kafka.KafkaConsumer._cluster_answers`), which a client that came out of a broker
        # restart stuck could not give.
        admin = admin or AdminClient(client)
        try:
            admin.list_topics(timeout=5)  # no describe is queued while the cluster does not answer
            desc = admin.describe_consumer_groups([group], request_timeout=10)[group].result(20)
            answer = {"members": {f"{m.group_instance_id or m.client_id} {m.member_id}":
                                  sorted((tp.topic, tp.partition) for tp in m.assignment.topic_partitions)
                                  for m in desc.members}}
        except (KafkaException, TimeoutError) as e:
            answer, admin = {"error": str(e) or type(e).__name__}, None
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
