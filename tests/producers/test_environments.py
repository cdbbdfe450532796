"""Bring-your-own environments (:mod:`producers.environments`, :mod:`producers.mcp_tools`): typed tools and their
JSON schemas, the hermes parser, rubrics, stop strings, MCP tools over a real stdio server, and whole episodes of
a tiny hermes-speaking policy against the real search server, token for token."""
import asyncio
import sys
import uuid
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

from astraflow.config import load_config
from producers.engine_batcher import EngineBatcher
from producers.engines import SamplingParams
from producers.environments import (Environment, EnvironmentWorkflow, HermesParser, ParsedTurn, Rubric, ToolCall,
                                    environment_errors, function_tool, get_tool_parser, render_delta)
from producers.raas import RaasWorker
from producers.search_server import SearchServer
from producers.search_tool import SearchTool
from producers.workflows import get_workflow
from tests.producers.test_agentic import start_search_server
from topics.bus import connect
from topics.schemas import Prompt

sys.path.insert(0, str(Path(__file__).parent))
from env_rig import HERMES_TEMPLATE, PARALLEL, call_text, cached_hermes_policy, episode_ids, roll_out_one_group  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EPISODE = ("code of zovob?\n", "zovob", "the code of zovob is 846", "846")
SEARCH_ENV = f"{ROOT}/examples/environments/search_env.py:load_environment"


def lookup(name: str, field: Literal["code", "doc"] = "code", limit: int = 1) -> str:
    """Look an entity up.

    Args:
        name: the entity's name.
        field: what to return.
    """
    return f"{name}:{field}:{limit}"


async def slow_add(a: int, b: int) -> int:
    """Add two integers."""
    await asyncio.sleep(0)
    return a + b


async def hang(query: str) -> str:
    """Never answer."""
    await asyncio.Event().wait()
    return query


def leave(code: int) -> str:
    """Exit the process."""
    raise SystemExit(code)


def test_a_typed_function_becomes_an_openai_tool_schema_and_its_arguments_are_validated():
    tool = function_tool(lookup)
    assert tool.schema() == {"type": "function", "function": {
        "name": "lookup", "description": "Look an entity up.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
            "name": {"type": "string", "description": "the entity's name."},
            "field": {"type": "string", "enum": ["code", "doc"], "default": "code", "description": "what to return."},
            "limit": {"type": "integer", "default": 1}}}}}
    env = Environment(tools=[lookup, slow_add, hang, leave], tool_timeout_s=0.5)

    async def calls() -> list[str]:
        return [await env.call_tool(ToolCall("lookup", {"name": "kavor", "limit": "3"}, "c0")),
                await env.call_tool(ToolCall("slow_add", {"a": 2, "b": 40}, "c1")),
                await env.call_tool(ToolCall("lookup", {"field": "age"}, "c2")),
                await env.call_tool(ToolCall("nope", {}, "c3")),
                await env.call_tool(ToolCall("hang", {"query": "q"}, "c4")),
                await env.call_tool(ToolCall("leave", {"code": 3}, "c5"))]

    before = environment_errors()["tool_call_errors"]
    ok, added, bad, unknown, hung, left = asyncio.run(calls())
    assert (ok, added) == ("kavor:code:3", "42")
    assert bad.startswith("error: bad arguments for lookup") and "name" in bad and "field" in bad
    assert unknown == "error: no tool named 'nope'; the tools are ['hang', 'leave', 'lookup', 'slow_add']"
    assert hung == "error: hang did not answer in 0.5 s"
    assert left == "error: leave failed: RuntimeError: the tool raised SystemExit(3)"
    assert environment_errors()["tool_call_errors"] == before + 4  # a RaaS worker's tool_call_errors_total
    with pytest.raises(TypeError, match="parameter 'x' has no type hint"):
        function_tool(lambda x: x)
    with pytest.raises(ValueError, match="two tools are named 'lookup'"):
        Environment(tools=[lookup, lookup])


