"""The OpenAI-compatible endpoint (:mod:`producers.chat_server`) driven by the real ``openai`` client: a tool call
and its answer in the hermes format, token ids and logprobs, and the session's trajectory, token for token; and
the ``openai_agent`` workflow rolling out an agent's sessions as its samples."""
import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

from producers.chat_server import ChatServer
from producers.engine_batcher import EngineBatcher
from producers.engines import GenerationInterrupted, SamplingParams
from producers.search_server import SearchServer
from producers.search_tool import SearchTool

sys.path.insert(0, str(Path(__file__).parent))
from env_rig import PARALLEL, SEARCH_SCHEMA, cached_hermes_policy, episode_ids  # noqa: E402

openai = pytest.importorskip("openai")
EPISODE = ("code of zovob?\n", "zovob", "the code of zovob is 846", "846")


@pytest.fixture(scope="module")
def hermes_dir() -> Path:
    return cached_hermes_policy([EPISODE])


def test_an_openai_client_runs_a_tool_episode_and_the_session_is_its_token_sequence(hermes_dir):
    from producers.hf_engine import HFEngine

    engine = HFEngine(hermes_dir)

    async def main():
        batcher = EngineBatcher(engine)
        server = ChatServer(batcher, model="tiny")
        async with SearchServer() as search_server:
            search = SearchTool(search_server.url)
            url = await server.start()
            client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
            try:
                messages = [{"role": "user", "content": EPISODE[0]}]
                ask = dict(model="tiny", tools=[SEARCH_SCHEMA], temperature=0.0, max_tokens=80, logprobs=True,
                           extra_headers={"X-Session-ID": "episode-1"})
                first = await client.chat.completions.create(messages=messages, **ask)
                call = first.choices[0].message.tool_calls[0]
                answer = await search(json.loads(call.function.arguments)["query"])
                messages += [first.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": answer}]
                second = await client.chat.completions.create(messages=messages, **ask)
                with pytest.raises(openai.BadRequestError, match="one choice per request"):
                    await client.chat.completions.create(messages=messages, n=2, **ask)
                return first, second, answer, server.pop_session("episode-1")
            finally:
                await client.close()
                await server.stop()
                await search.close()
                batcher.close()

    first, second, answer, session = asyncio.run(main())
    ids, mask = episode_ids(engine.tokenizer, *EPISODE)
    call = first.choices[0].message.tool_calls[0]
    assert (first.choices[0].finish_reason, call.function.name, call.function.arguments) == \
        ("tool_calls", "search", '{"query": "zovob"}')
    assert answer == EPISODE[2]
    assert (second.choices[0].finish_reason, second.choices[0].message.content) == ("stop", "846")
    extra = first.model_extra
    prompt_len = mask.index(1)
    assert extra["prompt_token_ids"] == ids[:prompt_len]
    assert first.choices[0].model_extra["token_ids"] == ids[prompt_len:mask.index(0, prompt_len)]
    assert first.choices[0].model_extra["version"] == 0
    assert len(first.choices[0].logprobs.content) == len(first.choices[0].model_extra["token_ids"])
    assert all(t.logprob < 0 for t in first.choices[0].logprobs.content)
    # the second request re-sent the whole chat; its tokens continue the first's (only the tool turn was rendered)
    assert second.model_extra["prompt_token_ids"] == ids[:len(ids) - 4]
    [traj] = session.trajectories
    assert (traj.ids, traj.mask, session.calls) == (ids, mask, 2)


def test_a_request_for_parallel_tool_calls_gets_every_call_of_the_turn():
    from producers.hf_engine import HFEngine

    engine = HFEngine(cached_hermes_policy([PARALLEL]))

    async def main():
        batcher = EngineBatcher(engine)
        server = ChatServer(batcher, model="tiny")
        client = openai.AsyncOpenAI(base_url=await server.start(), api_key="unused", max_retries=0)
        ask = dict(model="tiny", messages=[{"role": "user", "content": PARALLEL[0]}], tools=[SEARCH_SCHEMA],
                   temperature=0.0, max_tokens=200)
        try:
            parallel = await client.chat.completions.create(parallel_tool_calls=True, **ask)
            default = await client.chat.completions.create(**ask)
            with pytest.raises(openai.BadRequestError, match="parallel_tool_calls='yes': must be true or false"):
                await client.chat.completions.create(extra_body={"parallel_tool_calls": "yes"}, **ask)
            with pytest.raises(openai.BadRequestError, match="stop=5: a string or a list of strings"):
                await client.chat.completions.create(extra_body={"stop": 5}, **ask)
            with pytest.raises(openai.BadRequestError, match=r"messages\[0\] is not an object with a string role"):
                await client.chat.completions.create(**{**ask, "messages": ["hello"]})
            with pytest.raises(openai.BadRequestError, match="max_tokens=0: at least 1"):
                await client.chat.completions.create(**{**ask, "max_tokens": 0})
            # the server's max_new_tokens caps what a request asks for
            capped_server = ChatServer(batcher, model="tiny", max_new_tokens=4)
            capped_client = openai.AsyncOpenAI(base_url=await capped_server.start(), api_key="unused", max_retries=0)
            try:
                capped = await capped_client.chat.completions.create(**{**ask, "max_tokens": 10 ** 12})
            finally:
                await capped_client.close()
                await capped_server.stop()
            return parallel.choices[0], default.choices[0], capped
        finally:
            await client.close()
            await server.stop()
            batcher.close()

    parallel, default, capped = asyncio.run(main())
    assert (capped.usage.completion_tokens, capped.choices[0].finish_reason) == (4, "length")
    queries = [json.loads(c.function.arguments)["query"] for c in parallel.message.tool_calls]
    assert (parallel.finish_reason, queries, [c.id for c in parallel.message.tool_calls]) == \
        ("tool_calls", list(PARALLEL[1]), ["call_0", "call_1"])
    # without it, the turn stopped as its first call closed
    assert [json.loads(c.function.arguments)["query"] for c in default.message.tool_calls] == ["zovob"]
    assert len(default.model_extra["token_ids"]) < len(parallel.model_extra["token_ids"])


def test_the_openai_agent_workflow_rolls_out_an_agents_sessions_as_its_samples(hermes_dir):
    from producers.hf_engine import HFEngine
    from producers.workflows import get_workflow
    from topics.schemas import Prompt

    engine = HFEngine(hermes_dir)
    agent = f"{Path(__file__).resolve().parents[2]}/examples/environments/search_openai_agent.py:agent"
    workflow = get_workflow("openai_agent", agent=agent)
    prompt = Prompt(prompt_id="p0", source="search", task_type="search", text=EPISODE[0], answer=EPISODE[3],
                    n_samples=3)

    def rollout():
        async def main():
            async with SearchServer() as search_server:
                search = SearchTool(search_server.url)
                batcher = EngineBatcher(engine)
                try:
                    return await workflow.rollout(prompt, {"actor": batcher},
                                                  SamplingParams(max_new_tokens=80, temperature=0.0),
                                                  {"search": search})
                finally:
                    batcher.close()
                    await search.close()
                    await workflow.close()
        return asyncio.run(main())

    [group] = rollout()
    ids, mask = episode_ids(engine.tokenizer, *EPISODE)
    assert group.workflow == "openai_agent" and len(group.samples) == 3
    for s in group.samples:
        assert (s.input_ids.tolist(), s.loss_mask.tolist(), s.reward, s.turns) == (ids, mask, 1.0, 2)
    # an interrupted engine call reaches the agent as HTTP 503, and the worker as the interruption it is
    engine.interrupt = threading.Event()
    engine.interrupt.set()
    with pytest.raises(GenerationInterrupted):
        rollout()
    with pytest.raises(ValueError, match="is not an async function"):
        get_workflow("openai_agent", agent=f"{agent[:-len(':agent')]}:SEARCH")
