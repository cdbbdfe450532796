"""The Kafka backend of the bus API, through confluent-kafka (librdkafka): :class:`KafkaBus` makes the
producers (:mod:`topics.kafka_producer`), consumers (:mod:`topics.kafka_consumer`) and admin clients
(:mod:`topics.kafka_admin`).

Every client failure (a ``KafkaException``, or an admin request with no answer)
surfaces as :class:`topics.bus.BusError`; librdkafka's own error log is routed
through one line per condition (:class:`topics.kafka_client.Reporter`).

Records carry already-compressed values (zstd, see :mod:`topics.codec`), so the
producer does not compress again. Producers are idempotent with ``acks=all``.
Consumers never auto-commit: offsets are committed explicitly, after the work
is durable. A consumer that librdkafka makes unusable (a static member fenced, a commit
that never returns) raises :class:`topics.bus.FatalBusError`: its component exits and its
supervisor restarts it from the group's committed offsets; a member that reads nothing while
records wait is found by :class:`topics.liveness.ProgressWatch`. A plain (not transactional)
producer whose records stay unacknowledged while the broker answers is replaced in place
(:meth:`topics.kafka_producer.KafkaProducer.flush`).
"""
from __future__ import annotations

from topics.bus import Bus
from topics.kafka_admin import KafkaAdmin
from topics.kafka_consumer import KafkaConsumer
from topics.kafka_producer import KafkaProducer
from topics.kafka_security import KafkaSecurity


class KafkaBus(Bus):
    """The bus on an Apache Kafka cluster at ``bootstrap`` (``host:port[,host:port]``), every client
    authenticated and encrypted as ``security`` says (default: what the ``ASTRAFLOW_KAFKA_*`` environment
    variables say, else plaintext without authentication).

    Raises:
        pydantic.ValidationError: ``security`` is None and the ``ASTRAFLOW_KAFKA_*`` variables are inconsistent.
    """

    def __init__(self, bootstrap: str, security: KafkaSecurity | None = None):
        self.bootstrap = bootstrap
        self.url = f"kafka://{bootstrap}"
        self._security = (security or KafkaSecurity()).librdkafka()

    def producer(self, transactional_id: str | None = None) -> KafkaProducer:
        return KafkaProducer(self.bootstrap, transactional_id, security=self._security)

    def consumer(self, group, *, read_committed=True, session_timeout_s=10.0, client_id=None,
                 instance_id=None) -> KafkaConsumer:
        return KafkaConsumer(self.bootstrap, group, read_committed, session_timeout_s, client_id, instance_id,
                             security=self._security)

    def admin(self) -> KafkaAdmin:
        return KafkaAdmin(self.bootstrap, security=self._security)