def test_the_hermes_parser_reads_calls_and_reports_malformed_ones():
    parser = get_tool_parser("hermes")
    assert isinstance(parser, HermesParser) and parser.stop == ("</tool_call>",)
    text = ("Let me look.\n" + call_text("search", {"query": "kavor"}) + "\n"
            + '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
            + "<tool_call>{not json}</tool_call>" + '<tool_call>{"arguments": {}}</tool_call>')
    before = environment_errors()["tool_parse_errors"]
    turn = parser.read(text, first_id=4)
    assert environment_errors()["tool_parse_errors"] == before + 2  # a RaaS worker's tool_parse_errors_total
    assert turn.content == "Let me look."
    assert turn.calls == (ToolCall("search", {"query": "kavor"}, "call_4"), ToolCall("add", {"a": 1}, "call_5"))
    assert len(turn.errors) == 2 and all(e.startswith("error: malformed tool call") for e in turn.errors)
    assert turn.message()["tool_calls"][0] == {"id": "call_4", "type": "function",
                                               "function": {"name": "search", "arguments": {"query": "kavor"}}}
    assert parser.parse("381") == ParsedTurn(content="381")
    with pytest.raises(KeyError, match="unknown tool parser 'qwen9'; registered: .*hermes"):
        get_tool_parser("qwen9")


def test_a_rubric_is_the_weighted_sum_of_the_functions_a_run_declares():
    def exact(completion, answer) -> float:
        return float(completion[-1]["content"] == answer)

    async def turns(state) -> float:
        return float(state["turns"])

    rubric = Rubric([(exact, 2.0), (turns, -0.25)])
    prompt = Prompt(prompt_id="p", source="s", task_type="search", text="q", answer="381")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "381"}]
    assert asyncio.run(rubric.score(prompt, messages, 1, {"turns": 2})) == (1.5, {"exact": 1.0, "turns": 2.0})
    with pytest.raises(TypeError, match="takes \\['reply'\\]"):
        Rubric([lambda reply: 1.0])


