"""The search tool: a real server (in this event loop, or a subprocess killed for real), real HTTP, the real client."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from astraflow.config import ConfigError, load_config
from astraflow.launcher.plan import plan_components
from astraflow.launcher.preflight import ConfigRefused, check_run_config
from astraflow.launcher.run import Launcher
from producers.raas import make_tools
from producers.search_server import Behaviour, SearchServer, fts_query, load_corpus
from producers.search_tool import SearchTool

ROOT = Path(__file__).resolve().parents[2]

DOCS = [
    ("ada", "Ada Lovelace wrote the first published algorithm for Babbage's Analytical Engine in 1843."),
    ("turing", "Alan Turing proved that the halting problem is undecidable and broke the Enigma cipher."),
    ("hopper", "Grace Hopper built the first compiler, A-0, and popularised the word debugging."),
    ("babbage", "Charles Babbage designed the Difference Engine and the Analytical Engine, mechanical computers."),
    ("shannon", "Claude Shannon founded information theory; the entropy of a source is measured in bits."),
]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "kb.jsonl"
    path.write_text("".join(json.dumps({"doc_id": d, "text": t}) + "\n" for d, t in DOCS))
    return path


def test_a_corpus_that_is_not_a_jsonl_file_is_refused_with_the_reason(tmp_path, corpus):
    assert [d for d, _ in load_corpus(corpus)] == [d for d, _ in DOCS]
    with pytest.raises(FileNotFoundError, match="is a directory: give a JSONL file"):
        load_corpus(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "nope.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"doc_id": "a", "text": "x"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_corpus(tmp_path / "bad.jsonl")


def test_retrieval_ranks_the_named_doc_first_and_survives_fts_syntax(corpus):
    async def main():
        async with SearchServer(corpus) as server:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{server.url}/health") as r:
                    assert r.status == 200 and await r.json() == {"ok": True, "docs": len(DOCS)}
                async with http.get(f"{server.url}/search", params={"q": "who was Grace Hopper?", "k": "3"}) as r:
                    assert r.status == 200
                    results = (await r.json())["results"]
                assert results[0]["doc_id"] == "hopper"
                assert all(isinstance(x["score"], float) for x in results)
                assert [x["score"] for x in results] == sorted((x["score"] for x in results), reverse=True)
                statuses = {}
                for q in ['"unbalanced', "Turing*", "AND( OR NOT", "-Babbage", "NEAR(Engine", "text:Ada", "^*\"():-"]:
                    async with http.get(f"{server.url}/search", params={"q": q}) as r:
                        statuses[q] = (r.status, len((await r.json())["results"]))
                assert statuses == {'"unbalanced': (200, 0), "Turing*": (200, 1), "AND( OR NOT": (200, 1),
                                    "-Babbage": (200, 1), "NEAR(Engine": (200, 1), "text:Ada": (200, 1),
                                    '^*"():-': (200, 0)}
                async with http.get(f"{server.url}/search", params={"q": "Ada", "k": "0"}) as r:
                    assert r.status == 400
            tool = SearchTool(server.url, top_k=2)
            try:
                engine = await tool("Analytical Engine Babbage")
                assert engine.split("\n") == [dict(DOCS)["babbage"], dict(DOCS)["ada"]]
                assert await tool("") == "no results"
                assert await tool("?!* -") == "no results"
                assert (await tool("Claude Shannon entropy")).startswith("Claude Shannon")
            finally:
                await tool.close()
            assert tool.calls == 4 and sum(tool.errors.values()) == 0
            assert set(tool.percentiles()) == {"p50", "p90", "p99"}

    asyncio.run(main())
    assert fts_query('a "b" AND(c*') == '"a" OR "b" OR "AND" OR "c"' and fts_query(" ?-* ") is None


def test_latency_draws_are_seeded_log_normal():
    a, b = Behaviour(0.05, 0.2, seed=1), Behaviour(0.05, 0.2, seed=1)
    draws = [a.draw() for _ in range(4000)]
    assert draws == [b.draw() for _ in range(4000)]
    assert [d for _, d in draws[:50]] != [Behaviour(0.05, 0.2, seed=2).draw()[1] for _ in range(50)]
    delays = sorted(d for _, d in draws)
    assert all(f is None for f, _ in draws)
    assert statistics.median(delays) == pytest.approx(0.05, rel=0.1)
    assert delays[int(0.99 * len(delays))] == pytest.approx(0.2, rel=0.2)
    assert Behaviour(0.0, 0.0).draw() == (None, 0.0)
    faults = [f for f, _ in (lambda b: [b.draw() for _ in range(3000)])(Behaviour(hang=0.2, error=0.3, garbage=0.1))]
    assert {k: round(faults.count(k) / 3000, 1) for k in ("hang", "error", "garbage", None)} == \
        {"hang": 0.2, "error": 0.3, "garbage": 0.1, None: 0.4}
    with pytest.raises(ValueError, match="p99_s"):
        Behaviour(0.2, 0.05)


def test_concurrent_requests_overlap(corpus):
    # Delays long against the event loop's overhead (serving and awaiting 60 requests: 0.02 s in a quiet run,
    # ~0.05-0.17 s under load), so that each bound below sits between the two by a wide margin
    n, median, p99 = 60, 0.2, 0.8
    expected = sorted(d for _, d in (lambda b: [b.draw() for _ in range(n)])(Behaviour(median, p99, seed=1)))

    async def main():
        async with SearchServer(corpus, Behaviour(median, p99, seed=1)) as server:
            tool = SearchTool(server.url, timeout_s=5.0)
            try:
                t0 = time.perf_counter()
                answers = await asyncio.gather(*(tool("Alan Turing") for _ in range(n)))
                return time.perf_counter() - t0, answers, tool
            finally:
                await tool.close()

    wall, answers, tool = asyncio.run(main())
    assert answers == [dict(DOCS)["turing"]] * n
    assert tool.calls == n and sum(tool.errors.values()) == 0
    # one at a time they take at least the sum of the draws (12 s); together the slowest draw (0.67 s) plus overhead
    serial = sum(expected)
    assert wall < serial / 3, f"{n} concurrent requests took {wall:.2f} s of {serial:.2f} s: they did not overlap"
    measured = sorted(tool.latencies)
    # the server slept exactly the seed's first n draws: each order statistic of the latencies is at least the draw's
    assert all(m >= e - 0.005 for m, e in zip(measured, expected)), list(zip(measured, expected))[:5]
    # p50 is the latencies' median: at least the draws' median (0.15 s), and at most 2 s above it: far above the
    # overhead (up to ~0.17 s measured under load), far below latencies that counted the wait behind the other
    # requests (served one at a time, the median request would end 6.7 s in)
    p = tool.percentiles()
    assert p["p50"] == pytest.approx(statistics.median(measured))
    drawn = statistics.median(expected)
    assert drawn - 0.005 <= p["p50"] < drawn + 2.0, (p["p50"], drawn)
    assert p["p50"] <= p["p90"] <= p["p99"]


def test_faults_become_error_observations(corpus):
    async def call(behaviour: Behaviour, timeout_s: float = 5.0) -> tuple[str, SearchTool, float]:
        async with SearchServer(corpus, behaviour) as server:
            tool = SearchTool(server.url, timeout_s=timeout_s)
            try:
                t0 = time.perf_counter()
                text = await tool("Ada Lovelace")
                return text, tool, time.perf_counter() - t0
            finally:
                await tool.close()

    text, tool, _ = asyncio.run(call(Behaviour(error=1.0)))
    assert text.startswith("error: ") and "HTTP 500" in text and "injected fault" in text
    assert tool.errors == {"timeout": 0, "http": 1, "connect": 0, "garbage": 0}

    text, tool, _ = asyncio.run(call(Behaviour(garbage=1.0)))
    assert text.startswith("error: ") and "not the expected JSON" in text
    assert tool.errors["garbage"] == 1 and tool.calls == 1

    t0 = time.perf_counter()
    text, tool, took = asyncio.run(call(Behaviour(hang=1.0), timeout_s=0.5))
    assert text == "error: search timed out after 0.5 s"
    # abandoned at its 0.5 s timeout, not after the 3600 s hang (15 s: 30 times the timeout, for a busy machine)
    assert 0.45 < took < 15.0 and tool.errors["timeout"] == 1 and len(tool.latencies) == 1
    # the server stopped too, the hung request cancelled (at once, or after SHUTDOWN_S), not waited for 3600 s
    assert time.perf_counter() - t0 < 30.0


def test_killed_server_process_gives_connect_errors(corpus):
    proc = subprocess.Popen([sys.executable, "-m", "astraflow", "search-server", "--corpus", str(corpus),
                             "--median-s", "2.0", "--p99-s", "2.0"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("search server: serving http://127.0.0.1:") and "(5 documents)" in line, line
        url = line.split()[3]

        async def main():
            tool = SearchTool(url, timeout_s=60.0)  # a dead server is told at once, not by this timeout
            try:
                assert await tool("Alan Turing") == dict(DOCS)["turing"]
                in_flight = asyncio.ensure_future(tool("Grace Hopper"))
                await asyncio.sleep(0.3)  # the server sleeps 2 s on it
                proc.send_signal(signal.SIGKILL)
                t0 = time.perf_counter()
                cut = await in_flight
                cut_s = time.perf_counter() - t0
                await asyncio.sleep(0.1)
                t0 = time.perf_counter()
                refused = await tool("Grace Hopper")
                return cut, cut_s, refused, time.perf_counter() - t0, tool
            finally:
                await tool.close()

        cut, cut_s, refused, refused_s, tool = asyncio.run(main())
        assert proc.wait(5) == -signal.SIGKILL
        # both told at once (~ms): 10 s is a busy machine's slack, well under the 60 s timeout they would wait out
        assert cut.startswith(f"error: cannot reach the search server at {url}") and cut_s < 10, (cut, cut_s)
        assert refused.startswith(f"error: cannot reach the search server at {url}") and refused_s < 10
        assert "Connect" in refused, refused
        assert tool.calls == 3 and tool.errors == {"timeout": 0, "http": 0, "connect": 2, "garbage": 0}
    finally:
        proc.kill()
        proc.wait()


def _run_config(tmp_path: Path, *search: str):
    return load_config(None, ["policies.actor.model=tiny", f"run_dir={tmp_path / 'run'}", *search])


def test_search_config_is_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"tools\.search\.latency: p99_s \(0\.1\) is below median_s \(0\.5\)"):
        _run_config(tmp_path, "tools.search.latency.median_s=0.5", "tools.search.latency.p99_s=0.1")
    with pytest.raises(ConfigError, match=r"tools\.search\.faults: hang \+ error \+ garbage = 1\.2 > 1"):
        _run_config(tmp_path, "tools.search.faults.error=0.6", "tools.search.faults.garbage=0.6")
    with pytest.raises(ConfigError, match=r"tools\.search: url attaches to a running server: seed"):
        _run_config(tmp_path, "tools.search.url=http://host:1", "tools.search.seed=3")
    with pytest.raises(ConfigError, match=r"tools\.search\.timeout_s"):
        _run_config(tmp_path, "tools.search.timeout_s=0")
    assert _run_config(tmp_path).tools.search is None
    s = _run_config(tmp_path, "tools.search.latency.median_s=0.1", "tools.search.latency.p99_s=0.1").tools.search
    assert (s.url, s.timeout_s, s.top_k, s.faults.hang) == (None, 5.0, 1, 0.0)


def test_a_workflow_calling_a_tool_the_config_lacks_is_refused_naming_the_field(tmp_path):
    """search_agent declares the search tool: a config without tools.search is refused before any process starts
    (preflight) and by a RaaS worker started by hand (its config section), not by every episode's KeyError."""
    cfg = _run_config(tmp_path, "workflow.name=search_agent")
    message = ("tools.search: workflow 'search_agent' calls the tool 'search', and the config does not configure it "
               "(configured tools: none)")
    with pytest.raises(ConfigRefused) as refused:
        check_run_config(cfg)
    assert str(refused.value) == message
    with pytest.raises(ValidationError, match=re.escape(message)):
        cfg.raas_section()
    cfg = _run_config(tmp_path, "workflow.name=search_agent", "tools.search.url=http://127.0.0.1:1")
    assert cfg.raas_section().tools.names() == {"search"}


