"""The ``openenv`` workflow against an OpenEnv environment whose actions are MCP tools: the look-up example
(``examples/environments/openenv_lookup.py``, an ``MCPEnvironment`` with a ``search`` and an ``answer`` tool)
served by openenv-core from ``.venv-openenv`` on loopback, played by a tiny hermes policy trained to call them."""
import asyncio
import uuid
from pathlib import Path

import numpy as np
import pytest

from producers.engine_batcher import EngineBatcher
from producers.engines import SamplingParams
from producers.environments import environment_errors
from producers.openenv_client import OpenEnvClient, seed_of
from producers.sources import prompt_id
from producers.workflows import get_workflow
from topics.schemas import Prompt

from tests.producers.env_rig import cached_hermes_policy, call_text, episode_ids, roll_out_one_group
from tests.producers.test_openenv import ROOT, game, needs_server, start_env, start_game  # noqa: F401  (a fixture)

LOOKUP = ROOT / "examples" / "environments" / "openenv_lookup.py"
#: the example's knowledge base: entity -> code
CODES = {"zovob": "846", "kavor": "381"}
#: the tools the server lists, as the policy's chat template is given them
TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the knowledge base for the document about an entity.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"query": {"type": "string", "description": "words naming the entity."}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "answer", "description": "Give the code asked for; this ends the episode.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"code": {"type": "string", "description": "the code."}},
                       "required": ["code"]}}},
]


def episode(entity: str) -> tuple[str, str, str, str]:
    """The look-up episode of ``entity`` (:func:`~tests.producers.env_rig.episode_ids`): the question, the search,
    its document, and the answer call."""
    return (f"What is the code of {entity}?", entity, f"the code of {entity} is {CODES[entity]}",
            call_text("answer", {"code": CODES[entity]}))


@pytest.fixture(scope="module")
def lookup(tmp_path_factory):
    proc, url = start_game(tmp_path_factory.mktemp("openenv-mcp") / "lookup.log", "--max-sessions", "4",
                           script=LOOKUP)
    yield url
    proc.terminate()
    proc.wait(30)


#: the prompt the episodes play: the first arith prompt (what the RaaS test's run acquires)
PROMPT_ID = prompt_id("arith", 0)


@pytest.fixture(scope="module")
def policy(lookup) -> Path:
    """The tiny model trained to replay, greedily, the look-up episode the server plays for :data:`PROMPT_ID`
    (one episode: the tiny model does not learn to copy an entity it was not trained on)."""
    return cached_hermes_policy([episode(entity_of(lookup, PROMPT_ID))], tools=TOOLS)


def question_of(url: str, prompt: Prompt) -> str:
    """The question a session reset like ``prompt``'s episodes asks."""
    async def main():
        client = OpenEnvClient(url, timeout_s=30)
        await client.start()
        session = await client.acquire()
        try:
            return (await session.request({"type": "reset", "data": {"seed": seed_of(prompt)}}))["observation"]
        finally:
            await client.release(session)
            await client.close()
    return asyncio.run(main())["message"]


def entity_of(url: str, pid: str) -> str:
    """The entity the server asks about in the episodes of prompt ``pid``."""
    question = question_of(url, Prompt(prompt_id=pid, source="s", task_type="t", text="x"))
    [entity] = [e for e in CODES if question == episode(e)[0]]
    return entity


def expected_episode(tokenizer, url: str, pid: str) -> tuple[list[int], list[int]]:
    """The tokens and loss mask of the episode the policy plays for prompt ``pid``: the entity the server asks
    about, searched, then answered; the answer's turn ends at its call's stop string (no EOS)."""
    ids, mask = episode_ids(tokenizer, *episode(entity_of(url, pid)), tools=TOOLS)
    return ids[:-1], mask[:-1]


@needs_server
def test_the_tools_are_listed_and_each_call_the_model_makes_is_stepped_on_its_session(lookup, policy):
    """The server's tools are the schemas the template renders; the model's search call is stepped and its
    document comes back as a tool turn (not trained on); the answer call's step gives the reward and ends it."""
    from producers.hf_engine import HFEngine

    engine = HFEngine(policy)
    workflow = get_workflow("openenv", url=lookup, max_turns=3)
    prompt = Prompt(prompt_id=PROMPT_ID, source="openenv", task_type="lookup", text="unused", n_samples=2)

    async def main():
        batcher = EngineBatcher(engine)
        try:
            [group] = await workflow.rollout(prompt, {"actor": batcher},
                                             SamplingParams(max_new_tokens=100, temperature=0.0), {})
            return group, workflow.env.actions, workflow.env.tool_schemas()
        finally:
            batcher.close()
            await workflow.close()
    group, actions, schemas = asyncio.run(main())
    assert (actions, schemas) == ("mcp", TOOLS)
    assert workflow.env.tools == {}  # forgotten at close, listed again at the next open
    ids, mask = expected_episode(engine.tokenizer, lookup, prompt.prompt_id)
    assert group.workflow == "openenv" and len(group.samples) == 2
    for s in group.samples:
        assert (s.input_ids.tolist(), s.loss_mask.tolist()) == (ids, mask)
        assert (s.versions == np.where(s.loss_mask == 1, 0, -1)).all()
        assert (s.reward, s.turns) == (1.0, 2)


