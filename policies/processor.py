"""The policy runtime: filter chains as stream processors, curators as a gate before ``prompts``.

:class:`FilterProcessor` (DESIGN.md, step 4) is a member of consumer group
``filter.<policy>`` on ``trajectories.<policy>`` and writes the groups its
filter chain keeps to ``samples.<policy>``. Each poll batch is one
transaction: consume, decide, produce, and send the consumed offsets in the
transaction. On Kafka that is exactly-once for ``read_committed`` readers (a
killed processor's open transaction is aborted when it restarts with the same
``transactional.id``). On the embedded bus the same calls are at-least-once
(records are appended, then offsets committed) and readers de-duplicate by
``group_id``. Kept groups are forwarded byte-identical: the original record
value, key and headers, never re-encoded. Records that fail to decode go to
``deadletter`` in the same transaction. Kept and dropped counts, by reason, go
to ``metrics`` in the same transaction, so on Kafka they are exactly-once too.

:class:`CuratorGate` (DESIGN.md, step 2) sits between acquisition and
``prompts``: it asks the curator chain about each prompt before sending it,
learns from ``outcomes`` (``Curator.update``), and follows ``weights``
(``Curator.on_version``).

Command line: ``astraflow policy CONFIG --policy P --instance I`` runs filter processor ``I`` of policy
``P`` (``policies.<P>.filters`` and ``policies.<P>.filter_processor`` in the run config); SIGTERM/SIGINT
stop it after the current batch.
"""
from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from collections import Counter
from typing import Iterable, Sequence

from policies.base import KEEP, Curator, Decision, Filter
from policies.config import FilterSection
from policies.registry import build_chain
from topics.bus import Bus, BusError, TopicPartition, connect, offsets_after, read_topic
from topics.codec import MessageError, decode, encode, headers_for
from topics.deadletter import ValidatingConsumer
from topics.follow import Follower
from topics.names import TopicNames
from topics.patience import patiently
from topics.liveness import ProgressWatch
from topics.schemas import Metric, PolicyState, Prompt, RolloutOutcome, TrajectoryGroup, WeightAnnouncement

log = logging.getLogger(__name__)


def _metric(component: str, policy: str, counts: Counter) -> Metric:
    return Metric(component=component, kind="policy", policy=policy,
                  values={k: float(v) for k, v in sorted(counts.items())})


