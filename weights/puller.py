"""RaaS-side weight pulling (DESIGN.md, step 7 "Pull").

A :class:`Puller` follows ``<run>.weights`` for one policy, keeps a verified
host copy of that policy's parameters, and brings it to the newest announced
version along the cheapest path in bytes:

- nodes are versions; a ``delta.zst`` at ``v`` is an edge ``base(v) -> v``
  (its base is read from the object's fixed-size prefix), a ``full.safetensors``
  at ``v`` is an edge from anywhere to ``v``;
- edge costs are object sizes from the store listing, and the plan is the
  cheapest path from the local version (versions only increase, so one pass
  in version order finds it).

Every object is downloaded with retries and verified (zstd frame checksums,
then the sha256 of the resulting parameters) before the local copy moves to
it; a failed step leaves the copy at the last verified version. A corrupt
object is fetched once more, then excluded and the plan is recomputed, which
falls back to a full snapshot. The engine only ever gets verified weights:
through ``on_update(state, version)`` (in memory, e.g. ``model.load_state_dict``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from topics.bus import Bus
from topics.follow import Follower
from topics.names import TopicNames
from topics.schemas import WeightAnnouncement
from topics.scratch import ScratchDir
from weights.codec import (PREFIX_BYTES, BaseMismatch, WeightFormatError, apply_delta, load_full, read_prefix,
                           state_sha256)
from weights.store import ObjectMissing, StoreError, StoredObject, WeightStore

log = logging.getLogger(__name__)


class WeightsUnavailable(RuntimeError):
    """The target version cannot be reached now (objects missing or corrupt); the local weights are unchanged."""


@dataclass(frozen=True)
class Step:
    """One object to fetch and apply: a delta ``base -> version`` or a full snapshot at ``version``."""

    version: int
    kind: str
    base: int | None
    obj: StoredObject


class Puller:
    """Keeps a verified host copy of one policy's weights at the newest announced version.

    Args:
        store: the weight store.
        bus: announcements are read from ``names.weights`` (a :class:`~topics.follow.Follower`:
            from the beginning, no consumer group); ``None``: only :meth:`sync` with
            an explicit target.
        names, policy: which stream to follow.
        state, version, sha256: the initial local weights (contiguous CPU
            tensors, modified in place by deltas) and their version, e.g. the
            base model as version 0; ``None`` starts empty (the first pull is a
            full snapshot).
        on_update: called as ``on_update(state, version)`` after each
            successful :meth:`sync` that changed the version.
        attempts: download attempts per object (exponential back-off between).
        backoff_s: the first back-off, in seconds.

    Raises:
        ValueError: only one of ``state`` and ``version`` is given.
        topics.bus.BusError: the ``weights`` topic does not exist, or the bus failed.
    """

    #: seconds a store listing may go unanswered before :meth:`newest_durable` warns
    STORE_PATIENCE_S = 5.0

    def __init__(self, store: WeightStore, bus: Bus | None, names: TopicNames, policy: str, *,
                 state: dict[str, torch.Tensor] | None = None, version: int | None = None,
                 sha256: str | None = None, on_update: Callable[[dict[str, torch.Tensor], int], None] | None = None,
                 attempts: int = 3, backoff_s: float = 0.2):
        if (state is None) != (version is None):
            raise ValueError("give both state and version, or neither")
        self.store, self.names, self.policy = store, names, policy
        self.state, self.version, self.sha256 = state, version, sha256
        self.on_update, self.attempts, self.backoff_s = on_update, attempts, backoff_s
        self.announced: dict[int, WeightAnnouncement] = {}
        #: names of the tensors changed since ``on_update`` was last called (read it there: it is reset
        #: after the call); None: possibly all (nothing was handed over yet, or a full snapshot was loaded)
        self.changed: set[str] | None = None
        self._bases: dict[int, int] = {}
        self._bad: set[str] = set()
        self._durable: tuple[int, float, int | None] | None = None  # (newest announced, when, answer)
        self._ghost_told: int | None = None  # the announced version last warned about as not in the store
        self._listing: tuple[concurrent.futures.Future, float] | None = None  # the listing in flight, since when
        #: since when listings have gone unanswered (set once that was warned about; cleared when one answers)
        self._unanswered_since: float | None = None
        self._announcements = (Follower(bus, names.weights, WeightAnnouncement, client_id=f"puller-{policy}")
                               if bus is not None else None)

    @property
    def follows_announcements(self) -> bool:
        """True when this puller reads the bus's announcements (it was given a bus)."""
        return self._announcements is not None

    @property
    def newest(self) -> int | None:
        """The newest announced version (None before any announcement); older announcements than the
        loaded version are forgotten after each :meth:`sync`."""
        return max(self.announced) if self.announced else None

    def newest_durable(self, ttl_s: float = 2.0, wait_s: float = 1.0) -> int | None:
        """The newest announced version whose object is in the store, else the local version.

        An announcement whose object is not there (a crash between upload and announce, a
        deleted object, a foreign writer: a "ghost") is not a target; a late upload makes it
        one. The store listing is reused for ``ttl_s`` seconds while no newer announcement
        arrives. A new listing runs in a thread of its own and is waited for at most ``wait_s``
        seconds: a store that hangs (a frozen server holds a request until the client's timeout)
        never holds the caller, a rollout loop, longer than that. Until it answers, and when it
        fails, the last answer stands; a listing that has not answered for
        :attr:`STORE_PATIENCE_S` seconds gets one warning naming the store, and one line when a
        listing is answered again (the listings between, failed or waiting, are not warned about
        again: one episode, two lines).
        """
        newest = self.newest
        if newest is None:
            return self.version
        if self._durable is not None and self._durable[0] == newest and time.monotonic() - self._durable[1] < ttl_s:
            return self._durable[2]
        last = self._durable[2] if self._durable is not None else self.version
        if self._listing is None:
            self._listing = (self._list_in_thread(), time.monotonic())
            concurrent.futures.wait([self._listing[0]], timeout=wait_s)
        listing, since = self._listing
        if not listing.done():
            waited = time.monotonic() - since
            if waited >= self.STORE_PATIENCE_S and self._unanswered_since is None:
                log.warning("puller %s: the store (%s) has not answered a listing for %.0f s; rolling out on "
                            "version %s until it does", self.policy, self.store.uri_of(""), waited, last)
                self._unanswered_since = since
            return last
        self._listing = None
        try:
            stored = listing.result()
        except StoreError as e:
            log.debug("puller %s: cannot list the store (%s); keeping the last durable version", self.policy, e)
            return last
        if self._unanswered_since is not None:
            log.warning("puller %s: the store answered again after %.1f s", self.policy,
                        time.monotonic() - self._unanswered_since)
            self._unanswered_since = None
        durable = max((v for v in self.announced if v in stored), default=self.version)
        if self.version is not None and durable is not None:
            durable = max(durable, self.version)
        if durable != newest and newest != self._ghost_told:  # once per ghost, not at each listing
            self._ghost_told = newest
            log.warning("puller %s: version %d is announced but not in the store (a crash between upload and "
                        "announcement, a deleted object or a foreign writer): not a target; %s", self.policy, newest,
                        "no announced version is in the store yet" if durable is None
                        else f"rolling out up to version {durable}, the newest stored")
        self._durable = (newest, time.monotonic(), durable)
        return durable

    def _list_in_thread(self) -> concurrent.futures.Future:
        """The store listing of this policy's versions, run in a daemon thread (a hung request never
        holds the process's exit)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def list_versions() -> None:
            try:
                future.set_result(self.store.versions(self.policy))
            except BaseException as e:  # handed to the caller through the future
                future.set_exception(e)

        threading.Thread(target=list_versions, daemon=True, name=f"list-{self.policy}").start()
        return future

    def poll(self, timeout_s: float = 0.0) -> int | None:
        """Read new announcements for this policy, waiting up to ``timeout_s`` seconds for the first;
        returns :attr:`newest`. Malformed announcements are logged and skipped.

        Raises:
            topics.bus.BusError: the bus failed.
        """
        if self._announcements is None:
            return self.newest
        for _, ann in self._announcements.poll(timeout_s):
            if ann.policy == self.policy:
                self.announced[ann.version] = ann
        return self.newest

    def close(self) -> None:
        """Stop following announcements (a store listing in flight finishes in its daemon thread)."""
        if self._announcements is not None:
            self._announcements.close()

    # ---- planning ----------------------------------------------------------------------

    def _base_of(self, obj: StoredObject) -> int:
        if obj.version not in self._bases:
            base, version, _ = read_prefix(self._fetch(obj.key, start=0, length=PREFIX_BYTES))
            if version != obj.version:
                raise WeightFormatError(f"{self.store.uri_of(obj.key)} says it is version {version}")
            self._bases[obj.version] = base
        return self._bases[obj.version]

    def plan(self, target: int) -> list[Step]:
        """The cheapest list of steps (bytes) from the local version to ``target``.

        Raises:
            WeightsUnavailable: no chain of stored, non-excluded objects reaches ``target``.
            StoreError: the listing failed.
        """
        start = -1 if self.version is None else self.version
        best: dict[int, tuple[int, list[Step]]] = {start: (0, [])} if self.version is not None else {}
        for v, objs in sorted(self.store.versions(self.policy).items()):
            if v <= start or v > target:
                continue
            cands = []
            full = objs.get("full")
            if full is not None and full.key not in self._bad:
                cands.append((full.size, [Step(v, "full", None, full)]))
            delta = objs.get("delta")
            if delta is not None and delta.key not in self._bad:
                try:
                    base = self._base_of(delta)
                except (StoreError, WeightFormatError) as e:
                    log.warning("puller %s: ignoring delta %s: %s", self.policy, self.store.uri_of(delta.key), e)
                    base = None
                if base in best:
                    cost, steps = best[base]
                    cands.append((cost + delta.size, steps + [Step(v, "delta", base, delta)]))
            if cands:
                best[v] = min(cands, key=lambda c: c[0])
        if target not in best:
            raise WeightsUnavailable(f"policy {self.policy!r}: no stored chain reaches version {target} from "
                                     f"{self.version} (objects missing, corrupt or deleted by retention)")
        return best[target][1]

    # ---- fetching and applying ------------------------------------------------------------

    def _fetch(self, key: str, start: int | None = None, length: int | None = None, path: Path | None = None,
               size: int | None = None):
        for attempt in Retrying(stop=stop_after_attempt(self.attempts), reraise=True,
                                wait=wait_exponential(multiplier=self.backoff_s, max=5.0),
                                retry=retry_if_exception_type(StoreError),
                                before_sleep=lambda s: log.debug(
                                    "puller %s: fetching %s: attempt %d failed (%s); retrying in %.1f s",
                                    self.policy, key, s.attempt_number, s.outcome.exception(), s.next_action.sleep)):
            with attempt:
                if path is not None:
                    return self.store.download(key, path, size)
                return self.store.get(key, start=start, length=length)

    def _apply(self, step: Step, expect_sha: str | None) -> None:
        uri = self.store.uri_of(step.obj.key)
        if step.kind == "delta":
            data = self._fetch(step.obj.key)
            if self.sha256 is None:  # given without its checksum: a delta checks its base against it
                self.sha256 = state_sha256(self.state)
            hdr = apply_delta(data, self.state, expect_sha256=expect_sha, base_sha256=self.sha256)
            self.version, self.sha256 = step.version, hdr.sha256
            if self.changed is not None:
                self.changed |= {t["name"] for t in hdr.tensors if t["count"]}
            return
        with ScratchDir("pull") as tmp:  # swept at the next component start if this process is killed
            path = tmp / "full.safetensors"
            self._fetch(step.obj.key, path=path, size=step.obj.size)
            state, version, sha = load_full(path, self.state, expect_sha256=expect_sha)
            if version != step.version:
                raise WeightFormatError(f"{uri} holds version {version}, expected {step.version}")
        self.state, self.version, self.sha256 = dict(state), version, sha
        self.changed = None
        log.debug("puller %s: loaded %s", self.policy, uri)

    def sync(self, target: int | None = None, expect_sha256: str | None = None) -> bool:
        """Bring the local weights to ``target`` (default: :meth:`newest_durable`).

        Args:
            target: the version to reach.
            expect_sha256: the checksum ``target`` must have (default: its announcement's, when this puller
                read it; a puller without a bus is told it here).

        Returns:
            True if the version changed (``on_update`` was called), False if already there.

        Raises:
            WeightsUnavailable: the target cannot be reached now (after retries
                and fallbacks). The local weights stay at the last verified
                version and the engine keeps what it has.
        """
        target = self.newest_durable() if target is None else target
        if target is None or (self.version is not None and target <= self.version):
            return False
        expect = expect_sha256 or (self.announced[target].sha256 if target in self.announced else None)
        tried: dict[str, int] = {}
        while self.version != target:
            try:
                steps = self.plan(target)
            except StoreError as e:  # listing failed, or an object vanished while reading its header
                raise WeightsUnavailable(f"policy {self.policy!r}: cannot plan a path to version {target}: {e}; "
                                         f"keeping version {self.version}") from e
            step = steps[0]
            uri = self.store.uri_of(step.obj.key)
            try:
                self._apply(step, expect if step.version == target else None)
            except ObjectMissing as e:
                self._bad.add(step.obj.key)
                log.warning("puller %s: %s is missing after %d attempts (%s); replanning without it",
                            self.policy, uri, self.attempts, e)
            except StoreError as e:
                raise WeightsUnavailable(f"policy {self.policy!r}: {step.kind} for version {step.version} "
                                         f"({uri}) could not be fetched after {self.attempts} attempts: {e}; "
                                         f"keeping version {self.version}") from e
            except BaseMismatch as e:  # the object is sound but not for these weights: refetching cannot help
                self._bad.add(step.obj.key)
                log.warning("puller %s: %s; excluding %s and falling back (a full snapshot)", self.policy, e, uri)
            except WeightFormatError as e:
                tried[step.obj.key] = tried.get(step.obj.key, 0) + 1
                if tried[step.obj.key] == 1:
                    log.warning("puller %s: %s is corrupt (%s); refetching", self.policy, uri, e)
                else:
                    self._bad.add(step.obj.key)
                    log.warning("puller %s: %s is corrupt again (%s); excluding it and falling back "
                                "(full snapshot if the chain is broken)", self.policy, uri, e)
        # forget announcements older than the loaded version (a long run announces one per step), in place:
        # a caller may run sync in a thread while it polls announcements into this dict
        for v in [v for v in list(self.announced) if v < self.version]:
            self.announced.pop(v, None)
        if self.on_update is not None:
            self.on_update(self.state, self.version)
            self.changed = set()
        return True
