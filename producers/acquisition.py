"""Prompt acquisition: write a source's prompts to the run's ``prompts`` topic (DESIGN.md, step 1).

The producer walks ``epochs`` passes over a :class:`producers.sources.PromptSource`,
each pass in a seeded random order, and writes every record as a
:class:`topics.schemas.Prompt` keyed by ``prompt_id`` (with routing headers from
:func:`topics.codec.headers_for`). ``metadata["epoch"]`` tells passes apart.

Progress is a small JSON state file (epoch, position in that epoch's order,
prompts sent) rewritten atomically after each batch's ``flush()`` is
acknowledged, so a restart resumes where the last acknowledged batch ended.
Delivery is at-least-once: a crash between a flush and the state write resends
that one batch.

Pacing: with ``max_outstanding`` set, the producer waits while the RaaS consumer
group's lag on ``prompts`` (records written but not yet committed, from
:meth:`topics.bus.Admin.group_lag`) would exceed it, so a run does not dump the
whole dataset onto the topic at once. One admin client serves the pacing (and the topics' creation) for the
acquisition's life; :meth:`Acquisition.close` releases it.

Bad records cost one record each: a record the source cannot make a Prompt of
(a line that is not UTF-8 or not JSON, a missing field, a prompt over
``data.max_prompt_chars`` characters; see :class:`producers.sources.PromptSource`)
gets one warning line naming ``path:line`` and the reason, is counted in the
state's ``rejected``, and is written to the run's ``deadletter`` topic as a
:class:`topics.schemas.DeadLetter` (``topic`` = the source file, ``partition`` = -1,
``offset`` = the line or row, ``key`` = the prompt id it would have had,
``value`` = the raw record, at most :data:`DEADLETTER_MAX_BYTES`), durable with
its batch; then acquisition goes on. That happens in the first epoch; later epochs
skip the same record without a word (one dead letter per bad record, not one per
pass). With ``strict`` the first bad record raises instead.
"""
from __future__ import annotations

import json
import logging
import random
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from producers.config import AcquisitionSection
from producers.sources import PromptSource, SourceError, load_source, prompt_id
from topics.atomic_write import atomic_write
from topics.bus import Admin, Bus, BusError, Producer
from topics.codec import encode, headers_for
from topics.layout import PARTITIONS, RunTopics
from topics.names import TopicNames
from topics.patience import patiently
from topics.schemas import DeadLetter


log = logging.getLogger(__name__)

#: The most bytes of a rejected record kept in its dead letter (the error says when it was cut).
DEADLETTER_MAX_BYTES = 1 << 20


def pass_order(records: int, seed: int, epoch: int) -> list[int]:
    """The indices ``0 .. records - 1`` in the order pass ``epoch`` of a source of ``records`` records sends them,
    shuffled by ``random.Random(f"{seed}:{epoch}")`` (``seed``: ``data.shuffle_seed``): what acquisition sends, and
    what a benchmark's in-process loop takes to roll out the pipeline's prompts in the pipeline's order."""
    indices = list(range(records))
    random.Random(f"{seed}:{epoch}").shuffle(indices)
    return indices


class AcquisitionError(RuntimeError):
    """The acquisition state does not belong to this source, or cannot be read."""


