"""The ``search`` tool of agent episodes: an async client of a search server (:mod:`producers.search_server`).

:class:`SearchTool` turns a query into the observation the agent sees, and never raises on a tool failure:
a timeout, an HTTP error status, a server that cannot be reached (or dies mid-request) and a body that is not
the expected JSON each become an observation starting with ``"error: "`` that names what happened, as a
real tool's failure reaches the agent. It counts its calls, its errors by kind and the latency of its calls.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import deque

import aiohttp

#: The error kinds :attr:`SearchTool.errors` counts.
ERROR_KINDS = ("timeout", "http", "connect", "garbage")
#: The most characters of a query that are sent (the rest is cut: a URL has a bounded length).
MAX_QUERY_CHARS = 512
#: Latencies kept for :meth:`SearchTool.percentiles` (the newest).
LATENCY_WINDOW = 1000
#: Connections open at once per tool (more concurrent calls wait for one, within their timeout).
MAX_CONNECTIONS = 256


class SearchTool:
    """An async search client: ``await tool(query)`` -> the observation text.

    Args:
        url: the search server's base URL (``http://host:port``).
        timeout_s: the bound of one call in seconds, connecting and reading included (``ClientTimeout(total)``).
        top_k: results asked for per call.

    Raises:
        ValueError: ``timeout_s`` not positive or ``top_k`` below 1.

    Attributes:
        calls: calls made.
        errors: failed calls by kind (``timeout``, ``http``, ``connect``, ``garbage``).
        latencies: seconds each of the newest :data:`LATENCY_WINDOW` calls took, failed ones included.
    """

    def __init__(self, url: str, timeout_s: float = 5.0, top_k: int = 1):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be at least 1")
        self.url, self.timeout_s, self.top_k = url.rstrip("/"), timeout_s, top_k
        self.calls = 0
        self.errors: dict[str, int] = dict.fromkeys(ERROR_KINDS, 0)
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> aiohttp.ClientSession:
        """The session of the running event loop, made on first use in it."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # a session belongs to its loop: one from a loop that has ended is dropped, not reused
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS))
            self._loop = loop
        return self._session

    async def __call__(self, query: str) -> str:
        """Search ``query`` (its first :data:`MAX_QUERY_CHARS` characters); returns the top ``top_k`` result
        texts joined by newlines, ``"no results"`` when none, or ``"error: ..."`` naming a failure (timeout,
        HTTP status, unreachable server, bad body). Never raises on a tool failure (cancellation passes)."""
        self.calls += 1
        start = time.perf_counter()
        try:
            kind, text = await self._search(query[:MAX_QUERY_CHARS])
        finally:
            self.latencies.append(time.perf_counter() - start)
        if kind is not None:
            self.errors[kind] += 1
        return text

    async def _search(self, query: str) -> tuple[str | None, str]:
        """``(error kind or None, observation)`` of one call."""
        try:
            async with self._client().get(f"{self.url}/search", params={"q": query, "k": str(self.top_k)}) as resp:
                body = await resp.read()
                if resp.status != 200:
                    detail = body[:200].decode("utf-8", "replace").strip()
                    return "http", f"error: search failed with HTTP {resp.status} {resp.reason or ''}".rstrip() + (
                        f": {detail}" if detail else "")
        except TimeoutError:  # aiohttp's timeouts are TimeoutErrors (some also ClientConnectionErrors)
            return "timeout", f"error: search timed out after {self.timeout_s} s"
        except aiohttp.ClientPayloadError as e:
            return "garbage", f"error: search returned a broken body ({e})"
        except (aiohttp.ClientConnectionError, OSError) as e:
            return "connect", f"error: cannot reach the search server at {self.url} ({type(e).__name__}: {e})"
        except aiohttp.ClientError as e:
            return "http", f"error: search request failed ({type(e).__name__}: {e})"
        try:
            results = json.loads(body.decode("utf-8"))["results"]
            texts = [r["text"] for r in results]
            if not all(isinstance(t, str) for t in texts):
                raise TypeError("a result's text is not a string")
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            return "garbage", (f"error: search returned a body that is not the expected JSON "
                               f"({type(e).__name__}: {str(e)[:120]}; {len(body)} bytes)")
        return None, "\n".join(texts) if texts else "no results"

    def percentiles(self) -> dict[str, float]:
        """``{"p50", "p90", "p99"}`` of the kept latencies, seconds; ``{}`` before the first call."""
        data = list(self.latencies)
        if not data:
            return {}
        if len(data) == 1:
            return {"p50": data[0], "p90": data[0], "p99": data[0]}
        q = statistics.quantiles(data, n=100, method="inclusive")
        return {"p50": q[49], "p90": q[89], "p99": q[98]}

    async def close(self) -> None:
        """Close the session (in the loop that made it); the next call makes a new one."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = self._loop = None
