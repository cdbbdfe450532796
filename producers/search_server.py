"""A local HTTP retrieval server: the ``search`` tool of agent rollouts.

The corpus is a JSONL file, one document a line: ``{"doc_id": str, "text": str}`` (default
:data:`DEFAULT_CORPUS`). At start-up it is indexed in an in-memory SQLite FTS5 table, and queries are ranked
by BM25 (SQLite's ``bm25()``). A query is user text (an agent's): it is turned into an FTS5 query by
:func:`fts_query` (each alphanumeric term quoted, the terms OR-ed), so no query can raise an FTS5 syntax error;
a query without a term finds nothing.

HTTP API (:func:`build_app`):

- ``GET /search?q=<text>&k=<int, default 1, at most MAX_K>`` -> ``200 {"results": [{"doc_id", "text",
  "score"}]}``, best first; ``score`` is the BM25 relevance, higher is better (SQLite's ``bm25()``
  negated). A bad ``k`` -> 400 with a text body.
- ``GET /health`` -> ``200 {"ok": true, "docs": N}`` (no latency, no fault).

Each ``/search`` request draws, from one seeded ``random.Random`` stream (:class:`Behaviour`), a latency
(log-normal with the given median and p99; median 0: no delay) and a fault: ``hang`` (sleep ``hang_s``, by
default an hour: it never answers in time), ``error`` (HTTP 500 with a text body) or ``garbage`` (HTTP 200 whose
body is not JSON). Delays are ``asyncio.sleep``: concurrent requests overlap, as a remote search API's do.

``astraflow search-server`` (:func:`serve`) runs it as a process and prints the URL it serves once ready;
``astraflow run`` starts one as the component ``search`` when ``tools.search`` is set without a ``url``. Tests
and scripts run one in their own event loop with :class:`SearchServer`. The client agents use is
:class:`producers.search_tool.SearchTool`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
import sqlite3
import threading
from pathlib import Path

from aiohttp import web

from producers.ports import listen

log = logging.getLogger(__name__)

#: The built-in corpus (``tools.search.corpus`` unset).
DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "search_kb.jsonl"
#: z of the 0.99 quantile of the standard normal: sigma = ln(p99 / median) / Z99.
Z99 = 2.3263478740408408
#: The most results one request may ask for (``k``).
MAX_K = 50
#: The most terms of a query that are searched for (the rest are ignored).
MAX_TERMS = 64
#: Seconds a stopping server waits for requests in flight before cancelling them (hung ones included).
SHUTDOWN_S = 2.0
#: The body of a ``garbage`` fault: HTTP 200, and not JSON.
GARBAGE_BODY = b"\x00\xff<html>search backend overloaded, try again</html>\x80"

_TERM = re.compile(r"[^\W_]+")


def load_corpus(path: str | Path) -> list[tuple[str, str]]:
    """The documents of a JSONL corpus, as ``(doc_id, text)`` in file order (blank lines skipped).

    Raises:
        FileNotFoundError: ``path`` does not exist or is a directory.
        ValueError: a line that is not UTF-8 JSON, not an object, or lacks a string ``doc_id`` or ``text``; a
            ``doc_id`` seen before; or no document at all (the message gives ``path:line``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"search corpus {path} is a directory: give a JSONL file of {{doc_id, text}} lines"
                                if path.is_dir() else f"search corpus {path} does not exist")
    docs, seen = [], set()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{n}: not a UTF-8 JSON line ({e})") from None
            if not (isinstance(rec, dict) and isinstance(rec.get("doc_id"), str) and isinstance(rec.get("text"), str)):
                raise ValueError(f"{path}:{n}: want an object with string fields doc_id and text")
            if rec["doc_id"] in seen:
                raise ValueError(f"{path}:{n}: doc_id {rec['doc_id']!r} appears twice")
            seen.add(rec["doc_id"])
            docs.append((rec["doc_id"], rec["text"]))
    if not docs:
        raise ValueError(f"search corpus {path} holds no document")
    return docs