@dataclass
class AcquisitionState:
    """How far acquisition got: the next record is ``order(epoch)[position]``.

    Attributes:
        source, records, seed: identify the source and shuffle this state belongs to.
        epoch: the current pass (0-based).
        position: how many records of this epoch's order are done (sent or rejected).
        sent: prompts acknowledged by the bus, all epochs together.
        rejected: bad records dead-lettered instead of sent, all epochs together.
    """

    source: str
    records: int
    seed: int
    epoch: int = 0
    position: int = 0
    sent: int = 0
    rejected: int = 0

    @classmethod
    def load(cls, path: Path, source: str, records: int, seed: int) -> "AcquisitionState":
        """The state at ``path``, or a fresh one when the file does not exist.

        Raises:
            AcquisitionError: the file is not valid state JSON, or belongs to
                another source, size or seed (delete it to start over).
        """
        if not path.exists():
            return cls(source=source, records=records, seed=seed)
        try:
            fields = json.loads(path.read_text())
            if "skipped" in fields:  # written before `skipped` was renamed `rejected`
                fields["rejected"] = fields.pop("skipped")
            state = cls(**fields)
        except (ValueError, TypeError) as e:
            raise AcquisitionError(f"acquisition state {path} is not valid ({e}); delete it to start over") from None
        if (state.source, state.records, state.seed) != (source, records, seed):
            raise AcquisitionError(
                f"acquisition state {path} is for source {state.source!r} ({state.records} records, seed "
                f"{state.seed}), not {source!r} ({records} records, seed {seed}); delete it to start over")
        return state

    def save(self, path: Path) -> None:
        """Write the state atomically (:func:`topics.atomic_write.atomic_write`)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(asdict(self)))


class Acquisition:
    """Writes the prompts of ``source`` to ``names.prompts``.

    Args:
        bus: the bus to write to.
        names: the run's topic names.
        source: the prompt source.
        state_path: the JSON state file (in the run directory); None keeps no state.
        n_samples: G, samples per group, stamped on each Prompt.
        workflow: the agent workflow stamped on each Prompt; also names the RaaS
            group ``raas.<workflow>`` whose lag paces the producer.
        epochs: passes over the source.
        seed: shuffle seed; epoch e uses ``random.Random(f"{seed}:{e}")``.
        shuffle: False keeps record order.
        batch_size: prompts per flush (and per state write).
        max_outstanding: pause while the group's lag on ``prompts`` plus the
            next batch would exceed this many prompts; None never waits.
        group: the consumer group whose lag paces the producer (default ``raas.<workflow>``).
        partitions: partition count if the ``prompts`` topic must be created.
        producer_id: the ``producer_id`` header.
        metadata: extra metadata merged into every Prompt (e.g. ``{"reward": "boxed_format"}``).
        poll_s: seconds between lag checks while paced.
        gate: a curator gate (:class:`policies.processor.CuratorGate`): each
            prompt goes through ``gate.submit`` instead of straight to ``prompts``.
        strict: raise on the first bad record instead of dead-lettering it (module docstring).

    The admin client it reads the lag with is opened at first use and kept; :meth:`close` releases it.

    Raises:
        ValueError: a non-positive ``epochs``, ``batch_size`` or ``max_outstanding``.
    """

    def __init__(self, bus: Bus, names: TopicNames, source: PromptSource, *, state_path: str | Path | None = None,
                 n_samples: int = 8, workflow: str = "single_turn", epochs: int = 1, seed: int = 0,
                 shuffle: bool = True, batch_size: int = 64, max_outstanding: int | None = None,
                 group: str | None = None, partitions: int = PARTITIONS, producer_id: str = "acquisition",
                 metadata: dict[str, Any] | None = None, poll_s: float = 0.5, gate: Any = None,
                 strict: bool = False):
        if epochs < 1 or batch_size < 1 or (max_outstanding is not None and max_outstanding < 1):
            raise ValueError(f"epochs ({epochs}), batch_size ({batch_size}) and max_outstanding "
                             f"({max_outstanding}) must be positive")
        self.bus, self.names, self.source = bus, names, source
        self.state_path = Path(state_path) if state_path is not None else None
        self.n_samples, self.workflow, self.epochs = n_samples, workflow, epochs
        self.seed, self.shuffle = seed, shuffle
        self.batch_size = min(batch_size, max_outstanding) if max_outstanding else batch_size
        self.max_outstanding = max_outstanding
        self.group = group or names.raas_group(workflow)
        self.partitions, self.producer_id = partitions, producer_id
        self.metadata = dict(metadata or {})
        self.poll_s = poll_s
        self.gate = gate
        self._topics_ready = False
        self._admin: Admin | None = None
        self.strict = strict
        self.state = (AcquisitionState.load(self.state_path, source.name, len(source), seed)
                      if self.state_path is not None
                      else AcquisitionState(source=source.name, records=len(source), seed=seed))

    def order(self, epoch: int) -> list[int]:
        """The record indices of pass ``epoch``, in the order they are sent (:func:`pass_order`)."""
        return pass_order(len(self.source), self.seed, epoch) if self.shuffle else list(range(len(self.source)))

    @property
    def done(self) -> bool:
        """Whether every epoch has been sent."""
        return self.state.epoch >= self.epochs

    def admin(self) -> Admin:
        """The acquisition's admin client, opened at the first call and reused until :meth:`close`.

        Raises:
            topics.bus.BusError: the bus cannot be reached to open it.
        """
        if self._admin is None:
            self._admin = self.bus.admin()
        return self._admin

    def close(self) -> None:
        """Release the admin client (a later call opens a new one)."""
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def outstanding(self) -> int:
        """Prompts on ``prompts`` not yet committed by the pacing group (records). After a failed read the admin
        client is closed, so the next read opens a new one (a client can keep metadata a broker restart made stale:
        'Unknown partition' for as long as it lives).

        Raises:
            topics.bus.BusError: the bus did not answer.
        """
        try:
            return sum(self.admin().group_lag(self.group, self.names.prompts).values())
        except BusError:
            self.close()
            raise

    def _wait_for_room(self, need: int, stop: threading.Event) -> bool:
        """Block until ``need`` more prompts fit under ``max_outstanding``; False if stopped first."""
        while self.max_outstanding is not None and \
                patiently("acquire: pacing lag", self.outstanding, log=log) + need > self.max_outstanding:
            if stop.wait(self.poll_s):
                return False
        return not stop.is_set()

    def run(self, stop: threading.Event | None = None, max_prompts: int | None = None,
            progress: bool = False) -> int:
        """Send prompts until every epoch is done, ``stop`` is set, or ``max_prompts`` were sent.

        Args:
            stop: set it (from another thread or a signal handler) to stop after the current batch.
            max_prompts: send at most this many prompts in this call.
            progress: show a ``rich`` progress bar (on stderr).

        Returns:
            Prompts sent (acknowledged) by this call.

        Raises:
            topics.bus.BusError: the bus refused or did not acknowledge a batch;
                the state still points at the start of that batch.
            producers.sources.SourceError: with ``strict``, the first bad record (``path:line: reason``);
                the state still points at the start of its batch.
        """
        stop = stop or threading.Event()
        if not self._topics_ready:  # once: acquire_run calls this for every batch, and the broker may be away
            topics = RunTopics(self.names, self.partitions)
            for spec in (topics.prompts, topics.deadletter):
                patiently(f"acquire: topic {spec.name}", lambda s=spec: s.create(self.admin()), log=log)
            self._topics_ready = True
        producer = self.bus.producer()
        total = self.epochs * len(self.source)
        sent_now = 0
        bar = _Progress(progress, total, self.state.epoch * len(self.source) + self.state.position,
                        f"acquire {self.source.name}")
        try:
            while not self.done and not stop.is_set():
                if max_prompts is not None and sent_now >= max_prompts:
                    break
                order = self.order(self.state.epoch)
                limit = self.batch_size if max_prompts is None else min(self.batch_size, max_prompts - sent_now)
                chunk = order[self.state.position:self.state.position + limit]
                if not self._wait_for_room(len(chunk), stop):
                    break
                sent = 0
                for index in chunk:
                    try:
                        prompt = self.source[index]
                    except SourceError as e:
                        if self.state.epoch == 0:  # reported once; later passes skip it
                            self._reject(producer, index, e)
                        continue
                    prompt = prompt.model_copy(update={
                        "workflow": self.workflow, "n_samples": self.n_samples,
                        "metadata": {**prompt.metadata, **self.metadata, "epoch": self.state.epoch}})
                    if self.gate is not None:
                        sent += self.gate.submit(prompt)
                        continue
                    producer.send(self.names.prompts, encode(prompt), key=prompt.prompt_id,
                                  headers=headers_for(prompt, self.producer_id))
                    sent += 1
                patiently("acquire: flush", producer.flush, log=log)
                if self.gate is not None:
                    self.gate.flush()
                self.state.position += len(chunk)
                self.state.sent += sent
                if self.state.position >= len(order):
                    self.state.epoch, self.state.position = self.state.epoch + 1, 0
                if self.state_path is not None:
                    self.state.save(self.state_path)
                sent_now += sent
                bar.advance(len(chunk))
        finally:
            bar.close()
            producer.close()
        return sent_now

    def _reject(self, producer: Producer, index: int, error: SourceError) -> None:
        """Dead-letter record ``index`` (queued, flushed with its batch), log it and count it.

        Raises:
            SourceError: ``error`` itself, with ``strict``.
        """
        if self.strict:
            raise error
        raw = self.source.raw(index)
        cut = f" (value: its first {DEADLETTER_MAX_BYTES} of {len(raw)} bytes)" \
            if len(raw) > DEADLETTER_MAX_BYTES else ""
        key = prompt_id(self.source.name, index).encode()
        letter = DeadLetter(topic=self.source.path or self.source.name, partition=-1, offset=self.source.line(index),
                            key=key, value=raw[:DEADLETTER_MAX_BYTES], error=f"{error}{cut}")
        producer.send(self.names.deadletter, encode(letter), key=key,
                      headers={"schema": DeadLetter.SCHEMA, "origin": self.source.where(index)})
        self.state.rejected += 1
        log.warning("rejected %s (dead letter on %s)", error, self.names.deadletter)


class _Progress:
    """A rich progress bar on stderr, or nothing when disabled."""

    def __init__(self, enabled: bool, total: int, completed: int, label: str):
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import Progress

            self._bar = Progress(console=Console(stderr=True))
            self._task = self._bar.add_task(label, total=total, completed=completed)
            self._bar.start()

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def acquire_run(cfg: AcquisitionSection, stop: threading.Event | None = None) -> int:
    """Acquisition for a run (its section of the run config, :meth:`astraflow.config.RunConfig.acquisition_section`):
    every source of ``cfg.data``, mixed by weight, through the curators.

    Sources are interleaved batch by batch, each sending ``round(batch * weight / max weight)``
    prompts per turn, until every source has finished its epochs. With curators
    configured (``cfg.curators``), prompts go through a :class:`policies.processor.CuratorGate`
    that learns from ``outcomes``; its decisions are made when the prompt is sent.

    Each source rejects prompts over ``cfg.data.max_prompt_chars`` characters; with ``cfg.data.strict``
    the first bad record stops acquisition (see :class:`Acquisition`).

    Returns:
        Prompts sent.

    Raises:
        SourceError: a source cannot be opened, or (``cfg.data.strict``) a record is bad.
    """
    from policies.base import Curator
    from policies.processor import CuratorGate
    from policies.registry import build_chain
    from topics.bus import connect

    stop = stop or threading.Event()
    bus, names = connect(cfg.bus, cfg.kafka), TopicNames(cfg.run)
    state_dir = cfg.run_dir / "acquisition"
    gate = None
    if cfg.curators:
        gate = CuratorGate(bus, cfg.run, build_chain(cfg.curators, Curator), policy=cfg.curated_policy)
    acqs = []
    for i, src in enumerate(cfg.data.sources):
        source = load_source(src.name, adapter=src.adapter, split=src.split, seed=cfg.seed,
                             max_prompt_chars=cfg.data.max_prompt_chars)
        if src.limit is not None:
            source = replace(source, records=source.records[:src.limit])
        acqs.append((src.weight, Acquisition(
            bus, names, source, state_path=state_dir / f"{i}-{source.name}.json", n_samples=cfg.data.n_samples,
            workflow=cfg.workflow, epochs=cfg.data.epochs, seed=cfg.data.shuffle_seed,
            max_outstanding=cfg.data.max_outstanding, gate=gate, strict=cfg.data.strict)))
    top = max(w for w, _ in acqs)
    sent = 0
    try:
        while not stop.is_set() and not all(a.done for _, a in acqs):
            for weight, a in acqs:
                if not a.done and not stop.is_set():
                    sent += a.run(stop, max_prompts=max(1, round(a.batch_size * weight / top)))
    finally:
        for _, a in acqs:
            a.close()
        if gate is not None:
            gate.close()
    for _, a in acqs:
        log.info("source %s: %d prompts sent, %d bad records rejected to %s (in all)", a.source.name, a.state.sent,
                 a.state.rejected, names.deadletter)
    return sent