def test_the_delta_of_a_tool_turn_is_what_the_template_renders_after_the_assistant_turn(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = HERMES_TEMPLATE
    tools = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    assert render_delta(tok, tools, None) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n"
                                              "<tool_response>\nb\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def hermes_dir() -> Path:
    return cached_hermes_policy([EPISODE])


def search_prompt(n: int) -> Prompt:
    return Prompt(prompt_id="p0", source="search", task_type="search", text=EPISODE[0], answer=EPISODE[3],
                  n_samples=n)


def run_rollout(workflow, engine, prompt: Prompt, search: bool = True, max_new_tokens: int = 80) -> tuple[list, int]:
    """The workflow's rollout of ``prompt`` on ``engine`` with a real search server; (groups, search calls)."""
    async def main():
        async with SearchServer() as server:
            tool = SearchTool(server.url)
            batcher = EngineBatcher(engine)
            try:
                groups = await workflow.rollout(prompt, {"actor": batcher},
                                                SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
                                                {"search": tool} if search else {})
            finally:
                batcher.close()
                await tool.close()
                await workflow.close()
            return groups, tool.calls
    return asyncio.run(main())


def test_an_episode_calls_the_search_server_and_its_tokens_are_the_rendered_chat(hermes_dir):
    from producers.hf_engine import HFEngine

    engine = HFEngine(hermes_dir)
    workflow = get_workflow("environment", env=SEARCH_ENV, env_args={"call_weight": 0.5})
    [group], calls = run_rollout(workflow, engine, search_prompt(3))
    ids, mask = episode_ids(engine.tokenizer, *EPISODE)
    assert calls == 3 and group.workflow == "environment"
    for s in group.samples:
        # the call ended at the stop string, the tool turn is the template's delta: the prompt's and the
        # generated tokens are never re-tokenized, and only the model's tokens are trained on
        assert s.input_ids.tolist() == ids
        assert s.loss_mask.tolist() == mask
        assert (s.versions == np.where(s.loss_mask == 1, 0, -1)).all()
        assert (s.behavior_logprobs[s.loss_mask == 0] == 0).all() and (s.behavior_logprobs[s.loss_mask == 1] < 0).all()
        assert (s.reward, s.turns, s.finish_reason) == (1.5, 2, "stop")  # 1 (the code) + 0.5 x 1 call


def test_an_episode_ends_at_max_turns_and_an_unconfigured_run_tool_is_an_observation(hermes_dir):
    from producers.hf_engine import HFEngine

    engine = HFEngine(hermes_dir)
    [group], calls = run_rollout(EnvironmentWorkflow(env=SEARCH_ENV, max_turns=1), engine, search_prompt(2))
    ids, mask = episode_ids(engine.tokenizer, *EPISODE)
    call_end = mask.index(0, mask.index(1))  # the prompt and the call, without the tool turn or the answer
    assert calls == 0
    assert [s.input_ids.tolist() for s in group.samples] == [ids[:call_end]] * 2
    assert [s.reward for s in group.samples] == [0.0, 0.0]
    workflow = EnvironmentWorkflow(env=SEARCH_ENV)
    env = workflow.env
    answer = asyncio.run(env.call_tool(ToolCall("search", {"query": "zovob"}, "c0")))
    assert answer == "error: search failed: KeyError: \"the environment calls the run's tool 'search', and the " \
                     "config does not configure it (tools.search; configured: none)\""


def test_a_parallel_turn_makes_every_call_and_a_default_turn_ends_at_its_first():
    from producers.hf_engine import HFEngine

    engine = HFEngine(cached_hermes_policy([PARALLEL]))
    prompt = Prompt(prompt_id="p1", source="search", task_type="search", text=PARALLEL[0], answer=PARALLEL[3],
                    n_samples=2)
    ids, mask = episode_ids(engine.tokenizer, *PARALLEL)
    workflow = get_workflow("environment", env=SEARCH_ENV, parallel_tool_calls=True)
    [group], calls = run_rollout(workflow, engine, prompt, max_new_tokens=200)
    assert calls == 4  # both calls of each sample's first turn, run concurrently
    for s in group.samples:
        assert (s.input_ids.tolist(), s.loss_mask.tolist()) == (ids, mask)
        assert (s.reward, s.turns) == (1.0, 2)
    # by default the turn stops as its first call closes: not a token is sampled past it
    [group], calls = run_rollout(get_workflow("environment", env=SEARCH_ENV, max_turns=1), engine, prompt,
                                 max_new_tokens=200)
    first_call_end = mask.index(1) + len(engine.tokenizer.encode(call_text("search", {"query": "zovob"}),
                                                                 add_special_tokens=False))
    assert calls == 0 and [s.input_ids.tolist() for s in group.samples] == [ids[:first_call_end]] * 2


def test_a_template_that_renders_no_tools_is_refused(tiny_model_dir):
    from producers.hf_engine import HFEngine

    engine = HFEngine(tiny_model_dir)  # its template renders the message contents only
    with pytest.raises(ValueError, match="chat template of policy 'actor' renders no tools"):
        run_rollout(EnvironmentWorkflow(env=SEARCH_ENV), engine, search_prompt(1))


@pytest.mark.parametrize("options, message", [
    ({}, "options.env is required"),
    ({"env": "examples/environments/nope.py:load_environment"}, "cannot import"),
    ({"env": SEARCH_ENV, "env_args": {"max_turn": 3}}, "unexpected keyword argument 'max_turn'"),
    ({"env": f"{ROOT}/examples/environments/search_env.py:tool_calls_made", "env_args": {"state": {}}},
     "returned float, not an Environment"),
    ({"env": SEARCH_ENV, "parallel_tool_calls": "yes"}, "options.parallel_tool_calls must be true or false"),
    ({"env": SEARCH_ENV, "max_turns": "abc"}, "options.max_turns must be an integer >= 1, got 'abc'"),
    ({"env": SEARCH_ENV, "env_args": {"max_turns": "x"}}, r"options.env_args \{'max_turns': 'x'\} raised TypeError"),
    ({"env": f"{ROOT}/tests/producers/env_rig.py:no_such_thing"}, "options.env: .* has no 'no_such_thing'"),
])
def test_a_bad_environment_option_is_refused_naming_it(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        get_workflow("environment", **options)


def test_an_mcp_servers_tools_are_listed_and_called_concurrently():
    pytest.importorskip("mcp")
    workflow = get_workflow("environment", env=SEARCH_ENV, env_args={"mcp": True})
    env = workflow.env

    async def main():
        await env.start()
        try:
            schemas = {s["function"]["name"]: s["function"] for s in env.tool_schemas()}
            turn = HermesParser().parse(call_text("search", {"query": "zovob"}) + call_text("add", {"a": 2, "b": 40})
                                        + call_text("add", {"a": "x", "b": 1}) + call_text("search", {"query": "qq"}))
            state: dict = {}
            answers = await env.env_response([], turn, state)
            return schemas, answers, state
        finally:
            await env.close()

    schemas, answers, state = asyncio.run(main())
    assert sorted(schemas) == ["add", "search"]
    assert schemas["add"]["parameters"]["properties"]["a"]["type"] == "integer"
    assert schemas["search"]["description"].startswith("Search the knowledge base")
    assert [a["content"] for a in answers[:2]] + [answers[3]["content"]] == \
        ["the code of zovob is 846", "42", "no results"]
    assert answers[2]["content"].startswith("error: ") and "valid integer" in answers[2]["content"]
    assert [a["tool_call_id"] for a in answers] == ["call_0", "call_1", "call_2", "call_3"]
    assert state == {"tool_calls": 4} and env.tools == {}  # closed: the server's tools are gone with it


def env_run_config(tmp_path: Path, model: Path, tools: str) -> Path:
    """A run config of the search environment (one prompt, 3 samples) with ``tools`` (YAML flow mapping)."""
    path = tmp_path / "run.yaml"
    path.write_text(f"""
run: env{uuid.uuid4().hex[:8]}
run_dir: {tmp_path / 'run'}
bus: local://{tmp_path / 'bus'}
policies:
  actor: {{model: {model}}}
workflow: {{name: environment, options: {{env: "{SEARCH_ENV}", env_args: {{call_weight: 0.5}}}}}}
tools: {tools}
data: {{sources: [{{name: search, limit: 1}}], n_samples: 3}}
sampling: {{max_new_tokens: 80, temperature: 0.05}}  # the replayed episode: near greedy
raas: {{batch_prompts: 1, max_inflight_groups: 1000, max_episodes: 3}}
""")
    return path


def test_a_worker_refuses_a_config_without_the_run_tools_its_environment_calls(tmp_path, tiny_model_dir):
    cfg = load_config(env_run_config(tmp_path, tiny_model_dir, "{}"))
    with pytest.raises(ValueError, match="tools.search: workflow 'environment' calls the tool 'search', and the "
                                         "config does not configure it"):
        RaasWorker(cfg.raas_section(), 0, connect(cfg.bus, cfg.kafka))


def test_a_raas_worker_rolls_the_environment_out_with_its_episode_scheduler(tmp_path, hermes_dir):
    """The environment workflow from a run config, in a RaaS worker, against the search server as
    ``astraflow run`` starts it: each prompt's group holds the episodes' token sequences, rewards and versions."""
    server, url = start_search_server(tmp_path / "search.log")
    path = env_run_config(tmp_path, hermes_dir, f'{{search: {{url: "{url}"}}}}')
    group, calls, tokenizer = roll_out_one_group(path, server)
    ids, mask = episode_ids(tokenizer, *EPISODE)
    assert (group.workflow, calls, len(group.samples)) == ("environment", 3, 3)
    assert all(s.input_ids.tolist() == ids and s.loss_mask.tolist() == mask and s.reward == 1.5
               for s in group.samples)
