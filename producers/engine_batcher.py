"""Batching the engine calls of concurrent episodes: :class:`EngineBatcher`.

Episodes (coroutines, one per sample, :mod:`producers.workflows`) ask for one continuation at a time
(``await batcher.generate(ids, sampling)``). The batcher gathers every request pending when the
engine is free and sends them as one :meth:`~producers.engines.Engine.generate` call, run on the
engine's own thread so the event loop (other episodes' tool calls, the worker's polling and
commits) goes on meanwhile. A request made while a call runs waits for the next call: the engine
never idles while an episode has a request, and an episode waiting on a tool holds no engine time. The
exception is a :meth:`EngineBatcher.hold`, which a worker ahead of its trainer sets: a call then waits
(boundedly) for more rows, so that the worker spends fewer cycles per token on a machine it shares.

- An in-process engine (:class:`~producers.hf_engine.HFEngine`, ``Engine.concurrent_calls`` 1)
  runs one call at a time, each over all the requests pending when it starts (the batching loop
  of issue 28: requests gathered per tick).
- A server engine (vLLM, SGLang: ``concurrent_calls`` > 1) gets the requests of each tick as a call
  of their own without waiting for the calls in flight; the server batches them continuously.

New weights go through :meth:`EngineBatcher.submit` onto the same thread, so an in-process engine
loads a version between two calls, never under one: every token of a call carries the version that
sampled it (:attr:`~producers.engines.Generation.version`), and episodes in flight are not drained.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

from producers.engines import Engine, Generation, GenerationInterrupted, SamplingParams


class EngineCallFailed(RuntimeError):
    """An engine call (:meth:`~producers.engines.Engine.generate`) raised: a failure of the engine (its server
    gone, an out-of-memory error) that every request of the call shares, not one of any prompt; the engine's own
    error is its ``__cause__``."""


class EngineBatcher:
    """The asyncio face of one :class:`~producers.engines.Engine`, shared by every episode of a worker.

    Args:
        engine: the engine; its ``concurrent_calls`` bounds the calls in flight at once.
        name: names the engine's threads (``<name>-engine``).
        gather_s: seconds a call waits, once the engine is free, for more requests to join it. Episodes
            coming back from a tool arrive one by one; on the tiny CPU model a decode loop costs about the
            same for 1 row as for 30, so a few milliseconds of gathering make far fewer, fuller calls
            (0 dispatches at the end of the loop tick).

    Attributes:
        calls: engine calls made so far; ``rows``: prompts sent in them (rows / calls is the mean batch).
    """

    def __init__(self, engine: Engine, name: str = "engine", gather_s: float = 0.01) -> None:
        self.engine, self.gather_s = engine, gather_s
        self.concurrent = max(1, engine.concurrent_calls)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.concurrent,
                                                              thread_name_prefix=f"{name}-engine")
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future, float]] = []  # ..., loop time asked
        self._running = 0
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None  # a dispatch waiting for the floor's rows
        self.floor: tuple[int, float] | None = None  # (rows, wait_s) while held (hold)
        self._just_freed = False  # _schedule called as a call ends: the requests that waited for it go at once
        self.calls = self.rows = 0

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    @property
    def version(self) -> int:
        """The weight version the engine holds now."""
        return self.engine.version

    @property
    def pending(self) -> int:
        """Requests waiting for an engine call."""
        return len(self._pending)

    async def generate(self, ids: list[int], sampling: SamplingParams) -> Generation:
        """One continuation of ``ids`` (token ids, non-empty), sampled in the next engine call.

        Raises:
            GenerationInterrupted: the engine's call for the batch it was in was interrupted.
            EngineCallFailed: that call raised anything else (its ``__cause__``, e.g. ``ValueError`` for an
                empty prompt).
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((list(ids), sampling, future, loop.time()))
        if self._timer is not None and len(self._pending) >= self.floor_rows:  # the hold's rows are here
            self._reschedule()
        self._schedule()
        return await future

    async def generate_many(self, batch: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        """One continuation per prompt of ``batch``, in order (all requested at once, so they share calls)."""
        return list(await asyncio.gather(*(self.generate(ids, sampling) for ids in batch)))

    def hold(self, rows: int, wait_s: float) -> None:
        """Let a call wait, once the engine is free, until ``rows`` requests are pending or the oldest has waited
        ``wait_s`` seconds: fewer, fuller calls, at the cost of idle engine time, for a worker whose rollout is
        ahead of its trainer (its engine time is not what the run waits for). ``rows`` 0 ends the hold. An engine
        that takes concurrent calls (a server) batches them itself: it is never held."""
        self.floor = (rows, wait_s) if rows > 0 and self.concurrent == 1 else None
        if self._timer is not None:
            self._reschedule()

    @property
    def floor_rows(self) -> int:
        """The rows a call waits for (0: none; :meth:`hold`)."""
        return self.floor[0] if self.floor is not None else 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the engine's thread (for an in-process engine: between two calls)."""
        return self.executor.submit(fn, *args)

    def close(self) -> None:
        """Stop the engine's threads (a call in progress ends first)."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- the batching loop ---------------------------------------------------------------
    def _schedule(self) -> None:
        """Dispatch at the end of this loop tick, or, when the engine is idle, in ``gather_s``: every request made
        by then joins the call (requests made while a call ran go as soon as it ends). Under a :meth:`hold`, fewer
        than its rows pending wait until its oldest has waited its ``wait_s``."""
        if not self._scheduled and self._pending and self._running < self.concurrent:
            self._scheduled = True
            loop = asyncio.get_running_loop()
            gather = self.gather_s if self.gather_s > 0 and self._running == 0 and not self._just_freed else 0.0
            held = 0.0
            if self.floor is not None and len(self._pending) < self.floor[0]:
                held = self._pending[0][3] + self.floor[1] - loop.time()
            if held > gather:
                self._timer = loop.call_later(held, self._dispatch)
            elif gather > 0:
                loop.call_later(gather, self._dispatch)
            else:
                loop.call_soon(self._dispatch)

    def _reschedule(self) -> None:
        """Drop the waiting dispatch and schedule again (the hold changed, or its rows are pending)."""
        self._timer.cancel()
        self._timer, self._scheduled = None, False
        self._schedule()

    def _dispatch(self) -> None:
        self._scheduled, self._timer = False, None
        if not self._pending or self._running >= self.concurrent:
            return
        # one call per sampling setting (roles may use other budgets): the oldest request's setting first
        sampling = self._pending[0][1]
        mine = [r for r in self._pending if r[1] == sampling]
        self._pending = [r for r in self._pending if r[1] != sampling]
        live = [r for r in mine if not r[2].cancelled()]
        if live:
            self._running += 1
            self.calls, self.rows = self.calls + 1, self.rows + len(live)
            asyncio.get_running_loop().create_task(self._call(live, sampling))
        self._schedule()

    async def _call(self, requests: list[tuple[list[int], SamplingParams, asyncio.Future, float]],
                    sampling: SamplingParams) -> None:
        loop = asyncio.get_running_loop()
        try:
            gens = await loop.run_in_executor(self.executor, self.engine.generate, [r[0] for r in requests], sampling)
        except BaseException as e:  # noqa: BLE001 - handed to every request of the call
            error = e
            if isinstance(e, Exception) and not isinstance(e, GenerationInterrupted):
                error = EngineCallFailed(f"engine call of {len(requests)} request(s) failed: {type(e).__name__}: {e}")
                error.__cause__ = e
            for _, _, future, _ in requests:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(e, Exception):
                raise
        else:
            for (_, _, future, _), gen in zip(requests, gens, strict=True):
                if not future.done():
                    future.set_result(gen)
        finally:
            self._running -= 1
            self._just_freed = True
            self._schedule()
            self._just_freed = False