def test_launcher_starts_search_and_points_raas_at_it(tmp_path, corpus):
    overrides = ["policies.actor.model=tiny", f"run_dir={tmp_path / 'run'}", "tools.search.seed=4",
                 f"tools.search.corpus={corpus}", "tools.search.latency.median_s=0.01",
                 "tools.search.latency.p99_s=0.02"]
    cfg = load_config(None, overrides)
    assert [c.name for c in plan_components(load_config(None, overrides[:2]), tmp_path / "x.yaml", [])][0] != "search"
    launcher = Launcher(cfg, tmp_path / "x.yaml", overrides)
    search = launcher.components[0]
    assert search.name == "search" and search.ready_url.startswith("http://127.0.0.1:")
    raas = next(c for c in launcher.components if c.name == "raas-0")
    assert raas.argv[raas.argv.index("--search-url") + 1] == search.ready_url

    cfg.run_dir.mkdir(parents=True)
    launcher.supervisor.start(search)
    try:
        launcher.supervisor.wait_ready(search, timeout_s=30.0)

        async def main():
            tool = make_tools(cfg.tools, search.ready_url)["search"]
            try:
                return await tool("Enigma")
            finally:
                await tool.close()

        assert asyncio.run(main()) == dict(DOCS)["turing"]
        launcher.supervisor.stop_all(grace_s=10.0)
        assert search.proc.returncode == 0
    finally:
        if search.proc.poll() is None:
            search.proc.kill()
            search.proc.wait()
