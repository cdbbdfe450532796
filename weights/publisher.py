"""Trainer-side weight publishing (DESIGN.md, step 6 "Publish").

``Publisher.publish`` copies the parameters into a preallocated host buffer and
returns; a background thread encodes the delta against the last published
version, uploads it, and announces a :class:`WeightAnnouncement` on
``<run>.weights``.

The thread starts by loading the delta codec's compiled kernels (:func:`weights.codec.warm_kernels`, ~1
CPU-second once per process), before the first version comes.

Host memory: three rotating CPU buffers, each the size of the state dict: the
last published version (the delta base), the version being encoded, and the
newest pending copy (the double buffer is the last two). When the worker falls
behind, a new ``publish`` overwrites the pending copy: the next delta goes from
the last published version straight to the newest, and versions skip.

Delta vs full, with ``F`` the full size (bytes of all tensors) and ``D`` the
encoded delta size:

1. the first version is a full snapshot;
2. if ``D > max_delta_fraction * F`` the delta is not sparse enough: full.
   After n such versions in a row the next ``min(2**(n-1), 16) - 1`` skip the
   delta attempt (full float32 training changes every weight each step, so its
   deltas are never sparse, and trying costs a diff and an encode per version);
3. otherwise, with ``C`` the bytes of the deltas since the last full snapshot,
   if ``C + D > chain_budget * F`` (or the chain would exceed ``max_chain``
   deltas) a full snapshot is taken too, and the delta is still stored so
   pullers one version behind keep pulling small objects.

Rule 3 is the adaptive full-sync interval: K ≈ ``chain_budget * F / D̄`` (D̄
the mean delta size), so a fresh puller never downloads more than
``(1 + chain_budget) * F`` bytes. At 99% sparsity K is in the hundreds; with
dense deltas it falls towards 1. The announcement's ``reason`` says which rule
fired.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Mapping

import torch
from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential

from topics.bus import Bus
from topics.codec import encode, headers_for
from topics.names import TopicNames
from topics.schemas import WeightAnnouncement
from topics.scratch import ScratchDir
from weights.codec import encode_delta, save_full, state_sha256, warm_kernels
from weights.store import ObjectExists, StoreError, StoreUnavailable, WeightStore

log = logging.getLogger(__name__)


def _transient(e: BaseException) -> bool:
    """A store failure worth retrying: any but an object that already holds other bytes."""
    return isinstance(e, StoreError) and not isinstance(e, ObjectExists)

Buffer = dict[str, torch.Tensor]


class Publisher:
    """Publishes weight versions of one policy without blocking the training step.

    Args:
        store: where objects go.
        bus: announcements go to ``names.weights`` with key ``policy``; ``None``
            stores objects without announcing (benchmarks).
        names: the run's topic names.
        policy: the policy name (key of the announcements, path component of objects).
        level, threads: zstd level and worker threads (-1: one per core).
        max_delta_fraction, chain_budget, max_chain: the delta/full rules (module docstring).
        keep_versions: if set, after each publish apply :meth:`WeightStore.retain` with it.
        producer_id: recorded in the announcement headers.
        attempts: upload attempts per object (exponential back-off between).

    Attributes:
        announcements: the last 1,000 announcements made, in order.
        last_publish: the newest version published, as figures for ``metrics``: ``publish_bytes`` (the object
            stored, bytes), ``publish_s`` (seconds to encode, store and announce it, in the background) and
            ``published_version``, and ``store_lost_total`` (times the store was found to have lost the chain's
            full snapshot); empty before the first.
        store_lost: times the store no longer held the full snapshot the delta chain starts from (the store was
            deleted or pruned from outside the run): each time, an error is logged naming the object and the version
            is published as a full snapshot instead of a delta, so that workers joining later can start.
        errors: exceptions raised by background publishes (uploads are retried
            ``attempts`` times first). A failed version is retried with back-off
            (2 s doubling, at most 30 s) until it succeeds or a newer version
            replaces it, which is then a delta from the last successful version.
    """

    def __init__(self, store: WeightStore, bus: Bus | None, names: TopicNames, policy: str, *,
                 level: int = 1, threads: int = -1, max_delta_fraction: float = 0.5,
                 chain_budget: float = 1.0, max_chain: int = 1000, keep_versions: int | None = None,
                 producer_id: str | None = None, attempts: int = 3):
        self.store, self.names, self.policy = store, names, policy
        self.level, self.threads = level, threads
        self.max_delta_fraction, self.chain_budget, self.max_chain = max_delta_fraction, chain_budget, max_chain
        self.keep_versions, self.producer_id, self.attempts = keep_versions, producer_id, attempts
        self._producer = bus.producer() if bus is not None else None
        self.announcements: list[WeightAnnouncement] = []
        self.errors: list[BaseException] = []
        self._cv = threading.Condition()
        self._free: list[Buffer] = []
        self._n_buffers = 0
        self._pending: tuple[int, Buffer, int | None] | None = None
        self._busy = False
        self._base: tuple[int, Buffer, str] | None = None
        self._last_submitted = -1
        self._chain_bytes = 0
        self._chain_len = 0
        self._chain_root: str | None = None  # key of the full snapshot the current delta chain starts from
        self._lost_root: str | None = None  # the chain root last found missing (counted and logged once)
        self.store_lost = 0
        self._dense_streak = 0  # versions in a row whose delta was not sparse enough
        self._skip_deltas = 0  # versions left to publish full without trying a delta (rule 2)
        self._closing = False
        self.last_publish: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name=f"publisher-{policy}", daemon=True)
        self._thread.start()

    # ---- trainer side -------------------------------------------------------------

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int,
                samples_consumed: int | None = None) -> float:
        """Copy ``state_dict`` to host memory as ``version`` and return; publishing continues in the background.

        Args:
            state_dict: name -> tensor (any device; same names, shapes and dtypes every call).
            version: strictly greater than every earlier ``version``.
            samples_consumed: the trainer's position on ``samples.<policy>`` after the batch that made
                ``version`` (records, summed over partitions); the announcement carries it, so a reader of
                ``weights`` knows how much data each version saw (RaaS's backpressure reads committed lags).

        Returns:
            Seconds spent copying (the only time the caller waits).

        Raises:
            ValueError: ``version`` does not increase, or the tensors changed names/shapes/dtypes.
            RuntimeError: the publisher is closed.
        """
        t0 = time.perf_counter()
        with self._cv:
            if self._closing:
                raise RuntimeError(f"publisher for {self.policy!r} is closed")
            if version <= self._last_submitted:
                raise ValueError(f"version {version} is not above the last published {self._last_submitted}")
            if self._pending is not None:
                log.info("publisher %s: still busy, version %d replaces pending %d (coalesced)",
                         self.policy, version, self._pending[0])
                buf = self._pending[1]
            else:
                buf = self._free.pop() if self._free else self._alloc(state_dict)
            self._copy(state_dict, buf)
            self._pending = (version, buf, samples_consumed)
            self._last_submitted = version
            self._cv.notify_all()
        return time.perf_counter() - t0

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until everything submitted is published (or failed); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._busy, timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Publish what is pending, stop the worker and flush the producer."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        if self._producer is not None:
            self._producer.close()

    def _alloc(self, state_dict: Mapping[str, torch.Tensor]) -> Buffer:
        self._n_buffers += 1
        if self._n_buffers > 3:
            raise AssertionError("publisher needs at most three host buffers")
        pin = torch.cuda.is_available() and any(t.is_cuda for t in state_dict.values())
        return {k: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for k, t in state_dict.items()}

    @staticmethod
    def _copy(src: Mapping[str, torch.Tensor], dst: Buffer) -> None:
        if src.keys() != dst.keys():
            raise ValueError(f"state dict names changed since the first publish "
                             f"(new {sorted(set(src) - set(dst))[:5]}, gone {sorted(set(dst) - set(src))[:5]})")
        cuda = False
        with torch.no_grad():
            for k, t in src.items():
                if t.shape != dst[k].shape or t.dtype != dst[k].dtype:
                    raise ValueError(f"tensor {k!r} is {tuple(t.shape)} {t.dtype}, first publish had "
                                     f"{tuple(dst[k].shape)} {dst[k].dtype}")
                dst[k].copy_(t.detach(), non_blocking=t.is_cuda)
                cuda |= t.is_cuda
        if cuda:
            torch.cuda.synchronize()

    # ---- background worker -----------------------------------------------------------

    def _run(self) -> None:
        try:  # before the first version comes: the first delta then finds the codec loaded
            warm_kernels()
        except Exception as e:  # the first delta attempt meets the same failure, where it is handled and counted
            log.warning("publisher %s: could not load the delta codec ahead (%s: %s)", self.policy, type(e).__name__, e)
        failures = 0  # failed attempts in a row
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None:
                    return
                (version, buf, consumed), self._pending = self._pending, None
                self._busy = True
            ok = False
            try:
                sha = self._publish_one(version, buf, consumed)
                ok = True
            except Exception as e:  # keep publishing later versions; the caller sees self.errors
                # a store failure is logged once per outage by the store itself: each retry here is detail
                log.log(logging.DEBUG if isinstance(e, StoreUnavailable) else logging.WARNING,
                        "publisher %s: version %d failed (%s: %s); the next version will be a delta from the "
                        "last published, %s", self.policy, version, type(e).__name__, e,
                        self._base[0] if self._base is not None else "none yet")
                log.debug("publisher %s: version %d failed", self.policy, version, exc_info=True)
                self.errors.append(e)
            with self._cv:
                if ok:
                    failures = 0
                    if self._base is not None:
                        self._free.append(self._base[1])
                    self._base = (version, buf, sha)
                elif self._pending is None and not self._closing:
                    # Nothing newer to publish: retry this version after a back-off, so that a trainer
                    # holding for the store (see durable_version) is released once the store is back.
                    failures += 1
                    self._pending = (version, buf, consumed)
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait_for(lambda: self._closing or self._pending[0] != version,
                                      timeout=min(2.0 ** failures, 30.0))
                    continue
                else:
                    self._free.append(buf)
                self._busy = False
                self._cv.notify_all()

    @property
    def durable_version(self) -> int | None:
        """The newest version stored and announced (None: none yet)."""
        with self._cv:
            return self._base[0] if self._base is not None else None

    def newest_stored_version(self, patience_s: float = 180.0) -> int | None:
        """The newest version of this policy with an object in the store (None: none). Every announced version
        was stored first, and retention keeps the newest, so no version above it was ever announced.

        Args:
            patience_s: a failing listing is retried with back-off (at most 5 s) for this long (seconds).

        Raises:
            StoreError: the listing still failed after ``patience_s``.
        """
        for attempt in Retrying(stop=stop_after_delay(patience_s), reraise=True,
                                wait=wait_exponential(multiplier=0.5, max=5.0), retry=retry_if_exception(_transient)):
            with attempt:
                versions = self.store.versions(self.policy)
        return max(versions, default=None)

    def _retrying(self, what: str, key: str) -> Retrying:
        """Retries of one store request: a transient store failure costs a back-off (0.5 s doubling, at most 5 s),
        up to ``attempts`` attempts; the last failure is re-raised."""
        return Retrying(stop=stop_after_attempt(self.attempts), reraise=True,
                        wait=wait_exponential(multiplier=0.5, max=5.0), retry=retry_if_exception(_transient),
                        before_sleep=lambda s: log.debug(
                            "publisher %s: %s %s: attempt %d failed (%s); retrying in %.1f s", self.policy, what, key,
                            s.attempt_number, s.outcome.exception(), s.next_action.sleep))

    def _put(self, key: str, data) -> None:
        """``store.put`` with retries: a transient store failure costs a back-off, not the version."""
        self._retrying("put", key)(self.store.put, key, data)

    def _chain_lost(self) -> bool:
        """Whether the store answered that the full snapshot the delta chain starts from is gone (one HEAD request).
        A store that does not answer, or refuses the request (an S3 HEAD of a missing key without list rights
        answers 403), tells nothing: the version's own upload meets the failure, if any, and the next version
        asks again."""
        if self._chain_root is None:
            return False
        try:
            return not self.store.exists(self._chain_root)
        except StoreError as e:
            log.debug("publisher %s: cannot tell whether %s is stored (%s)", self.policy, self._chain_root, e)
            return False

    def _publish_one(self, version: int, buf: Buffer, samples_consumed: int | None) -> str:
        started = time.perf_counter()
        full_bytes = sum(t.numel() * t.element_size() for t in buf.values())
        delta, reason = None, "first version"
        if self._base is not None and self._skip_deltas > 0:
            self._skip_deltas -= 1
            reason = f"the last {self._dense_streak} deltas tried were over {self.max_delta_fraction:.0%} of full"
        elif self._base is not None and self._chain_lost():
            reason = f"the store lost {self.store.uri_of(self._chain_root)}, where the delta chain starts"
            if self._lost_root != self._chain_root:  # once per lost snapshot, not again on a retried publish
                self._lost_root = self._chain_root
                self.store_lost += 1
                log.error("publisher %s: weight store %s no longer holds %s, the full snapshot that versions after it "
                          "are deltas of (was the store deleted or pruned from outside the run?); version %d is "
                          "published full so workers joining from now on can start", self.policy, self.store.uri,
                          self.store.uri_of(self._chain_root), version)
        elif self._base is not None:
            base_version, base_buf, base_sha = self._base
            delta = encode_delta(base_buf, buf, base_version=base_version, version=version, level=self.level,
                                 threads=self.threads, base_sha256=base_sha,
                                 max_bytes=int(self.max_delta_fraction * full_bytes))
            if delta is None:
                reason = f"delta over {self.max_delta_fraction:.0%} of full ({full_bytes} B): not sparse enough"
                self._dense_streak += 1
                self._skip_deltas = min(2 ** (self._dense_streak - 1), 16) - 1
            else:
                self._dense_streak = 0
        kind = "full"
        if delta is not None:
            d = len(delta.data)
            self._put(self.store.key(self.policy, version, "delta"), delta.data)
            chain = self._chain_bytes + d
            k_est = int(self.chain_budget * full_bytes / max(d, 1))
            if chain > self.chain_budget * full_bytes or self._chain_len + 1 > self.max_chain:
                reason = (f"periodic full: chain of {self._chain_len + 1} deltas would be {chain / full_bytes:.2f}x full "
                          f"(budget {self.chain_budget}x; adaptive K~{k_est} at sparsity {delta.sparsity:.4f})")
            else:
                kind = "delta"
                reason = (f"delta {d / full_bytes:.2%} of full, chain {self._chain_len + 1} deltas = "
                          f"{chain / full_bytes:.2f}x full (adaptive K~{k_est} at sparsity {delta.sparsity:.4f})")
                self._chain_bytes, self._chain_len = chain, self._chain_len + 1
        sha = delta.sha256 if delta is not None else state_sha256(buf)
        if kind == "delta":
            key, size = self.store.key(self.policy, version, "delta"), len(delta.data)
        else:
            key = self.store.key(self.policy, version, "full")
            with ScratchDir("full") as tmp:  # swept at the next component start if this process is killed
                path = tmp / "full.safetensors"
                save_full(buf, path, version=version, sha256=sha)
                size = path.stat().st_size
                self._put(key, path)
            self._chain_bytes, self._chain_len, self._chain_root = 0, 0, key
        ann = WeightAnnouncement(
            policy=self.policy, version=version, kind=kind, uri=self.store.uri_of(key), bytes=size, sha256=sha,
            base_version=self._base[0] if kind == "delta" else None,
            sparsity=delta.sparsity if delta is not None else 0.0, reason=reason, samples_consumed=samples_consumed)
        if self._producer is not None:
            self._producer.send(self.names.weights, encode(ann), key=self.policy,
                                headers=headers_for(ann, self.producer_id))
            self._producer.flush()
        self.announcements.append(ann)
        del self.announcements[:-1000]  # a long run announces once per step
        log.info("publisher %s: version %d %s %d B (%s)", self.policy, version, kind, size, reason)
        self.last_publish = {"publish_bytes": float(size), "publish_s": time.perf_counter() - started,
                             "published_version": float(version), "store_lost_total": float(self.store_lost)}
        if self.keep_versions:
            self.store.retain(self.policy, self.keep_versions)
        return sha