class FilterProcessor:
    """A filter chain as an exactly-once (Kafka) / at-least-once (embedded bus) stream processor.

    Args:
        bus: the bus.
        run: the run prefix of the topic names.
        policy: the trained policy whose ``trajectories.<policy>`` is filtered into ``samples.<policy>``.
        filters: the chain, applied in order; the first drop decides the reason.
        instance: this replica's id; ``transactional.id`` is ``<run>.filter.<policy>.<instance>``,
            so a restarted instance fences its killed predecessor and aborts its open transaction.
        max_records: the most records per poll batch (= per transaction).
        poll_timeout_s: seconds a poll waits for the first record.
        linger_s: seconds to keep collecting after the first record, so that a stream of single
            records becomes one transaction (Kafka Streams' exactly-once ``commit.interval.ms``,
            100 ms, plays the same role); the added latency is at most this.
        metrics_interval_s: seconds between ``metrics`` records (counts since the previous one).
        session_timeout_s: seconds after which a silent member (a killed processor) leaves the group.
        step_deadline_s: seconds one attempt of a batch (recovery, poll, filters, sends, commit) may take; past
            it the process writes every thread's stack to stderr and exits with status 1
            (:func:`faulthandler.dump_traceback_later`), so that its supervisor restarts it from what it committed
            (the new producer fences the wedged one's transaction). Each call in a batch is bounded (sends 60 s,
            abort 30 s, commit 30 s + ``topics.kafka.TXN_GRACE_S``), so only a wedge (a hung filter, a client
            call that never returns) reaches it. Process-wide: for a processor that owns its process (``astraflow policy`` sets
            ``policies.<p>.filter_processor.step_deadline_s``); None (the default) sets none.

    Attributes:
        totals: counts since start: ``consumed``, ``kept``, ``dropped``,
            ``dropped.<reason>``, ``dead_letter``.

    Raises:
        BusError: the consumer group or the transactional producer cannot be set up.
    """

    def __init__(self, bus: Bus, run: str, policy: str, filters: Sequence[Filter], *, instance: str = "0",
                 max_records: int = 200, poll_timeout_s: float = 1.0, linger_s: float = 0.1,
                 metrics_interval_s: float = 5.0,
                 session_timeout_s: float = 10.0, step_deadline_s: float | None = None):
        self.names = TopicNames(run)
        self.policy, self.filters = policy, list(filters)
        self.group = self.names.filter_group(policy)
        self.component = f"filter.{policy}.{instance}"
        self.source, self.sink = self.names.trajectories(policy), self.names.samples(policy)
        self.max_records, self.poll_timeout_s, self.linger_s = max_records, poll_timeout_s, linger_s
        self.metrics_interval_s, self.step_deadline_s = metrics_interval_s, step_deadline_s
        self.bus, self.transactional_id = bus, f"{run}.filter.{policy}.{instance}"
        self.producer = bus.producer(transactional_id=self.transactional_id)
        self.consumer = bus.consumer(self.group, client_id=self.component, session_timeout_s=session_timeout_s,
                                     instance_id=self.component)
        self.consumer.subscribe([self.source])
        #: the liveness rule: names the positions when nothing comes, and stops a processor whose reads are stalled
        self.liveness = ProgressWatch(self.consumer, bus.admin(), self.source, self.group, self.component, log)
        self.reader = ValidatingConsumer(self.consumer, self.producer, self.names.deadletter, TrajectoryGroup)
        self.pending: Counter = Counter()  # counts not yet in a committed metrics record
        self.totals: Counter = Counter()
        self._last_metrics = time.monotonic()
        self._batch_start: dict[TopicPartition, int] = {}  # the batch in hand: first offset per partition
        self._broken = False  # the last transaction failed: recover before the next

    def decide(self, group: TrajectoryGroup) -> Decision:
        """The chain's decision: the first filter that drops ``group`` gives the reason."""
        for f in self.filters:
            d = f.keep(group)
            if not d.keep:
                return d
        return KEEP

    def step(self) -> int:
        """Poll one batch and process it in one transaction; returns the number of records consumed.

        Raises:
            BusError: the transaction failed (it was aborted: nothing of it is visible and the offsets
                are not committed); :meth:`run` recovers and retries.
        """
        records = self.consumer.poll(self.max_records, self.poll_timeout_s)
        if records and len(records) < self.max_records and self.linger_s > 0:
            time.sleep(self.linger_s)
            records += self.consumer.poll(self.max_records - len(records), 0.0)
        due = self.pending and time.monotonic() - self._last_metrics >= self.metrics_interval_s
        if not records and not due:
            return 0
        counts: Counter = Counter(consumed=len(records))
        self._batch_start = {}
        for r in records:
            self._batch_start.setdefault(r.tp, r.offset)
        self.producer.begin_transaction()
        try:
            rejected = self.reader.rejected
            for rec, group in self.reader.decode(records):
                d = self.decide(group)
                if d.keep:
                    self.producer.send(self.sink, rec.value, key=rec.key, headers=rec.headers)
                    counts["kept"] += 1
                else:
                    counts["dropped"] += 1
                    counts[f"dropped.{d.reason}"] += 1
            if self.reader.rejected > rejected:
                counts["dead_letter"] = self.reader.rejected - rejected
            batch = self.pending + counts
            emit = time.monotonic() - self._last_metrics >= self.metrics_interval_s
            if emit:
                m = _metric(self.component, self.policy, batch)
                self.producer.send(self.names.metrics, encode(m), key=self.component, headers=headers_for(m))
            self.producer.commit_transaction(self.consumer, offsets_after(records))
        except BaseException:
            try:
                self.producer.abort_transaction()
            except BusError as e:  # commit_transaction already aborted, or the producer is fenced
                log.debug("abort after a failed transaction: %s", e)
            raise
        self.totals += counts
        self._batch_start = {}  # committed: nothing to rewind to
        if emit:
            self.pending, self._last_metrics = Counter(), time.monotonic()
        else:
            self.pending = batch
        return len(records)

    def run(self, stop: threading.Event | None = None) -> None:
        """Process batches until ``stop`` is set; then write the last counts to ``metrics`` and close.
        A failed transaction is waited out in place (:func:`topics.patience.patiently`): see
        :meth:`_step_or_recover`.

        Raises:
            BusError: the bus failed for longer than the patience, the producer was fenced, or the reads are
                stalled (:class:`topics.liveness.Stalled`).
        """
        stop = stop or threading.Event()
        last_read = time.monotonic()
        try:
            while not stop.is_set():
                if patiently(f"{self.component}: transaction", self._step_or_recover, log=log):
                    last_read = time.monotonic()
                else:
                    self.liveness.check(last_read)
            self.metrics_interval_s = 0.0
            if self.pending:
                patiently(f"{self.component}: transaction", self._step_or_recover, log=log)
        finally:
            self.close()

    def _step_or_recover(self) -> int:
        """:meth:`step`, after recovering from a failed transaction: a fresh transactional producer with the
        same ``transactional.id`` (its initialisation fences the old one and completes or aborts what it left
        open) and the consumer rewound, on the partitions it still owns, to the group's committed offsets (past
        the batch if the transaction in doubt committed; else where the batch started). A partition that moved
        is re-read by its new owner from the committed offsets. So the batch is processed exactly once. Runs under
        ``step_deadline_s``."""
        if self.step_deadline_s is not None:
            faulthandler.dump_traceback_later(self.step_deadline_s, exit=True, file=sys.stderr)
        try:
            return self._recover_and_step()
        finally:
            if self.step_deadline_s is not None:
                faulthandler.cancel_dump_traceback_later()

    def _recover_and_step(self) -> int:
        if self._broken:
            try:
                self.producer.close()
            except BusError as e:
                log.debug("closing the failed producer: %s", e)
            self.producer = self.bus.producer(transactional_id=self.transactional_id)
            self.reader.producer = self.producer
            held = set(self.consumer.assignment())
            batch = {tp: offset for tp, offset in self._batch_start.items() if tp in held}
            # The failed transaction may have committed (a commit in doubt, settled by the new producer): resume
            # from the group's committed offsets, which moved past the batch only then.
            committed = self.consumer.committed(list(batch)) if batch else {}
            owned = set(self.consumer.assignment())  # a consumer re-created to ask (Kafka) owns none yet: its
            # partitions start from the committed offsets when the group gives them back
            for tp, offset in batch.items():
                if tp in owned:
                    self.consumer.seek(tp, committed[tp] if committed.get(tp) is not None else offset)
            self._broken = False
        try:
            return self.step()
        except BusError:
            self._broken = True
            raise

    def close(self) -> None:
        """Leave the consumer group and release the producer (an open transaction is never left behind)."""
        self.consumer.close()
        self.producer.close()