def fts_query(text: str) -> str | None:
    """The FTS5 query for user text: its alphanumeric terms (at most :data:`MAX_TERMS`), each quoted, joined
    by ``OR``; None when it has none. Quoting makes every term a plain string, so FTS5 syntax in ``text``
    (``"``, ``*``, ``AND``, ``NEAR(``, ``-``, ``:``) is never interpreted."""
    terms = _TERM.findall(text)[:MAX_TERMS]
    return " OR ".join(f'"{t}"' for t in terms) or None


class SearchIndex:
    """An in-memory SQLite FTS5 index of documents, ranked by BM25.

    Args:
        docs: ``(doc_id, text)`` pairs (see :func:`load_corpus`).
    """

    def __init__(self, docs: list[tuple[str, str]]):
        # one connection, used by the event loop's thread only (built, maybe, in another)
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute("CREATE VIRTUAL TABLE docs USING fts5(doc_id UNINDEXED, text)")
        self._db.executemany("INSERT INTO docs(doc_id, text) VALUES (?, ?)", docs)
        self._db.commit()
        self.size = len(docs)

    def search(self, query: str, k: int = 1) -> list[dict]:
        """The ``k`` best documents for user text ``query``: ``[{"doc_id", "text", "score"}]``, best first
        (``score``: BM25 relevance, higher is better); ``[]`` when ``query`` has no term."""
        match = fts_query(query)
        if match is None:
            return []
        rows = self._db.execute("SELECT doc_id, text, bm25(docs) FROM docs WHERE docs MATCH ? "
                                "ORDER BY bm25(docs) LIMIT ?", (match, k)).fetchall()
        return [{"doc_id": d, "text": t, "score": -s} for d, t, s in rows]

    def __len__(self) -> int:
        return self.size


class Behaviour:
    """The seeded latency and faults of a server: one ``random.Random(seed)`` stream, two draws per request.

    Args:
        median_s, p99_s: the log-normal latency's median and 99th percentile, seconds (mu = ln(median),
            sigma = ln(p99 / median) / :data:`Z99`); median 0: no delay.
        hang, error, garbage: the probabilities of each fault (each in [0, 1], their sum at most 1).
        seed: the stream's seed.
        hang_s: seconds a hung request sleeps.

    Raises:
        ValueError: a negative latency, ``p99_s`` below ``median_s``, ``p99_s`` set with ``median_s`` 0, a
            probability outside [0, 1], probabilities summing over 1, or ``hang_s`` not positive (naming it).
    """

    FAULTS = ("hang", "error", "garbage")

    def __init__(self, median_s: float = 0.0, p99_s: float = 0.0, hang: float = 0.0, error: float = 0.0,
                 garbage: float = 0.0, seed: int = 0, hang_s: float = 3600.0):
        if median_s < 0 or p99_s < 0:
            raise ValueError(f"latency must not be negative (median_s={median_s}, p99_s={p99_s})")
        if median_s == 0 and p99_s > 0:
            raise ValueError(f"p99_s={p99_s} with median_s=0 (no delay): set median_s too")
        if p99_s < median_s:
            raise ValueError(f"p99_s ({p99_s}) is below median_s ({median_s})")
        probs = {"hang": hang, "error": error, "garbage": garbage}
        for name, p in probs.items():
            if not 0 <= p <= 1:
                raise ValueError(f"{name}={p}: a probability is in [0, 1]")
        if sum(probs.values()) > 1 + 1e-9:
            raise ValueError(f"hang + error + garbage = {sum(probs.values()):g} > 1")
        if hang_s <= 0:
            raise ValueError(f"hang_s={hang_s} must be positive")
        self.median_s, self.p99_s, self.hang_s, self.seed = median_s, p99_s, hang_s, seed
        self.mu = math.log(median_s) if median_s > 0 else 0.0
        self.sigma = math.log(p99_s / median_s) / Z99 if median_s > 0 else 0.0
        self._bounds = [(name, sum(list(probs.values())[:i + 1])) for i, name in enumerate(self.FAULTS)]
        self._rng = random.Random(seed)

    def draw(self) -> tuple[str | None, float]:
        """The next request's ``(fault, delay_s)``: fault is None, ``hang``, ``error`` or ``garbage``; delay_s
        the latency in seconds (0 with median 0). Always two draws from the stream, whatever the settings."""
        u, z = self._rng.random(), self._rng.gauss(0.0, 1.0)
        fault = next((name for name, bound in self._bounds if u < bound), None)
        delay = math.exp(self.mu + self.sigma * z) if self.median_s > 0 else 0.0
        return fault, delay