@needs_server
def test_an_unknown_tool_bad_arguments_a_raising_tool_and_a_malformed_call_are_observations(lookup):
    """One turn of five calls: each failure is an ``error:`` tool message the model sees, only the known tools
    step the server, the malformed call is answered with the parser's error, and the episode goes on to its
    answer."""
    workflow = get_workflow("openenv", url=lookup)
    env = workflow.env
    prompt = Prompt(prompt_id="lookup-errors", source="openenv", task_type="lookup", text="unused")
    entity = entity_of(lookup, prompt.prompt_id)
    text = "\n".join([call_text("lookup_code", {"name": entity}), call_text("search", {"q": entity}),
                      call_text("search", {"query": "nothing"}), "<tool_call>{not json}</tool_call>",
                      call_text("search", {"query": entity})])

    async def main():
        await env.start()
        state: dict = {}
        try:
            messages = await env.begin_episode(prompt, state)
            turn = env.parser.parse(text)
            answers = await env.env_response(messages + [turn.message()], turn, state)
            went_on = not env.is_completed(messages, turn, state)
            steps = (await state["session"].request({"type": "state"}))["step_count"]
            final = env.parser.parse(call_text("answer", {"code": CODES[entity]}), first_id=4)
            answered = await env.env_response(messages, final, state)
            return messages, answers, went_on, steps, answered, env.is_completed(messages, final, state), state
        finally:
            await env.end_episode(state)
            await workflow.close()
    before = environment_errors()
    messages, answers, went_on, steps, answered, ended, state = asyncio.run(main())
    after = environment_errors()
    # counted: the unknown tool (ours), the bad arguments and the raising tool (the server's errors)
    assert after["tool_call_errors"] - before["tool_call_errors"] == 3
    assert messages == [{"role": "user", "content": f"What is the code of {entity}?"}]
    unknown, bad, raised, found, malformed = answers
    assert unknown == {"role": "tool", "tool_call_id": "call_0", "name": "lookup_code",
                       "content": "error: no tool named 'lookup_code'; the tools are ['answer', 'search']"}
    assert bad["content"].startswith("error: 2 validation errors for call[search]")
    assert "query\n  Missing required argument" in bad["content"]
    assert raised["content"] == "error: Error calling tool 'search': no document matches 'nothing'"
    assert found == {"role": "tool", "tool_call_id": "call_3", "name": "search",
                     "content": f"the code of {entity} is {CODES[entity]}"}
    assert malformed["role"] == "tool" and malformed["content"].startswith("error: malformed tool call '{not json}'")
    assert went_on and steps == 3  # the unknown tool did not reach the server
    assert answered == [{"role": "tool", "tool_call_id": "call_4", "name": "answer", "content": "correct"}]
    assert ended and (state["return"], state["done"], state["tool_calls"]) == (1.0, True, 5)
    # a turn that makes no call is the model's answer: the episode ends there
    assert env.is_completed(messages, env.parser.parse("846"), {"done": False})


@needs_server
def test_a_raas_worker_rolls_out_an_mcp_environment_from_a_run_config(tmp_path, lookup, policy):
    """``workflow: {name: openenv, options: {url}}`` and nothing else: a RaaS worker lists the tools, the policy
    calls them, and the group on the trajectories topic holds the episodes and the server's rewards."""
    server, url = start_game(tmp_path / "lookup.log", script=LOOKUP)
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: oemcp{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: local://{tmp_path / 'bus'}
policies:
  actor: {{model: {policy}}}
workflow: {{name: openenv, options: {{url: "{url}", max_turns: 3}}}}
data: {{sources: [{{name: arith, limit: 1}}], n_samples: 2}}
sampling: {{max_new_tokens: 100, temperature: 0.05}}  # the replayed episode: near greedy
raas: {{batch_prompts: 1, max_inflight_groups: 1000, max_episodes: 2}}
""")
    group, calls, tokenizer = roll_out_one_group(path, server)
    ids, mask = expected_episode(tokenizer, lookup, group.prompt_id)  # the same game on the module's server
    assert (group.prompt_id, group.workflow, calls, len(group.samples)) == (PROMPT_ID, "openenv", None, 2)
    assert all((s.input_ids.tolist(), s.loss_mask.tolist(), s.reward) == (ids, mask, 1.0) for s in group.samples)


@pytest.mark.parametrize("options, message", [
    ({"actions": "both"}, r"options.actions must be one of \['typed', 'mcp'\] \(or unset: detected from the "
                          r"server\), got 'both'"),
    ({"parser": "qwen9"}, r"options.parser: unknown tool parser 'qwen9'; registered: .*hermes"),
])
def test_a_bad_mcp_option_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        get_workflow("openenv", url="http://127.0.0.1:1", **options)


@needs_server
def test_options_that_contradict_the_servers_actions_are_refused_naming_them(lookup, game):
    with pytest.raises(ValueError, match=r"options.actions is 'typed', but the action of .* is OpenEnv's MCP "
                                         r"call_tool action \(use actions: mcp, or leave it unset\)"):
        start_env(get_workflow("openenv", url=lookup, actions="typed"))
    with pytest.raises(ValueError, match=r"options.action_field is for typed actions; the actions of .* are MCP "
                                         r"tool calls"):
        start_env(get_workflow("openenv", url=lookup, action_field="tool_name"))
    with pytest.raises(ValueError, match=r"options.actions is 'mcp', but the action of .* is 'GuessAction' "
                                         r"\(fields \['message', 'metadata'\]\), not OpenEnv's MCP call_tool action"):
        start_env(get_workflow("openenv", url=game, actions="mcp"))
    with pytest.raises(ValueError, match=r"options.parser is for MCP-tool environments; the action of .* is typed"):
        start_env(get_workflow("openenv", url=game, parser="hermes"))
