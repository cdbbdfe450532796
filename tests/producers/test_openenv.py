"""The ``openenv`` workflow (:mod:`producers.openenv_client`) against a real OpenEnv server on loopback: the
guess-the-number example served by openenv-core from ``.venv-openenv`` (``scripts/install_openenv.sh``; the tests
that need it skip without it), played by the tiny model with a chat template."""
import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from astraflow.config import ConfigError, load_config
from astraflow.launcher.plan import plan_components
from producers.engine_batcher import EngineBatcher
from producers.engines import SamplingParams
from producers.environments import render, render_delta
from producers.openenv_client import OpenEnvClient, OpenEnvError, seed_of
from producers.ports import free_port
from producers.workflows import get_workflow
from topics.schemas import Prompt

from tests.producers.env_rig import HERMES_TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
GAME = ROOT / "examples" / "environments" / "openenv_guess.py"
RULES = "Guess my number from 1 to 8. Answer with the number only."
needs_server = pytest.mark.skipif(not OPENENV_PYTHON.exists(),
                                  reason="no .venv-openenv (scripts/install_openenv.sh) to serve the OpenEnv game")


def start_game(log_path: Path, *options: str, script: Path = GAME) -> tuple[subprocess.Popen, str]:
    """The guess-the-number server (or another OpenEnv server ``script`` of ``.venv-openenv``) as a subprocess;
    (the process, its URL) once ``/health`` answers."""
    port = free_port()
    proc = subprocess.Popen([str(OPENENV_PYTHON), str(script), "--port", str(port), *options],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    proc, url = start_game(tmp_path_factory.mktemp("openenv") / "game.log", "--max-sessions", "4")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny arithmetic model with a chat template (it writes digits: guesses)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(out)
    return out


def replay(url: str, prompt: Prompt, actions: list[str]) -> tuple[list[str], float]:
    """The observations and the return of ``actions`` played in a fresh session reset like the episode's."""
    async def main():
        client = OpenEnvClient(url, timeout_s=30)
        await client.start()
        session = await client.acquire()
        try:
            result = await session.request({"type": "reset", "data": {"seed": seed_of(prompt)}})
            seen, total = [result["observation"]["message"]], 0.0
            for action in actions:
                result = await session.request({"type": "step", "data": {"message": action}})
                seen.append(result["observation"]["message"])
                total += result["reward"]
            return seen, total
        finally:
            await client.release(session)
            await client.close()
    return asyncio.run(main())


@needs_server
def test_episodes_play_the_servers_game_and_their_tokens_are_the_rendered_chat(game, chat_model):
    """Two prompts of 3 episodes each: every episode is the chat of the server's observations (user turns, not
    trained on) and the model's moves, its reward is the server's return for those moves in a session reset with
    the prompt's seed, and the sessions are reused from one prompt to the next."""
    from producers.hf_engine import HFEngine

    engine = HFEngine(chat_model)
    tok = engine.tokenizer
    workflow = get_workflow("openenv", url=game, max_turns=3)
    prompts = [Prompt(prompt_id=f"game-{i}", source="openenv", task_type="game", text="play", n_samples=3)
               for i in range(2)]

    async def main():
        batcher = EngineBatcher(engine)
        try:
            groups = [await workflow.rollout(p, {"actor": batcher}, SamplingParams(max_new_tokens=3, temperature=1.0,
                                                                                 seed=i), {})
                      for i, p in enumerate(prompts)]
            return groups, workflow.env.client.sessions
        finally:
            batcher.close()
            await workflow.close()
    groups, sessions = asyncio.run(main())
    assert sessions == 3  # as many as episodes at once, reused by the second prompt
    assert workflow.env.client.sessions == 0  # closed
    rewards = []
    for prompt, [group] in zip(prompts, groups):
        assert group.workflow == "openenv" and len(group.samples) == 3
        for s in group.samples:
            ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
            # the model's moves are the runs of trained tokens; the rest is the template's rendering of the chat
            runs, start = [], None
            for i, m in enumerate(mask + [0]):
                if m and start is None:
                    start = i
                elif not m and start is not None:
                    runs.append((start, i))
                    start = None
            moves = [tok.decode(ids[a:b], skip_special_tokens=True) for a, b in runs]
            assert 1 <= len(moves) == s.turns <= 3
            seen, total = replay(game, prompt, [m.strip() for m in moves])
            assert seen[0] == RULES
            expect = tok.encode(render(tok, [{"role": "user", "content": RULES}], None), add_special_tokens=False)
            for (a, b), observation, nxt in zip(runs, seen[1:], runs[1:] + [None]):
                expect += ids[a:b]
                if nxt is not None:  # an observation after the last move is not shown to the model
                    delta = render_delta(tok, [{"role": "user", "content": observation}], None)
                    if ids[b - 1] == tok.eos_token_id and delta.startswith(tok.eos_token):
                        delta = delta[len(tok.eos_token):]
                    expect += tok.encode(delta, add_special_tokens=False)
            assert ids == expect
            assert s.reward == total
            assert (s.versions == np.where(s.loss_mask == 1, 0, -1)).all()
            # the episode ended because the server said done, or at max_turns, or a move hit max_new_tokens
            assert seen[-1] == "correct" or s.turns == 3 or s.finish_reason == "length"
            rewards.append(s.reward)
    assert set(rewards) <= {0.0, 1.0}


@needs_server
def test_a_server_with_fewer_sessions_than_episodes_is_refused_naming_max_episodes(game, chat_model):
    from producers.hf_engine import HFEngine

    engine = HFEngine(chat_model)
    workflow = get_workflow("openenv", url=game, max_turns=2)
    prompt = Prompt(prompt_id="p", source="openenv", task_type="game", text="play", n_samples=5)  # the server: 4

    async def main():
        batcher = EngineBatcher(engine)
        try:
            await workflow.rollout(prompt, {"actor": batcher}, SamplingParams(max_new_tokens=3), {})
        finally:
            batcher.close()
            await workflow.close()
    with pytest.raises(OpenEnvError, match=r"4 of 4 sessions in use: the server must allow at least "
                                           r"raas.max_episodes \+ n_samples - 1 sessions"):
        asyncio.run(main())


def start_env(workflow) -> None:
    async def main():
        try:
            await workflow.env.start()
        finally:
            await workflow.close()
    asyncio.run(main())


@needs_server
def test_an_action_field_the_server_lacks_is_refused_naming_the_option(game):
    with pytest.raises(ValueError, match=r"options.action_field 'move' is not a string field of the action of "
                                         r".*its string fields: \['message'\]"):
        start_env(get_workflow("openenv", url=game, action_field="move"))


def test_a_worker_given_the_command_and_no_url_refuses_naming_who_sets_it():
    with pytest.raises(ValueError, match=r"options.url is not set: `astraflow run` sets it for the server it starts "
                                         r"from options.command; a worker run alone needs options.url"):
        start_env(get_workflow("openenv", command="srv --port {port}"))


@pytest.mark.parametrize("options, message", [
    ({}, r"options.url \(the server's http://host:port\) or options.command .* is required"),
    ({"url": "127.0.0.1:80"}, "is not an http:// or https:// URL"),
    ({"url": "http://x", "max_turns": 0}, "options.max_turns must be an integer >= 1, got 0"),
    ({"url": "http://x", "max_turns": "abc"}, "options.max_turns must be an integer >= 1, got 'abc'"),
    ({"url": "http://x", "timeout_s": "soon"}, "options.timeout_s must be a number > 0, got 'soon'"),
])
def test_a_bad_openenv_option_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        get_workflow("openenv", **options)


def openenv_config(tmp_path: Path, options: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: oe
run_dir: {tmp_path / 'run'}
bus: local://{tmp_path / 'bus'}
policies: {{actor: {{model: tiny}}}}
workflow: {{name: openenv, options: {options}}}
""")
    return path


def test_astraflow_run_starts_the_command_and_gives_the_workers_its_url(tmp_path):
    path = openenv_config(tmp_path, '{command: "python game.py --port {port} --high 8"}')
    comps = {c.name: c for c in plan_components(load_config(path), path, ["raas.workers=1"])}
    server = comps["openenv"]
    port = server.ready_url.rsplit(":", 1)[1]
    assert server.argv == ["python", "game.py", "--port", port, "--high", "8"]
    assert server.ready_url == f"http://127.0.0.1:{port}" and list(comps).index("openenv") == 0
    assert f"workflow.options.url={server.ready_url}" in comps["raas-0"].argv
    assert load_config(path, ["raas.workers=1", f"workflow.options.url={server.ready_url}"]).workflow.options["url"] \
        == server.ready_url
    with pytest.raises(ConfigError, match="url or the command that starts it, not both"):
        plan_components(load_config(path, ['workflow.options.url="http://h:1"']), path, [])
    path = openenv_config(tmp_path, '{command: "python game.py"}')
    with pytest.raises(ConfigError, match=r"has no \{port\}"):
        plan_components(load_config(path), path, [])


@needs_server
def test_a_pooled_session_the_server_closed_is_replaced_not_failed(tmp_path):
    """uvicorn pings every WebSocket and closes one that does not answer; nobody reads a session idle in the pool,
    so the server closes it. The next episode's reset on it fails without an answer: the client ends it and
    resets a new session instead of failing the episode."""
    proc, url = start_game(tmp_path / "game.log", "--ws-ping-s", "0.2")

    async def main():
        client = OpenEnvClient(url, timeout_s=30)
        await client.start()
        try:
            first, _ = await client.reset({"seed": 1})
            await client.release(first)
            deadline = time.monotonic() + 120
            while first.ws.get_extra_info("peername") is not None:  # the server has not closed it yet
                assert time.monotonic() < deadline, "the server never closed the idle session"
                await asyncio.sleep(0.1)
            second, answer = await client.reset({"seed": 1})
            return first, second, answer, client.sessions
        finally:
            await client.close()

    try:
        first, second, answer, sessions = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(30)
    assert second is not first and sessions == 1
    assert answer["observation"] == {"message": RULES}


def test_an_unreachable_server_stops_the_worker_and_dead_letters_nothing(tmp_path):
    """A server that cannot be reached is the server's failure, not the prompt's: the RaaS worker raises
    OpenEnvUnavailable (the launcher restarts it; the prompt is delivered again) and writes no dead letter."""
    from producers.openenv_client import OpenEnvUnavailable
    from producers.acquisition import acquire_run
    from producers.raas import RaasWorker
    from topics.bus import connect
    from topics.layout import ensure_run_topics
    from topics.names import TopicNames

    path = openenv_config(tmp_path, f'{{url: "http://127.0.0.1:{free_port()}"}}')  # nothing listens there
    cfg = load_config(path, ["data.sources=[{name: arith, limit: 2}]", "data.n_samples=2"])
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=1)
    assert acquire_run(cfg.acquisition_section()) == 2
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    try:
        with pytest.raises(OpenEnvUnavailable, match="GET /schema failed"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                worker.step()
    finally:
        worker.close()
    assert sum(bus.admin().end_offsets(names.deadletter).values()) == 0
    assert worker.totals["rollout_errors"] == 0