def build_app(index: SearchIndex, behaviour: Behaviour) -> web.Application:
    """The aiohttp application: ``GET /search`` and ``GET /health`` (see the module docstring)."""

    async def search(request: web.Request) -> web.Response:
        query = request.query.get("q", "")
        try:
            k = int(request.query.get("k", "1"))
        except ValueError:
            return web.Response(status=400, text=f"k={request.query.get('k')!r} is not an integer")
        if not 1 <= k <= MAX_K:
            return web.Response(status=400, text=f"k={k}: want 1 <= k <= {MAX_K}")
        fault, delay = behaviour.draw()
        if fault == "hang":
            await asyncio.sleep(behaviour.hang_s)
        elif delay > 0:
            await asyncio.sleep(delay)
        if fault == "error":
            return web.Response(status=500, text="injected fault: internal search error")
        if fault == "garbage":
            return web.Response(status=200, body=GARBAGE_BODY, content_type="application/json")
        return web.json_response({"results": index.search(query, k)})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "docs": len(index)})

    app = web.Application()
    app.router.add_get("/search", search)
    app.router.add_get("/health", health)
    return app


class SearchServer:
    """A search server in the running event loop; an async context manager (``async with SearchServer(...)
    as server: server.url``).

    Args:
        corpus: a JSONL corpus file (see :func:`load_corpus`), or ``(doc_id, text)`` pairs.
        behaviour: latency and faults (default: none).
        host: the address to bind.
        port: the port; 0: a free one (:attr:`url` tells which once started).

    Raises:
        FileNotFoundError, ValueError: from :func:`load_corpus`.
    """

    def __init__(self, corpus: str | Path | list[tuple[str, str]] = DEFAULT_CORPUS, behaviour: Behaviour | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        docs = load_corpus(corpus) if isinstance(corpus, (str, Path)) else list(corpus)
        self.index = SearchIndex(docs)
        self.behaviour = behaviour or Behaviour()
        self.host, self.port = host, port
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Bind and serve; returns the URL (``http://host:port``).

        Raises:
            OSError: the port cannot be bound.
        """
        # handler_cancellation: a client that gives up (its timeout) cancels its request, a hung one included
        self._runner = web.AppRunner(build_app(self.index, self.behaviour), handler_cancellation=True,
                                     shutdown_timeout=SHUTDOWN_S, access_log=None)
        self.port = await listen(self._runner, self.host, self.port)
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        """Stop serving: requests in flight get :data:`SHUTDOWN_S` seconds, then are cancelled."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> "SearchServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


def serve(server: SearchServer, stop: threading.Event, poll_s: float = 0.2) -> None:
    """Run ``server`` in a new event loop until ``stop`` is set (a signal handler, the launcher watch); prints
    ``search server: serving <url> (<N> documents)`` on stdout once it answers.

    Raises:
        OSError: the port cannot be bound.
    """

    async def main() -> None:
        url = await server.start()
        print(f"search server: serving {url} ({len(server.index)} documents)", flush=True)
        try:
            while not stop.is_set():
                await asyncio.sleep(poll_s)
        finally:
            await server.stop()
            log.info("search server at %s stopped", url)

    asyncio.run(main())
