"""Look-up, an OpenEnv environment whose actions are MCP tools, served with ``openenv-core`` (its
``MCPEnvironment`` over FastMCP).

Each episode asks for the code of one entity of a small knowledge base (drawn from the reset's ``seed``, so the
samples of one group get the same question). The agent has two tools:

- ``search(query)``: the document about the entity named in ``query``; it raises (a tool error the agent is told
  about) when the query names none;
- ``answer(code)``: submits the code; the step's reward is 1.0 when it is right, 0.0 otherwise, and the episode
  ends there.

Clients list the tools with a ``list_tools`` action and call them with ``call_tool`` actions (``GET /schema``
gives OpenEnv's ``CallToolAction`` as the action), e.g. the ``openenv`` workflow, which renders them for the
policy's chat template and steps each call the model makes.

Runs in the venv of ``scripts/install_openenv.sh`` (``.venv-openenv``: openenv-core, fastmcp and its server stack):
    .venv-openenv/bin/python examples/environments/openenv_lookup.py --port 8000 [--max-sessions 64]
"""
from __future__ import annotations

import argparse
import random
import uuid
from typing import Any, Optional

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

#: entity -> its code: the knowledge base
CODES = {"zovob": "846", "kavor": "381"}


class QuestionObservation(Observation):
    """The reset's observation: the question of the episode."""

    message: str


class LookupState(State):
    """The entity asked about, and whether the episode's answer was given."""

    entity: str = ""
    answered: bool = False


class LookupEnvironment(MCPEnvironment):
    """One session's episode: a question, the ``search`` and ``answer`` tools (module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own instance (and FastMCP server)

    def __init__(self) -> None:
        mcp = FastMCP("lookup")
        self._state = LookupState()
        self._reward = 0.0

        @mcp.tool
        def search(query: str) -> str:
            """Search the knowledge base for the document about an entity.

            Args:
                query: words naming the entity.
            """
            found = [e for e in CODES if e in query.lower()]
            if not found:
                raise ValueError(f"no document matches {query!r}")
            return f"the code of {found[0]} is {CODES[found[0]]}"

        @mcp.tool
        def answer(code: str) -> str:
            """Give the code asked for; this ends the episode.

            Args:
                code: the code.
            """
            self._state.answered = True
            right = code.strip() == CODES[self._state.entity]
            self._reward = 1.0 if right else 0.0
            return "correct" if right else "wrong"

        super().__init__(mcp)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              **kwargs: Any) -> QuestionObservation:
        entity = random.Random(seed).choice(sorted(CODES))
        self._state = LookupState(episode_id=episode_id or str(uuid.uuid4()), step_count=0, entity=entity)
        return QuestionObservation(message=f"What is the code of {entity}?")

    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        """A tool call's observation, with the step's reward (the answer's) and ``done`` once answered."""
        self._reward = 0.0
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            obs.reward, obs.done = self._reward, self._state.answered
        return obs

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        raise ValueError(f"only MCP actions (list_tools, call_tool) are accepted, got {type(action).__name__}")

    @property
    def state(self) -> LookupState:
        return self._state


def main() -> None:
    """Serve the environment on 127.0.0.1 (HTTP ``/health``, ``/schema``; WebSocket sessions on ``/ws``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-sessions", type=int, default=64, help="concurrent WebSocket sessions")
    args = ap.parse_args()
    app = create_app(LookupEnvironment, CallToolAction, CallToolObservation, env_name="lookup",
                     max_concurrent_envs=args.max_sessions)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
