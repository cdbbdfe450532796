"""The search task as an environment (:mod:`producers.environments`): one tool, ``search``, over the run's
search server (config ``tools.search``), called in the hermes format; the reward is the search task's own (the
last answer is the entity's code). ``workflow: {name: environment, options: {env:
"examples/environments/search_env.py:load_environment"}}``; :func:`load_environment` with ``mcp=True`` takes the
tools from the MCP server :mod:`examples.environments.mcp_search_server` instead.
"""
from __future__ import annotations

import sys
from pathlib import Path

from producers.environments import Environment, Rubric, run_tool, task_reward
from topics.schemas import Prompt


def tool_calls_made(state: dict) -> float:
    """How many tool calls the episode made (weight 0 by default: a metric, not a reward)."""
    return float(state.get("tool_calls", 0))


class SearchEnvironment(Environment):
    """The search environment; with ``strip_question`` its user message is the question without the newline the
    search source ends it with (``code of kavor?``), as chat models, ``tiny-search-hermes`` among them, were
    trained to see it."""

    def __init__(self, *args, strip_question: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.strip_question = strip_question

    def initial_messages(self, prompt: Prompt) -> list[dict]:
        """As :meth:`Environment.initial_messages`, the user messages stripped when ``strip_question`` is set."""
        messages = super().initial_messages(prompt)
        if not self.strip_question:
            return messages
        return [dict(m, content=m["content"].strip()) if m["role"] == "user" else m for m in messages]


def load_environment(max_turns: int = 2, mcp: bool = False, call_weight: float = 0.0,
                     strip_question: bool = False) -> Environment:
    """The search environment: the search tool and a rubric of the task reward plus ``call_weight`` x the
    number of tool calls.

    Args:
        max_turns: the most model turns (one search, then the answer: 2).
        mcp: take the ``search`` tool from the MCP server (a subprocess) instead of the run's search server.
        call_weight: the weight of :func:`tool_calls_made` in the reward.
        strip_question: send the question without its trailing newline (:class:`SearchEnvironment`).
    """
    rubric = Rubric([(task_reward, 1.0), (tool_calls_made, call_weight)])
    if mcp:
        from producers.mcp_tools import MCPServer

        server = MCPServer([sys.executable, str(Path(__file__).with_name("mcp_search_server.py"))])
        return SearchEnvironment(rubric=rubric, max_turns=max_turns, mcp_servers=[server],
                                 strip_question=strip_question)
    return SearchEnvironment(tools=[run_tool("search", "Search the knowledge base.", "query")], rubric=rubric,
                             max_turns=max_turns, strip_question=strip_question)
