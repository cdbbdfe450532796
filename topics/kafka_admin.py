"""Kafka topic and group administration of the bus API (:class:`KafkaAdmin`), through confluent-kafka."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Mapping

from confluent_kafka import (
    Consumer as _Consumer,
    KafkaError,
    KafkaException,
    TopicPartition as _TP,
)
from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    NewTopic,
)

from topics.bus import (
    Admin,
    BusError,
    TopicInfo,
    TopicPartition,
)
from topics.kafka_client import (
    MAX_MESSAGE_BYTES,
    Reporter,
    group_members,
)

log = logging.getLogger(__name__)


class KafkaAdmin(Admin):
    """Topic administration through confluent-kafka's AdminClient; group offsets and watermarks through
    consumers; group membership through a helper process (:mod:`topics.kafka_groups`). ``security``:
    librdkafka security properties (:meth:`topics.kafka_security.KafkaSecurity.librdkafka`).

    Raises:
        BusError: no broker answered within ``connect_timeout_s`` (unreachable, or refusing the credentials).
    """

    def __init__(self, bootstrap: str, connect_timeout_s: float = 10.0, security: Mapping[str, str] = {}):
        # an unreachable broker is reported once, by the BusError below, not by a librdkafka
        # "Connection refused" line per reconnect attempt on stderr
        self._client = {**security, "bootstrap.servers": bootstrap}
        reporter = Reporter("admin")
        self._a = AdminClient({**self._client, **reporter.conf()})
        self._bootstrap = bootstrap
        self._watermark_reader: _Consumer | None = None
        self._offset_readers: dict[str, _Consumer] = {}  # group -> a consumer that only reads its offsets
        try:
            self._a.list_topics(timeout=connect_timeout_s)
        except KafkaException as e:
            reporter.quiet = True
            self._a.poll(0)  # serves the error callback: an authentication or TLS failure says so there
            why = reporter.last or e
            raise BusError(f"cannot reach Kafka at {bootstrap} within {connect_timeout_s:.0f} s ({why}); "
                           f"start a broker (scripts/kafka-local.sh start), fix bus=, or check the "
                           f"kafka.* security settings (protocol {self._client.get('security.protocol', 'plaintext')})") from None

    def _metadata(self, topic: str | None = None, timeout_s: float = 10.0) -> dict:
        """Topic name -> metadata (of ``topic`` only, when given).

        Raises:
            BusError: the cluster did not answer (e.g. the broker is down).
        """
        try:
            return self._a.list_topics(topic, timeout=timeout_s).topics
        except KafkaException as e:
            raise BusError(f"cannot read the metadata of {topic or 'the cluster'} from {self._bootstrap}: {e}") from None

    def create_topic(self, name, partitions=1, compacted=False, retention_ms=None, config=None) -> None:
        conf = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
        if compacted:
            conf["cleanup.policy"] = "compact"
        if retention_ms is not None:
            conf["retention.ms"] = str(retention_ms)
        conf.update({k: str(v) for k, v in (config or {}).items()})
        fut = self._a.create_topics([NewTopic(name, num_partitions=partitions, config=conf)])[name]
        try:
            fut.result(30)
        except TimeoutError:
            raise BusError(f"cannot create topic {name} on {self._bootstrap}: no answer in 30 s") from None
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise BusError(f"cannot create topic {name}: {e}") from None
        self._wait_for_leaders(name)

    def _wait_for_leaders(self, name: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            md = self._metadata(name).get(name)
            if md is not None and md.error is None and md.partitions and all(
                    p.leader >= 0 for p in md.partitions.values()):
                return
            time.sleep(0.1)
        raise BusError(f"topic {name} has no leader for every partition after {timeout_s} s")

    def describe_topic(self, name: str) -> TopicInfo:
        md = self._metadata(name).get(name)
        if md is None or md.error is not None:
            raise BusError(f"topic {name} does not exist on {self._bootstrap}")
        res = ConfigResource(ConfigResource.Type.TOPIC, name)
        try:
            entries = self._a.describe_configs([res])[res].result(30)
        except (KafkaException, TimeoutError) as e:
            raise BusError(f"cannot describe topic {name}: {e}") from None
        return TopicInfo(name, len(md.partitions), {k: str(v.value) for k, v in entries.items()})

    def list_topics(self) -> list[str]:
        return sorted(t for t in self._metadata() if not t.startswith("__"))

    def delete_topic(self, name: str) -> None:
        try:
            self._a.delete_topics([name])[name].result(30)
        except TimeoutError:
            raise BusError(f"cannot delete topic {name}: no answer in 30 s") from None
        except KafkaException as e:
            if e.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise BusError(f"cannot delete topic {name}: {e}") from None

    def _partitions(self, topic: str) -> list[int]:
        md = self._metadata(topic).get(topic)
        if md is None or md.error is not None:
            raise BusError(f"topic {topic} does not exist on {self._bootstrap}")
        return sorted(md.partitions)

    def _watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        """Per partition, (log start offset, log end offset), from the consumer API's watermark query.

        Not AdminClient.list_offsets: during a broker outage its request futures can trip a
        librdkafka assertion (``rd_kafka_enq_once_del_source_return``) that aborts the process. The reader
        is ``read_uncommitted``: the end is the log's end, past any open transaction (a ``read_committed``
        query answers the last stable offset instead, which an open transaction holds back).
        """
        if self._watermark_reader is None:
            self._watermark_reader = _Consumer({**self._client, **Reporter("offsets").conf(),
                                                "group.id": f"astraflow-offsets-{uuid.uuid4().hex}",
                                                "isolation.level": "read_uncommitted",
                                                "enable.auto.commit": False})
        out = {}
        for p in self._partitions(topic):
            try:
                out[p] = self._watermark_reader.get_watermark_offsets(_TP(topic, p), timeout=30, cached=False)
            except KafkaException as e:
                raise BusError(f"cannot list offsets of {topic}[{p}]: {e}") from None
            if out[p] is None:
                raise BusError(f"cannot list offsets of {topic}[{p}]: no answer in 30 s")
        return out

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: high for p, (_, high) in self._watermarks(topic).items()}

    def start_offsets(self, topic: str) -> dict[int, int]:
        return {p: low for p, (low, _) in self._watermarks(topic).items()}

    def group_offsets(self, group: str, topic: str) -> dict[int, int | None]:
        parts = self._partitions(topic)
        # The consumer API's OffsetFetch, by a member of no group (it never subscribes), rather than the
        # AdminClient's request futures, which can crash the process across a broker outage.
        if group not in self._offset_readers:
            self._offset_readers[group] = _Consumer({**self._client, "group.id": group,
                                                     **Reporter(f"offsets {group}").conf(),
                                                     "enable.auto.commit": False})
        try:
            res = self._offset_readers[group].committed([_TP(topic, p) for p in parts], timeout=30)
        except KafkaException as e:
            raise BusError(f"cannot read offsets of group {group}: {e}") from None
        return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in res}


    def group_members(self, group: str) -> dict[str, list[TopicPartition]]:
        """Through a helper process (:mod:`topics.kafka_groups`): librdkafka's DescribeGroups can abort the
        process across a broker outage. Raises BusError when the cluster does not answer."""
        return group_members(self._client, group)

    def close(self) -> None:
        """Close the consumers that read watermarks and group offsets (none of them ever joined a group; a later
        read opens them again). The AdminClient has no close of its own: it is released with this object."""
        readers = [*self._offset_readers.values(), *([self._watermark_reader] if self._watermark_reader else [])]
        self._offset_readers, self._watermark_reader = {}, None
        for reader in readers:
            reader.close()