class CuratorGate:
    """The curator chain between prompt acquisition and ``prompts``.

    A prompt is sent when every curator's ``should_submit`` agrees (asked in
    order; the first refusal is counted as ``skipped.<curator name>``).
    Before each decision the gate drains, without waiting, the ``outcomes``
    of ``policy`` (consumer group ``curator.<policy>``; each outcome goes to
    every curator's ``update``) and the ``weights`` announcements of ``policy``
    (a :class:`~topics.follow.Follower`; a newer version goes to every curator's ``on_version``).

    The chain's state survives restarts the way a Kafka Streams state store does: at each
    :meth:`flush` that follows applied outcomes, every curator's ``state_dict`` goes to the compacted
    ``state`` topic as one :class:`~topics.schemas.PolicyState` (key ``curator.<policy>``) with the
    ``outcomes`` offsets it reflects, and only once that record is acknowledged are the offsets
    committed. A new gate loads the newest such record, and skips the outcomes below its offsets
    (those applied and saved, whose commit a kill lost), so each outcome is applied once.

    Args:
        bus: the bus.
        run: the run prefix of the topic names.
        curators: the chain, in config order.
        policy: the trained policy whose outcomes and weight versions are followed.
        metrics_interval_s: seconds between ``metrics`` records (``submitted``, ``skipped``, ``skipped.<name>``).

    Attributes:
        version: the newest announced weight version of ``policy`` (-1 before any).
        totals: counts since start.

    Raises:
        BusError: the ``state`` topic could not be read for longer than the patience, or the ``weights``
            topic does not exist.
    """

    def __init__(self, bus: Bus, run: str, curators: Sequence[Curator], *, policy: str,
                 metrics_interval_s: float = 5.0):
        self.names = TopicNames(run)
        self.curators, self.policy = list(curators), policy
        self.component = f"curator.{policy}"
        self.metrics_interval_s = metrics_interval_s
        self.version = -1
        self.producer = bus.producer()
        self.outcomes = bus.consumer(self.names.curator_group(policy), client_id=self.component,
                                     instance_id=self.component)
        self.outcomes.subscribe([self.names.outcomes])
        self.weights = Follower(bus, self.names.weights, WeightAnnouncement, client_id=self.component)
        self._outcomes = ValidatingConsumer(self.outcomes, self.producer, self.names.deadletter, RolloutOutcome)
        self.pending: Counter = Counter()
        self.totals: Counter = Counter()
        self._last_metrics = time.monotonic()
        self._saved: dict[int, int] = {}  # outcomes partition -> next offset in the saved state
        self._unsaved: dict[TopicPartition, int] = {}  # applied since the last saved state: next offsets
        self._restore(bus)

    def _restore(self, bus: Bus) -> None:
        """Load the newest saved state of this gate's chain from ``state`` (nothing when there is none).
        A curator whose name differs from the saved chain's at its place starts fresh (logged)."""
        records = patiently(f"{self.component}: read {self.names.state}",
                            lambda: read_topic(bus, self.names.state), log=log)
        saved = None
        for r in records:
            if r.key == self.component.encode():
                try:
                    saved = decode(r.value, PolicyState)
                except MessageError as e:
                    log.error("%s: state record at %s[%d]@%d is unusable and skipped: %s", self.component,
                              r.topic, r.partition, r.offset, e)
        if saved is None:
            return
        for i, c in enumerate(self.curators):
            name = c.name or type(c).__name__
            if i < len(saved.policies) and saved.policies[i] == name:
                c.load_state_dict(saved.states[i])
            else:
                log.warning("%s: curator %d (%s) is not in the saved chain %s there: it starts fresh",
                            self.component, i, name, saved.policies)
        self._saved = {int(p): o for p, o in saved.offsets.items()}
        log.info("%s: restored the state of %s, built from %s up to offsets %s", self.component, saved.policies,
                 saved.source, self._saved)

    def pump(self, timeout_s: float = 0.0) -> int:
        """Apply pending ``weights`` and ``outcomes`` to the curators, waiting up to ``timeout_s`` seconds
        for outcomes; returns the number of outcomes applied."""
        for _, ann in self.weights.poll():
            if ann.policy == self.policy and ann.version > self.version:
                self.version = ann.version
                for c in self.curators:
                    c.on_version(ann.version)
        applied = 0
        for rec, outcome in self._outcomes.poll(500, timeout_s):
            if outcome.policy == self.policy and rec.offset >= self._saved.get(rec.partition, 0):
                for c in self.curators:
                    c.update(outcome)
                applied += 1
        self._unsaved.update(self._outcomes.last_offsets)
        self._outcomes.last_offsets = {}
        return applied

    def submit(self, prompt: Prompt) -> bool:
        """Ask the curators about ``prompt`` and send it to ``prompts`` (key ``prompt_id``) if they agree.

        Returns:
            whether the prompt was sent (queued; see :meth:`flush`).
        """
        self.pump()
        refusal = next((c for c in self.curators if not c.should_submit(prompt)), None)
        if refusal is None:
            self.producer.send(self.names.prompts, encode(prompt), key=prompt.prompt_id, headers=headers_for(prompt))
            self.pending["submitted"] += 1
        else:
            self.pending["skipped"] += 1
            self.pending[f"skipped.{refusal.name or type(refusal).__name__}"] += 1
        if time.monotonic() - self._last_metrics >= self.metrics_interval_s:
            self.flush()
        return refusal is None

    def run(self, source: Iterable[Prompt]) -> Counter:
        """Submit every prompt of ``source`` through the gate, flush, and return the totals."""
        for prompt in source:
            self.submit(prompt)
        self.flush()
        return self.totals

    def flush(self) -> None:
        """Write the pending counts to ``metrics`` and, when outcomes were applied since the last save, the
        chain's state to ``state``; wait until everything sent is acknowledged, then commit the applied
        ``outcomes`` offsets.

        Raises:
            DeliveryError: some records were not acknowledged (nothing is committed). BusError: the bus failed
                for longer than the patience (:func:`topics.patience.patiently`).
        """
        if self.pending:
            m = _metric(self.component, self.policy, self.pending)
            self.producer.send(self.names.metrics, encode(m), key=self.component, headers=headers_for(m))
            self.totals += self.pending
            self.pending = Counter()
        unsaved = self._unsaved
        if unsaved:
            saved = {**self._saved, **{tp.partition: o for tp, o in unsaved.items()}}
            state = PolicyState(component=self.component, policies=[c.name or type(c).__name__ for c in self.curators],
                                states=[c.state_dict() for c in self.curators], source=self.names.outcomes,
                                offsets={str(p): o for p, o in saved.items()})
            self.producer.send(self.names.state, encode(state), key=self.component, headers=headers_for(state))
        self._last_metrics = time.monotonic()
        # a broker restart is waited out here, as every other component's flush and commit are
        patiently(f"{self.component}: flush", self.producer.flush, log=log)
        if unsaved:
            self._saved, self._unsaved = saved, {}
            patiently(f"{self.component}: commit outcomes", lambda: self.outcomes.commit(unsaved), log=log)

    def close(self) -> None:
        """Flush, then release the producer and both consumers."""
        try:
            self.flush()
        finally:
            self.outcomes.close()
            self.weights.close()
            self.producer.close()


def main(section: FilterSection, instance: int, stop: threading.Event) -> None:
    """Run filter processor ``instance`` of ``section``'s policy until ``stop`` is set (``astraflow policy``).

    Raises:
        policies.base.PolicyConfigError: a filter of the chain cannot be built.
    """
    fp = section.processor
    FilterProcessor(connect(section.bus, section.kafka), section.run, section.policy,
                    build_chain(section.filters, Filter), instance=str(instance), max_records=fp.max_records,
                    linger_s=fp.linger_s, metrics_interval_s=fp.metrics_interval_s,
                    session_timeout_s=fp.session_timeout_s, step_deadline_s=fp.step_deadline_s).run(stop)
